"""BLIP on the trt backend: a vision encoder, a cross-attention cache generator and a text decoder engine.

Without a GPU, through the fake TensorRT of `tests/fake_tensorrt.py` (engines that run the exported graphs with ONNX
Runtime on the buffers the runner binds); the `gpu` tests build real engines (`python -m pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

import nndf
from conftest import IMAGES_DIR, PHOTOS, needs_blip_tokenizer, needs_shared
from fake_tensorrt import fake_gpu  # noqa: F401
from nndf.backends import BackendOptions
from nndf.backends import trt as trt_backend
from nndf.errors import UsageError
from nndf.images import caption_inputs
from nndf.model import Model
from nndf.spec import BuildSettings
from nndf.workspace import read_metadata
from sampling_checks import assert_samples_like_generate
from test_trt import _needs_tensorrt

# Two images (dynamic batch 1..2) with beams 2, an optional 4-token text prefix, 8 new tokens.
SETTINGS = dict(batch_size=2, num_beams=2, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=2,
                input_seq_len=4, output_seq_len=8)
GRAPHS = ("encoder", "cross", "decoder")


def _load(blip_dir, work, device="cpu", loaded=None, **settings) -> Model:
    return nndf.load("BLIP", backend="trt", torch_dir=str(blip_dir), working_dir=str(work), device=device,
                     settings=BuildSettings(**{**SETTINGS, **settings}), loaded=loaded)


def _check_captions(model: Model) -> None:
    """Greedy and beam 2, without and with the text prefix: generate()'s tokens; teacher-forced logits as
    PyTorch's."""
    for prompt in (None, "a picture of"):
        inputs = caption_inputs(model.processor, PHOTOS, prompt)
        for num_beams in (1, 2):
            ours = model.generate(**inputs, max_new_tokens=8, min_new_tokens=4, num_beams=num_beams)
            reference = model.hf_generate(**inputs, max_new_tokens=8, min_new_tokens=4, num_beams=num_beams)
            assert torch.equal(ours, reference), f"prompt={prompt} beams={num_beams}"
        assert_samples_like_generate(model, max_new_tokens=8, **inputs)
    pixels = inputs["pixel_values"][:1]
    ids = torch.tensor([[30522, 1037, 3861, 1997]])
    torch.testing.assert_close(model.decoder.logits(pixels, ids),
                               model.architecture.reference_logits(model.loaded.model, pixels, ids), rtol=0, atol=1e-4)


@needs_blip_tokenizer
@needs_shared(IMAGES_DIR)
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_fake_engines_captions_equal_hf_generate(fake_gpu, use_cache, blip_dir, onnx_work_dir):
    model = _load(blip_dir, onnx_work_dir, use_cache=use_cache)
    _check_captions(model)
    assert [r.graph for r in fake_gpu] == list(GRAPHS)
    encoder, cross, decoder = model.decoder.sessions
    # The image size is fixed in every profile; the batch is dynamic; the decoder has a prompt profile and a
    # one-token profile with the cache, one over the whole text without.
    assert list(encoder.io.profiles) == [{"pixel_values": ((1, 3, 32, 32), (2, 3, 32, 32), (2, 3, 32, 32))}]
    assert list(cross.io.profiles) == [{"encoder_hidden_states": ((1, 17, 48), (2, 17, 48), (2, 17, 48))}]
    assert len(decoder.io.profiles) == (2 if use_cache else 1)
    assert all(profile["cross.0.key"] == ((1, 4, 17, 8), (4, 4, 17, 8), (4, 4, 17, 8))
               for profile in decoder.io.profiles)
    assert not [name for name in decoder._staging.buffers if name.startswith("cross.")]  # bound as they are


@needs_blip_tokenizer
@needs_shared(IMAGES_DIR)
def test_fake_engines_reused_and_given_by_tensor_names(fake_gpu, blip_dir, onnx_work_dir, tmp_path, capsys):
    model = _load(blip_dir, onnx_work_dir, engine_postfix="-blip")
    engines = dict(zip(GRAPHS, model.artifacts))
    again = _load(blip_dir, onnx_work_dir, engine_postfix="-blip")
    assert again.artifacts == model.artifacts and len(fake_gpu) == 3
    inputs = caption_inputs(again.processor, PHOTOS)
    expected = again.generate(**inputs, max_new_tokens=5)
    given = Model(model.loaded, "trt", model.settings, BackendOptions(
        working_dir=str(tmp_path), encoder_engine=engines["encoder"], cache_generator_engine=engines["cross"],
        decoder_engine=engines["decoder"]))
    assert torch.equal(given.generate(**inputs, max_new_tokens=5), expected) and list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="^--encoder-engine .* does not have the vision encoder's inputs"):
        Model(model.loaded, "trt", model.settings, BackendOptions(working_dir=str(onnx_work_dir),
                                                                  encoder_engine=engines["decoder"]))


# --- real TensorRT on a GPU: `python -m pytest -m gpu` ---------------------------------------------------------------

@pytest.mark.gpu
@needs_shared(IMAGES_DIR)
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_gpu_fp32_engines_captions_equal_hf_generate(use_cache, blip_dir, tmp_path, monkeypatch):
    _needs_tensorrt()
    monkeypatch.setattr(trt_backend, "USE_TF32", False)  # bit-level parity needs true fp32 matrix products
    _check_captions(_load(blip_dir, tmp_path, "cuda", use_cache=use_cache))


@pytest.mark.gpu
@needs_shared(IMAGES_DIR)
def test_gpu_fp16_engines_logits_within_bound(blip_dir, tmp_path):
    _needs_tensorrt()
    fp32 = nndf.load("BLIP", backend="frameworks", torch_dir=str(blip_dir), device="cuda").loaded
    model = _load(blip_dir, tmp_path, "cuda", loaded=fp32, fp16=True)
    check = read_metadata(model.artifacts[2])["fp16_check"]
    assert check["relative"] <= trt_backend.FP16_LOGIT_BOUND, check
    assert model.caption(PHOTOS, max_new_tokens=4)[0]
