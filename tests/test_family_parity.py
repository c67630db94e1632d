"""Every decoder family's tiny model (tests/family_examples.py) against Hugging Face `generate()` on frameworks,
onnxrt and the trt runner (over the fake TensorRT of tests/fake_tensorrt.py): greedy and beam search, batches with
masks, with and without cache, seeded sampling with the streamer's calls, and the exported graph exact up to the
model's last position. The onnxrt and trt
tests share one export per family (the session's `onnx_work_dir`), which is why the trt family test lives here
rather than in tests/test_trt.py (its `gpu` twin is there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nndf
from conftest import decoder_only_families
from family_examples import CACHELESS_GRAPH_AS, SAME_GRAPH_AS
from fake_tensorrt import fake_gpu  # noqa: F401  (a fixture)
from sampling_checks import assert_samples_like_generate
from nndf.spec import BuildSettings
from test_generation_parity import PROMPT_LENGTHS, _batch


def _prompts(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 990, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :6] = 0
    return ids, mask


# Every decoder family (encoder-decoder ones: tests/test_seq2seq.py) on both backends with and without cache, but
# the onnxrt graph without cache of a family that has another's (family_examples.SAME_GRAPH_AS, CACHELESS_GRAPH_AS).
PARITY_CASES = [pytest.param(family, backend, cache, id=f"{family}-{backend}-{'cache' if cache else 'no-cache'}")
                for family in decoder_only_families() for backend in ("frameworks", "onnxrt") for cache in (True, False)
                if cache or backend == "frameworks" or family not in {*SAME_GRAPH_AS, *CACHELESS_GRAPH_AS}]


@pytest.mark.parametrize("family, backend, use_cache", PARITY_CASES)
def test_family_parity_with_hf_generate(family, backend, use_cache, family_dirs, onnx_work_dir):
    m = nndf.load(family, backend=backend, torch_dir=str(family_dirs[family]), use_cache=use_cache,
                  working_dir=str(onnx_work_dir), device="cpu")
    ids, mask = _prompts()
    for num_beams in (1, 3):
        ours = m.generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
        reference = m.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
        assert torch.equal(ours, reference), f"{family} {backend} beams={num_beams}"
    assert_samples_like_generate(m, input_ids=ids, attention_mask=mask, max_new_tokens=12)


def check_family_on_trt(family: str, family_dirs, work, device: str):
    """The family's tiny model on trt (batch 3 with left padding, beams 2, dynamic batch 1..3) against HF generate():
    greedy search, beam search and seeded sampling must give the same tokens. Returns the trt model."""
    settings = BuildSettings(batch_size=3, num_beams=2, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=3,
                             input_seq_len=9, output_seq_len=8, use_mask=True)
    model = nndf.load(family, backend="trt", torch_dir=str(family_dirs[family]), working_dir=str(work), device=device,
                      settings=settings)
    reference = nndf.load(family, backend="frameworks", loaded=model.loaded)
    ids, mask = _batch(PROMPT_LENGTHS[3], vocab=1000)  # ids under 1000, within every family example's vocabulary ...
    ids = ids.masked_fill(mask == 0, 5)  # ... padding ids included
    for num_beams in (1, 2):
        ours = model.generate(ids, mask, max_new_tokens=8, num_beams=num_beams)
        assert torch.equal(ours, reference.hf_generate(ids, mask, max_new_tokens=8, num_beams=num_beams)), num_beams
    assert_samples_like_generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=8)
    return model


@pytest.mark.parametrize("family", [f for f in decoder_only_families() if f not in SAME_GRAPH_AS])
def test_fake_trt_engine_matches_hf_generate(fake_gpu, family, family_dirs, onnx_work_dir):
    """Each family's graph (BLOOM without position ids, OPT's offset, rotary, local attention, sliding windows,
    soft-capping) through the trt runner; the `gpu` twin is in tests/test_trt.py."""
    model = check_family_on_trt(family, family_dirs, onnx_work_dir, "cpu")
    assert model.artifacts[0].endswith(".engine") and Path(model.artifacts[0]).name.startswith(family)


@pytest.mark.parametrize("family", decoder_only_families())
def test_onnx_graph_is_exact_up_to_the_last_position(family, family_dirs, onnx_work_dir):
    """The export traces with past and new lengths of at most half the positions each (see `dynamic_dims`); the
    graph must stay exact beyond that: a prompt of 3/4 of the positions, decoding to the very last one, and logits
    for a whole max-length text at once."""
    m = nndf.load(family, backend="onnxrt", torch_dir=str(family_dirs[family]), working_dir=str(onnx_work_dir),
                  device="cpu")
    length = m.max_positions * 3 // 4
    ids = torch.randint(4, 990, (2, length), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    new = m.max_positions - length
    ours = m.generate(ids, mask, max_new_tokens=new, min_new_tokens=new)
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=new, min_new_tokens=new)), family
    full = ours[:1, -m.max_positions:]  # scoring: logits for every one of max_positions tokens at once
    torch.testing.assert_close(m.logits(full), m.reference_logits(full), rtol=0, atol=1e-4)
