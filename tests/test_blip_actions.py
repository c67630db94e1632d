"""BLIP through the command line: `--image` checked before any model loads, run / compare / chat / benchmark /
export / list on the tiny captioner, and `accuracy` refused in one sentence."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from conftest import IMAGES_DIR, PHOTOS, needs_blip_tokenizer, needs_shared
from test_cli import run_cli

FAST = ["--iterations", "1", "--warmup", "0"]


def _bad_files(tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    empty = tmp_path / "empty"
    empty.mkdir()
    return [(tmp_path / "missing.png", "does not exist"), (text, "is not an image that Pillow can read"),
            (empty, "is a folder without PNG or JPEG files")]


@pytest.mark.parametrize("action", ["run", "benchmark", "chat", "compare"])
def test_bad_image_is_one_sentence_before_loading(action, capsys, tmp_path):
    """A missing, unreadable or non-image file, or a folder without images: one sentence naming it, exit 2, and no
    model loaded (the variant's hub weights are unreachable offline: a load would fail differently)."""
    for path, why in _bad_files(tmp_path):
        code, out, err = run_cli(capsys, action, "BLIP", "frameworks", "--image", path)
        assert code == 2 and err.startswith(f"error: --image {path} {why}"), err
        assert "loading" not in err and err.count("\n") == 1


def test_image_flag_on_a_text_family_and_accuracy_on_blip_are_usage_errors(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "GPT2", "frameworks", "--image", tmp_path / "x.png")
    assert code == 2 and "--image applies to image-to-text families (BLIP); GPT2 reads text" in err
    code, _, err = run_cli(capsys, "accuracy", "BLIP", "frameworks", "--random-weights")
    assert code == 2 and "LAMBADA is a text benchmark and BLIP captions images" in err and "loading" not in err


@needs_blip_tokenizer
@needs_shared(IMAGES_DIR)
def test_run_compare_and_export_caption_the_photos(blip_dir, onnx_work_dir, capsys, tmp_path):
    model = ["--torch-dir", blip_dir, "--working-dir", onnx_work_dir, "--output-seq-len", 5, *FAST]
    code, out, err = run_cli(capsys, "run", "BLIP", "frameworks", "onnxrt", *model, "--image", PHOTOS[0],
                             "--json", tmp_path / "run.json")
    assert code == 0, err
    results = json.loads((tmp_path / "run.json").read_text())["results"]
    captions = {row["backend"]: row["output"] for row in results[1]["rows"]}
    assert set(captions) == {"frameworks", "frameworks (HF generate)", "onnxrt"}
    assert len(set(captions.values())) == 1 and all(captions.values())  # one caption, on every backend
    assert [row["samples"] for row in results[0]["rows"]] == [1, 1, 1] and results[0]["rows"][2]["generation_ms"] > 0
    assert "'-': the given images carry no labels." in results[0]["notes"][0]
    code, out, err = run_cli(capsys, "compare", "BLIP", "frameworks", "onnxrt", *model)  # the checkpoint's photos
    assert code == 0, err
    assert "skimage_chelsea.png" in out and "coco_000000039769.png + 'a picture of'" in out and "speed vs" in out
    assert "label accuracy: share of the label's new tokens" in out  # compare says what the column means too
    code, out, err = run_cli(capsys, "export", "BLIP", "onnxrt", "--torch-dir", blip_dir, "--working-dir",
                             onnx_work_dir, "--info", "-o", tmp_path / "standalone")
    assert code == 0, err
    import nndf  # the standalone folder captions as the run did, from its graphs and processor alone

    assert nndf.load_exported(tmp_path / "standalone").caption([PHOTOS[0]], max_new_tokens=5) == [captions["onnxrt"]]
    for graph in ("encoder", "cross", "decoder"):
        assert f"{graph}.onnx" in out
    sizes = [line.split(".onnx")[1].strip() for line in out.splitlines() if line.startswith("onnxrt ")]
    assert len(sizes) == 3 and len(set(sizes)) == 3, sizes  # each graph's own size, not their shared folder's
    assert "encoder: pixel_values" in out and "[1, 3, 32, 32] float" in out and "[1, 17, 48] float" in out


@needs_blip_tokenizer
@needs_shared(IMAGES_DIR)
def test_a_caption_too_long_for_the_text_decoder_is_refused_before_the_machine_and_the_load(blip_dir, capsys,
                                                                                             tmp_path, monkeypatch):
    """A sample's text prefix plus --output-seq-len against the text decoder's positions (the flag alone leaves room
    for a prompt): said (exit 2) before trt's refusal of a machine without a GPU, and before any graph is exported,
    as a text model's samples are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    work = tmp_path / "work"
    code, out, err = run_cli(capsys, "run", "BLIP", "onnxrt", "trt", "--torch-dir", blip_dir, "--working-dir", work,
                             "--output-seq-len", 62)  # the checkpoint's photos, one with the prefix 'a picture of'
    assert (code, out) == (2, "") and not work.exists() and "loading" not in err
    assert "error: the sample of models/blip/checkpoint.toml 'coco_000000039769.png + 'a picture of'': a text " \
           "prompt of 4 tokens plus 62 new tokens is 66, more than the 64 positions of this model's text decoder " \
           "(--output-seq-len sets the new tokens)" in err, err


@needs_blip_tokenizer
@needs_shared(IMAGES_DIR)
def test_chat_reads_image_lines_and_goes_on_after_a_bad_one(blip_dir, capsys, monkeypatch, tmp_path):
    lines = f"{PHOTOS[0]} a picture of\n{tmp_path / 'missing.png'}\n{PHOTOS[1]}\nexit\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code, out, err = run_cli(capsys, "chat", "BLIP", "frameworks", "--torch-dir", blip_dir, "--output-seq-len", 4)
    assert code == 0, err
    assert f"error: image {tmp_path / 'missing.png'} does not exist" in out
    assert "2 replies" in out and out.count("[frameworks]") == 2
    assert "skimage_chelsea.png a picture of" in out and "coco_000000039769.png" in out
    monkeypatch.setattr(sys, "stdin", io.StringIO("a picture of\n\nexit\n"))
    code, out, err = run_cli(capsys, "chat", "BLIP", "frameworks", "--torch-dir", blip_dir, "--output-seq-len", 4,
                             "--image", PHOTOS[0])
    assert code == 0 and "2 replies" in out, err  # a prefix, then an empty line: the image without one
    code, out, err = run_cli(capsys, "chat", "BLIP", "frameworks", "--torch-dir", blip_dir, "--image", *PHOTOS)
    assert code == 2 and "chat --image takes one image (it got 2)" in err and "loading" not in err
    code, out, err = run_cli(capsys, "benchmark", "BLIP", "frameworks", "--torch-dir", blip_dir, "--image", *PHOTOS,
                             "--batch-size", 4)
    assert code == 2 and "--image gave 2 image(s), and they are the batch; --batch-size 4 cannot apply" in err
    assert "loading" not in err


def test_benchmark_on_random_pixels_reports_the_vision_encoder(blip_dir, onnx_work_dir, capsys, tmp_path):
    code, out, err = run_cli(capsys, "benchmark", "BLIP", "frameworks", "onnxrt", "--torch-dir", blip_dir,
                             "--working-dir", onnx_work_dir, "--batch-size", 2, "--output-seq-len", 4, *FAST,
                             "--json", tmp_path / "b.json")
    assert code == 0, err
    result = json.loads((tmp_path / "b.json").read_text())["results"][0]
    assert "images + no text prefix + 4 new tokens" in result["title"]
    assert all(row["encoder_ms"] > 0 and row["decode_ms"] > 0 for row in result["rows"])
    code, out, err = run_cli(capsys, "benchmark", "BLIP", "frameworks", "--torch-dir", blip_dir, "--input-seq-len", 3,
                             "--output-seq-len", 4, *FAST)
    assert code == 0 and "3-token text prefix" in out, err


def test_list_shows_blip(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "Salesforce/blip-image-captioning-base" in out and "blip-image-captioning-large" in out
