"""`run.py triton` without a server: what it refuses before the model loads, and what a written folder serves.

The served model is loaded as the server's `model.py` loads it (`nndf.triton.served.load_served`), so these run in
seconds; test_triton_generative.py and test_triton_serving.py serve the folder for real.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] (Triton's config schema)")

import nndf  # noqa: E402
import nndf.actions.triton  # noqa: E402
from nndf.cli import main as run_py  # noqa: E402
from conftest import TOKENIZER_DIR, needs_shared  # noqa: E402


@pytest.fixture
def no_load(monkeypatch):
    """The action's model load, made to fail the test: each refusal here must come before it."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(nndf.actions.triton, "open_models", loaded)


def triton(tmp_path, *flags):
    return run_py(["triton", "GPT2", "onnxrt", "--variant", "gpt2", "--random-weights", "-wd", str(tmp_path / "work"),
                   *flags])


def test_seed_is_refused_since_each_request_brings_its_own(tmp_path, capsys, no_load):
    assert triton(tmp_path, "-o", str(tmp_path / "models"), "--seed", "5") == 2
    err = capsys.readouterr().err
    assert "--seed does not apply to triton: a sampled request's draws are seeded by its own SEED input" in err
    assert "Traceback" not in err


def test_more_default_beams_than_rows_is_refused_before_the_load(tmp_path, capsys, no_load):
    assert triton(tmp_path, "-o", str(tmp_path / "models"), "--num-beams", "5", "--max-rows", "4") == 2
    assert "--num-beams 5 is more than the 4 rows the model generates at once (--max-rows)" in capsys.readouterr().err


def test_output_seq_len_refusal_says_what_a_request_gets(tmp_path, capsys, no_load):
    assert triton(tmp_path, "-o", str(tmp_path / "models"), "--output-seq-len", "8") == 2
    assert "its MAX_NEW_TOKENS input (--max-new-tokens where it has none)" in capsys.readouterr().err


