"""The fast sampling stream (`sampling_stream="fast"`, nndf.fast_draw): generate()'s distribution and top-k, drawn
from a stream of our own; a seed repeats its tokens on every backend; generate()'s stream stays the default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import TopKLogitsWarper

import nndf
from nndf.errors import HarnessError
from nndf.fast_draw import FastDraw
from nndf.kept_tokens import SAMPLE_PER_KEPT, sampled_top_k
from nndf.sampling import Sampling
from test_generation_parity import _batch


@pytest.mark.parametrize("k", [1, 3, 50, 1000])
def test_its_top_k_keeps_what_transformers_keeps(k):
    """The kept (row, column) pairs are exactly the finite scores TopKLogitsWarper leaves: ties at the k-th kept,
    rows with banned (-inf) scores, a row with fewer finite scores than k, and rows the strided threshold misses."""
    inf = float("inf")
    scores = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0))
    scores[1, 10:20] = scores[1].max() + 1  # a tie above every other score
    scores[2, :4990] = -inf  # 10 finite scores
    stride = max(1, 5000 // (SAMPLE_PER_KEPT * k))
    sampled = scores[3, ::stride]  # the row's k - 1 largest where the threshold's sample reads: it passes < k (k 3, 50)
    sampled[: k - 1] = 10 + torch.arange(k - 1, dtype=torch.float32)[: len(sampled)]
    scores[4] = 0.0  # every score tied
    scores[5, 100:] = -inf
    expected = torch.isfinite(TopKLogitsWarper(top_k=k)(None, scores.clone())).numpy()
    row, column, values = sampled_top_k(scores.numpy(), k)
    assert np.array_equal(values, scores.numpy()[row, column])
    got = np.zeros_like(expected)
    got[row, column] = True
    assert (got & np.isfinite(scores.numpy())).tolist() == expected.tolist()
    assert np.all(np.diff(row) >= 0)  # rows in order


@pytest.mark.parametrize("top_k", [4, 0])
def test_draws_follow_the_softmax_of_what_top_k_keeps(top_k):
    """20000 draws of one row: each token's frequency within 0.012 of softmax over the kept scores; a banned token
    (-inf) and, with top-k 4, the two below the fourth are never drawn."""
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -float("inf"), -3.0])
    draws = FastDraw(7, None, top_k=top_k)(row.repeat(20000, 1)).numpy()
    kept = row if top_k == 0 else TopKLogitsWarper(top_k=top_k)(None, row[None].clone())[0]
    expected = torch.softmax(kept, dim=-1).numpy()
    frequency = np.bincount(draws, minlength=len(row)) / len(draws)
    assert np.abs(frequency - expected).max() < 0.012
    assert frequency[expected == 0].sum() == 0


def test_a_single_row_drawn_among_a_screened_heads_candidates_follows_the_same_softmax():
    """Batch 1 takes a path of its own (one run of kept scores, no counts): 6000 draws of one row, one call each,
    given the screened head's candidates (every column at or above the 6th largest), within 0.02 of softmax over
    the top 4."""
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -float("inf"), -3.0, 1.5]])
    candidates = np.array([[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 7]])
    draw = FastDraw(11, None, top_k=4)
    draws = np.array([int(draw(row.clone(), candidates)[0]) for _ in range(6000)])
    expected = torch.softmax(TopKLogitsWarper(top_k=4)(None, row.clone())[0], dim=-1).numpy()
    frequency = np.bincount(draws, minlength=row.shape[1]) / len(draws)
    assert np.abs(frequency - expected).max() < 0.02 and frequency[expected == 0].sum() == 0


def test_a_seed_repeats_its_draws_and_an_invalid_row_is_refused():
    scores = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1))
    first = [FastDraw(5, None, 50)(scores) for _ in range(3)]
    again = FastDraw(5, None, 50)
    assert all(torch.equal(draw, again(scores)) for draw in first[:1])
    assert not torch.equal(FastDraw(6, None, 50)(scores), first[0])
    torch.manual_seed(3)
    unseeded = FastDraw(None, None, 50)(scores)
    torch.manual_seed(3)
    assert torch.equal(FastDraw(None, None, 50)(scores), unseeded)  # the global generator seeds the stream
    for bad in (float("nan"), float("inf")):
        scores[2, 17] = bad
        with pytest.raises(HarnessError, match="cannot sample"):
            FastDraw(5, None, 50)(scores)


def test_scores_it_does_not_take_are_drawn_as_generate_draws_them():
    """Off the CPU's float scores (CUDA; here float16 takes the same path) the fast stream is generate()'s draw:
    top-k as TopKLogitsWarper, then torch.multinomial from the seeded generator."""
    scores = torch.randn(3, 500, generator=torch.Generator().manual_seed(2)).half()
    sampling = Sampling(do_sample=True, stream="fast", seed=9)
    expected = Sampling(do_sample=True, seed=9).chooser()(TopKLogitsWarper(top_k=50)(None, scores.clone()))
    assert torch.equal(sampling.chooser()(scores.clone()), expected)


def test_top_k_moves_into_the_draw_only_when_it_is_the_last_warper():
    def names(sampling):
        return [type(w).__name__ for w in sampling.warpers()]

    assert names(Sampling(do_sample=True, stream="fast")) == names(Sampling(do_sample=True)) == []
    assert Sampling(do_sample=True).chooser().top_k == Sampling(do_sample=True, stream="fast").chooser().top_k == 50
    assert names(Sampling(do_sample=True, top_p=0.9)) == ["FastTopK", "FastTopP"]
    assert names(Sampling(do_sample=True, stream="fast", temperature=0.7)) == ["TemperatureLogitsWarper"]
    assert names(Sampling(do_sample=True, stream="fast", top_p=0.9)) == ["FastTopK", "FastTopP"]
    assert Sampling(do_sample=True, stream="fast", top_p=0.9).chooser().top_k == 0
    assert Sampling(do_sample=True, stream="fast", seed=4).describe() == \
        "sampling (temperature 1, top-k 50, seed 4, fast stream)"


@pytest.mark.parametrize("settings", [{}, {"top_p": 0.9, "temperature": 0.8}], ids=["top-k", "top-p"])
def test_a_seed_gives_the_same_tokens_on_every_backend(tiny_gpt2_dir, onnx_work_dir, settings):
    """Batch 3 with left padding: the fast stream's tokens for a seed are the same on frameworks and onnxrt (whose
    logits agree), differ from greedy search's, and are not generate()'s; greedy ignores the stream."""
    ids, mask = _batch([5, 9, 3])
    tokens = {}
    for backend in ("frameworks", "onnxrt"):
        m = nndf.load("GPT2", backend=backend, torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                      device="cpu")
        tokens[backend] = m.generate(ids, mask, max_new_tokens=10, do_sample=True, seed=11,
                                     sampling_stream="fast", **settings)
        greedy = m.generate(ids, mask, max_new_tokens=10)
        assert torch.equal(m.generate(ids, mask, max_new_tokens=10, sampling_stream="fast"), greedy)
    assert torch.equal(tokens["frameworks"], tokens["onnxrt"])
    assert not torch.equal(tokens["frameworks"], greedy)
    hf = m.hf_generate(ids, mask, max_new_tokens=10, do_sample=True, seed=11, sampling_stream="fast", **settings)
    assert not torch.equal(hf, tokens["onnxrt"])  # generate() draws from its own stream


def test_the_flag_is_checked_before_the_model_loads_and_shown_in_the_header(capsys, tiny_gpt2_dir):
    from nndf.cli import main

    code = main(["benchmark", "GPT2", "frameworks", "--variant", "gpt2-xl", "--sampling-stream", "quick"])
    err = capsys.readouterr().err
    assert code == 2 and "sampling_stream (--sampling-stream) must be one of generate, fast, got 'quick'" in err
    assert main(["benchmark", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--iterations", "1",
                 "--warmup", "0", "--input-seq-len", "4", "--output-seq-len", "3", "--do-sample", "--seed", "8",
                 "--sampling-stream", "fast"]) == 0
    assert "sampling (temperature 1, top-k 50, seed 8, fast stream)" in capsys.readouterr().out
