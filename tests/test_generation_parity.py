"""Our one generation loop against Hugging Face generate(): the same tokens, token for token."""

from __future__ import annotations

import pytest
import torch

import nndf

PROMPT_LENGTHS = {1: [7], 3: [5, 9, 3]}


def _batch(lengths: list[int], vocab: int = 50257, seed: int = 1):
    """Left-padded random prompts of the given lengths, with their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 50256, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(0, vocab - 1, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


@pytest.fixture(scope="module", params=[True, False], ids=["cache", "no-cache"])
def model(request, tiny_gpt2_dir):
    return nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), use_cache=request.param, device="cpu")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("num_beams", [1, 2, 3, 4])
def test_same_tokens_as_hf_generate(model, batch, num_beams):
    ids, mask = _batch(PROMPT_LENGTHS[batch])
    ours = model.generate(ids, mask, max_new_tokens=10, num_beams=num_beams)
    reference = model.hf_generate(ids, mask, max_new_tokens=10, num_beams=num_beams)
    assert ours.shape == reference.shape
    assert torch.equal(ours, reference)


def _model_with_likely_eos(tiny_gpt2_dir):
    """The tiny model with its EOS set to a token that greedy search emits early, so that stopping is exercised."""
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids, mask = _batch([5, 9, 3])
    free = m.hf_generate(ids, mask, max_new_tokens=12)
    eos = int(free[1, ids.shape[1] + 3])
    m.loaded.model.generation_config.eos_token_id = eos
    m.loaded.model.generation_config.pad_token_id = None
    return m, ids, mask, eos


@pytest.mark.parametrize("num_beams", [1, 3])
def test_eos_stops_and_pads_like_hf(tiny_gpt2_dir, num_beams):
    m, ids, mask, eos = _model_with_likely_eos(tiny_gpt2_dir)
    ours = m.generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
    reference = m.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
    assert torch.equal(ours, reference)
    if num_beams == 1:
        assert (ours[:, ids.shape[1]:] == eos).any(), "the chosen EOS was never generated: the test lost its point"


@pytest.mark.parametrize("num_beams", [1, 3])
def test_several_eos_tokens_end_rows_like_hf(tiny_gpt2_dir, num_beams):
    """Instruct checkpoints list several EOS tokens (Phi-3-mini: 32000, 32001, 32007): a row ends at any of them,
    beam search keeps (EOS tokens + 1) x beams candidates, and finished rows are padded with the first."""
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids, mask = _batch([5, 9, 3])
    free = m.hf_generate(ids, mask, max_new_tokens=12)
    width = ids.shape[1]
    stops = [int(free[0, width + 2]), int(free[2, width + 5])]
    unused = next(t for t in range(50000, 50257) if t not in free)  # the pad: never generated, first in the list
    m.loaded.model.generation_config.eos_token_id = [unused, *stops]
    m.loaded.model.generation_config.pad_token_id = None
    ours = m.generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
    reference = m.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
    assert torch.equal(ours, reference)
    if num_beams == 1:
        assert all((ours[:, width:] == stop).any() for stop in stops), "an EOS was never generated"
        assert (ours[:, width:] == unused).any(), "no finished row was padded"


@pytest.mark.parametrize("num_beams", [1, 3])
def test_repetition_penalty_of_the_generation_config_like_hf(tiny_gpt2_dir, num_beams):
    """Instruct generation configs set a repetition penalty (Qwen2.5-Instruct), which `generate()` applies in greedy
    and beam search alike, leaving out each row's left padding."""
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids, mask = _batch([5, 9, 3])
    plain = m.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
    m.loaded.model.generation_config.repetition_penalty = 1.5
    ours = m.generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams))
    assert not torch.equal(ours, plain), "the penalty changed nothing: the test lost its point"


@pytest.mark.parametrize("num_beams", [1, 3])
def test_min_new_tokens_suppresses_eos_like_hf(tiny_gpt2_dir, num_beams):
    m, ids, mask, eos = _model_with_likely_eos(tiny_gpt2_dir)
    ours = m.generate(ids, mask, max_new_tokens=12, min_new_tokens=12, num_beams=num_beams)
    reference = m.hf_generate(ids, mask, max_new_tokens=12, min_new_tokens=12, num_beams=num_beams)
    assert torch.equal(ours, reference)
    assert ours.shape[1] == ids.shape[1] + 12
    assert not (ours[:, ids.shape[1]:] == eos).any()


def test_step_callback_once_per_new_token(tiny_gpt2_dir):
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids, mask = _batch([6])
    ticks = []
    out = m.generate(ids, mask, max_new_tokens=9, min_new_tokens=9, on_token=lambda: ticks.append(1))
    assert len(ticks) == 9 == out.shape[1] - ids.shape[1]


def test_prefill_logits_match_pytorch_forward(tiny_gpt2_dir):
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids, _ = _batch([11])
    with torch.no_grad():
        expected = m.loaded.model(ids).logits
    torch.testing.assert_close(m.logits(ids), expected, rtol=0, atol=1e-5)