def test_what_stands_where_a_model_folder_goes_is_refused_before_the_load(tmp_path, capsys, no_load):
    """A file there was a NotADirectoryError traceback after the load and the export; a folder of the user's files
    was deleted. A model folder written before is replaced, as the docs say."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "gpt2").write_text("not a folder")
    assert triton(tmp_path, "-o", str(models)) == 2
    err = capsys.readouterr().err
    assert f"{models / 'gpt2'} is a file; the Triton model 'gpt2' needs a folder there" in err
    assert "Traceback" not in err
    (models / "gpt2").unlink()
    (models / "gpt2_stream").mkdir()
    (models / "gpt2_stream" / "notes.txt").write_text("the user's")
    assert triton(tmp_path, "-o", str(models), "--streaming") == 2
    assert "gpt2_stream is a folder of other files (no config.pbtxt)" in capsys.readouterr().err
    assert (models / "gpt2_stream" / "notes.txt").read_text() == "the user's"


def test_a_missing_tritonclient_is_said_after_the_flags_and_before_the_load(tmp_path, capsys, monkeypatch):
    """Where the `triton` extra is not installed: a wrong flag is still the first thing said (exit 2; the missing
    package hid it), and with right flags the missing package is said before the weights load or an export."""
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)
    assert triton(tmp_path, "-o", str(tmp_path / "models"), "--max-new-tokens", "5000") == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 5000 leaves no position for a prompt" in err and "tritonclient" not in err
    assert triton(tmp_path, "-o", str(tmp_path / "models")) == 1
    err = capsys.readouterr().err
    assert "needs tritonclient[grpc] (pip install 'nndf[triton]')" in err
    assert "loading" not in err and "export" not in err and not (tmp_path / "models").exists()


@needs_shared(TOKENIZER_DIR)
def test_the_target_language_is_served(tiny_gpt2_dir, onnx_work_dir, tmp_path):
    """--tgt-lang is the Model's forced first token (`nndf.load(tgt_lang=)` sets it), held by no graph or config:
    the served model lost it and answered in whatever language came first. Set here directly on the tiny GPT-2,
    since a tiny mBART-50 has no full language table; the folder must carry it to what the server loads."""
    from nndf.actions.common import encode_prompts
    from nndf.triton.generative import write_generative_repository
    from nndf.triton.served import load_served

    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir),
                      device="cpu")
    model.forced_bos_token_id = 42
    [folder] = write_generative_repository(tmp_path / "models", "gpt2", model, 2, scheduler="sequential")
    assert json.loads((folder / "1" / "nndf.json").read_text())["forced_bos_token_id"] == 42
    settings, served = load_served(folder / "1", str(tmp_path / "work"))
    # a forced first token is forced where the sequence is one token long: an encoder-decoder's decoder start, here
    # a one-token prompt
    ids, mask = encode_prompts(served.tokenizer, ["Hello"], use_mask=True, pad_side="left")
    assert ids.shape == (1, 1)
    ours = model.generate(ids, mask, max_new_tokens=3)
    assert int(model.new_tokens(ours, ids)[0, 0]) == 42
    assert served.generate(ids, mask, max_new_tokens=3).tolist() == ours.tolist()


@needs_shared(TOKENIZER_DIR)
def test_a_write_without_streaming_removes_the_earlier_streaming_twin(tiny_gpt2_dir, onnx_work_dir, tmp_path, capsys):
    """`<name>_stream` from an earlier --streaming write went on serving the old graph and settings beside the new
    model; written again without --streaming it is removed, said."""
    from nndf.triton.generative import write_generative_repository

    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir),
                      device="cpu")
    models = tmp_path / "models"
    assert [p.name for p in write_generative_repository(models, "gpt2", model, 2, streaming=True)] == \
        ["gpt2", "gpt2_stream"]
    # the twin's graph and weights are the model's, on disk once (hard links); their configs are their own
    weights = [p.relative_to(models / "gpt2") for p in (models / "gpt2").rglob("*") if p.suffix in (".onnx", ".data")]
    assert weights and all((models / "gpt2" / p).samefile(models / "gpt2_stream" / p) for p in weights)
    assert (models / "gpt2_stream" / "config.pbtxt").read_text() != (models / "gpt2" / "config.pbtxt").read_text()
    capsys.readouterr()
    write_generative_repository(models, "gpt2", model, 2)
    assert sorted(p.name for p in models.iterdir()) == ["gpt2"]
    assert f"removed {models / 'gpt2_stream'}: the streaming model of an earlier --streaming write" in \
        capsys.readouterr().err


@needs_shared(TOKENIZER_DIR)
def test_a_streaming_write_stopped_before_its_twin_leaves_no_old_twin(tiny_gpt2_dir, onnx_work_dir, tmp_path,
                                                                      monkeypatch):
    """The two folders are written one after the other: a write killed between them left the new model beside the
    old twin, which served the earlier graph and settings. The old twin goes first, so only the new model stands."""
    import nndf.triton.generative as generative

    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir),
                      device="cpu")
    models = tmp_path / "models"
    generative.write_generative_repository(models, "gpt2", model, 2, streaming=True)
    written = generative.write_model_folder

    def stopped_at_the_twin(output_dir, folder, *args, **kwargs):
        if folder == "gpt2_stream":
            raise KeyboardInterrupt
        return written(output_dir, folder, *args, **kwargs)

    monkeypatch.setattr(generative, "write_model_folder", stopped_at_the_twin)
    with pytest.raises(KeyboardInterrupt):
        generative.write_generative_repository(models, "gpt2", model, 2, max_new_tokens=7, streaming=True)
    assert sorted(p.name for p in models.iterdir()) == ["gpt2"]
    assert json.loads((models / "gpt2" / "1" / "nndf.json").read_text())["defaults"]["max_new_tokens"] == 7


@needs_shared(TOKENIZER_DIR)
def test_the_serve_line_quotes_a_repository_with_a_space(tiny_gpt2_dir, onnx_work_dir, tmp_path, capsys):
    """`-o "my models"`: the serve line said `tritonserver --model-repository .../my models`, which a shell splits
    into two arguments; it is quoted as a shell reads it."""
    models = tmp_path / "my models"
    assert run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(onnx_work_dir),
                   "-o", str(models), "--name", "gpt2"]) == 0
    assert f"serve it: tritonserver --model-repository '{models}' (its Python" in capsys.readouterr().out


@needs_shared(TOKENIZER_DIR)
@pytest.mark.parametrize("flags, rows", [([], 4), (["--max-rows", "6"], 6), (["--scheduler", "sequential"], 4)])
def test_info_shows_the_rows_the_served_model_runs(tiny_gpt2_dir, onnx_work_dir, tmp_path, capsys, flags, rows):
    """--info showed one row's shapes and KV cache (--batch-size's default), where the server runs up to --max-rows
    prompts together (continuous) or a request's --max-batch-size; the graph, reused, is the same."""
    assert run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(onnx_work_dir),
                   "-o", str(tmp_path / "models"), "--max-batch-size", "4", "--info", *flags]) == 0
    out = capsys.readouterr().out
    assert f"input_ids                         [1..{rows}, 1..128] int64" in out
    assert f"at {rows} rows x 128 positions" in out
    assert f"dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch={rows}" in out


@needs_shared(TOKENIZER_DIR)
def test_folders_that_are_not_models_are_named_with_the_way_to_serve_it(tiny_gpt2_dir, onnx_work_dir, tmp_path,
                                                                         capsys):
    """A folder without a config.pbtxt in -o (a user's notes, an editor's hidden folder) makes tritonserver refuse to
    start (core 2.51: "failed to load all models"), while the command said nothing and printed a serve line that
    fails. Now it names them after the write, leaves them as they are, and its serve line loads only the models it
    wrote (tests/test_triton_generative.py serves a repository with such a folder that way). Plain files, which
    Triton ignores, are not named."""
    models = tmp_path / "models"
    (models / "notes").mkdir(parents=True)
    (models / "notes" / "todo.txt").write_text("the user's")
    (models / ".ipynb_checkpoints").mkdir()
    (models / "README.txt").write_text("the user's too")
    assert run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(onnx_work_dir),
                   "-o", str(models), "--name", "gpt2", "--streaming"]) == 0
    out, err = capsys.readouterr()
    assert (f"warning: {models} holds 2 folder(s) that are not Triton models (no config.pbtxt): .ipynb_checkpoints, "
            f"notes. tritonserver --model-repository {models} tries to load every sub-folder") in err
    assert "README" not in err
    explicit = "--model-control-mode=explicit --load-model=gpt2 --load-model=gpt2_stream"
    assert f"serve it: tritonserver --model-repository {models} {explicit} (or move .ipynb_checkpoints, notes out" \
        in out
    assert (models / "notes" / "todo.txt").read_text() == "the user's"
    assert (models / ".ipynb_checkpoints").is_dir() and (models / "README.txt").is_file()
    # once they are gone, nothing is said and the plain command is the one to run
    (models / "notes" / "todo.txt").unlink()
    (models / "notes").rmdir()
    (models / ".ipynb_checkpoints").rmdir()
    assert run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(onnx_work_dir),
                   "-o", str(models), "--name", "gpt2"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and f"serve it: tritonserver --model-repository {models} (its Python" in out


@pytest.mark.parametrize("name", ["my model", "", "gpt2'", "gpt2 ", "a/b", ".."])
def test_a_name_that_is_no_plain_model_name_is_refused_before_the_load(tmp_path, capsys, no_load, name):
    """-n 'my model' was written as a model whose name the printed `--load-model=my model` serve line split in two
    (and convert_model refuses it); -n '' silently named the model after the variant."""
    assert triton(tmp_path, "-o", str(tmp_path / "models"), "-n", name) == 2
    err = capsys.readouterr().err
    assert f"-n/--name {name!r} names the Triton model" in err and "use letters, digits, '.', '-' and '_'" in err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("scheduler", ["continuous", "sequential"])
def test_an_image_to_text_family_is_refused_before_the_load(tmp_path, capsys, no_load, scheduler):
    """BLIP under --scheduler sequential loaded its weights and exported its graphs (a minute on a CPU) before
    "triton serves text generation; BLIP captions images"; under continuous it was told to use sequential."""
    code = run_py(["triton", "BLIP", "onnxrt", "--random-weights", "-wd", str(tmp_path / "work"), "-o",
                   str(tmp_path / "models"), "--scheduler", scheduler])
    err = capsys.readouterr().err
    assert code == 2 and "triton serves text generation; BLIP captions images" in err, err
    assert "sequential" not in err and not (tmp_path / "models").exists()


@pytest.mark.parametrize("flags", [["--dynamic-batch"], ["--engine-postfix", "x"], ["--max-dynamic-batch", "4"],
                                   ["--disable-preview-dynamic-shapes"], ["--decoder-engine", "e.plan"],
                                   ["--cuda-graph"]])
def test_tensorrt_and_cuda_graph_flags_are_refused_without_sending_the_user_to_trt(tmp_path, capsys, no_load, flags):
    """They said "name trt or drop it" / "add trt" (or frameworks), and triton then refused every backend but onnxrt;
    its help listed them too."""
    assert triton(tmp_path, "-o", str(tmp_path / "models"), *flags) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} does not apply to triton: it serves the onnxrt backend's ONNX graph" in err, err
    assert "add trt" not in err and "name trt" not in err
    with pytest.raises(SystemExit):
        run_py(["triton", "--help"])
    assert flags[0] not in capsys.readouterr().out
