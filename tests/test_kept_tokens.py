"""Top-k applied inside the default stream's draw (`nndf.kept_tokens`, `TokenChooser(top_k=...)`): the same
probabilities bit for bit, the same tokens and random stream as `TopKLogitsWarper` + softmax + torch.multinomial,
and the whole rows again wherever the shortcut cannot be trusted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import TopKLogitsWarper

import nndf
from nndf import kept_tokens
from nndf.kept_tokens import first_max_of_runs, kept_softmax, masked_softmax, sampled_top_k
from nndf.processors import VerifiedRows
from nndf.sampling import CpuDraw, TokenChooser


def _cases():
    """(scores, k): GPT-2's and other vocabularies (a last partial block of 17, 0 and 40 columns modulo 64), one and
    four rows, the last column and the last partial block kept, ties, scores spread wide and narrow."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for i, (rows, vocab, k, spread) in enumerate([(1, 50257, 50, 3.0), (4, 50257, 50, 3.0), (1, 50257, 1, 1.0),
                                                  (3, 32000, 200, 0.3), (4, 1000, 7, 10.0), (2, 128, 20, 1.0),
                                                  (1, 50304, 50, 3.0), (4, 50257, 300, 0.01), (1, 1000, 999, 2.0)]):
        scores = torch.randn(rows, vocab, generator=generator) * spread
        if i % 2 == 0:
            scores[:, -1] += 20  # the last column, alone in the last partial block
        if i % 3 == 0:
            scores[0, -(vocab % 64 or 64):] += 10  # the whole last partial block
        if i == 1:
            scores[2, 100:110] = scores[2].max()  # a tie at the top
            scores[3, :] = 0.5  # every score tied: top-k keeps the whole row
        cases.append((scores, k))
    return cases


@pytest.mark.parametrize("case", range(len(_cases())))
def test_the_narrow_softmax_is_the_whole_rows(case, monkeypatch):
    """kept_softmax's values equal the softmax of the -inf rows top-k leaves, bit for bit, both while checking
    its first rows and once trusted."""
    scores, k = _cases()[case]
    monkeypatch.setattr(kept_tokens, "SOFTMAX_ROWS", VerifiedRows(needed=1))
    table = scores.numpy()
    row, column, values = sampled_top_k(table, k)
    expected = TopKLogitsWarper(top_k=k)(None, scores.clone()).softmax(dim=-1).numpy()
    assert np.array_equal(masked_softmax(row, column, values, table.shape).numpy(), expected)
    checked = kept_softmax(row, column, values, table.shape)
    assert kept_tokens.SOFTMAX_ROWS.trusted(table.shape[1]) is True  # the narrow rows gave the same on this build
    trusted = kept_softmax(row, column, values, table.shape)
    assert np.array_equal(checked, expected[row, column]) and np.array_equal(trusted, expected[row, column])


def test_a_narrow_softmax_that_differs_leaves_the_width_to_the_whole_rows(monkeypatch):
    """Positions that break the lanes (here: the kept scores packed side by side) give sums that differ in the last
    bit in some rows; the first such row turns the narrow rows off for that vocabulary width, and every result
    stays the whole rows' softmax."""
    monkeypatch.setattr(kept_tokens, "SOFTMAX_ROWS", VerifiedRows(needed=10**6))
    monkeypatch.setattr(kept_tokens, "_narrow_positions",
                        lambda row, column, rows, vocab: (np.arange(len(column)) - np.searchsorted(row, row),
                                                          int(np.bincount(row).max())))
    scores = torch.randn(64, 4, 50257, generator=torch.Generator().manual_seed(3)) * 3
    for step in scores:
        table = step.numpy()
        row, column, values = sampled_top_k(table, 50)
        expected = masked_softmax(row, column, values, table.shape).numpy()[row, column]
        assert np.array_equal(kept_softmax(row, column, values, table.shape), expected)
    assert kept_tokens.SOFTMAX_ROWS.trusted(50257) is False


@pytest.mark.parametrize("with_candidates", [False, True], ids=["whole-rows", "screened-candidates"])
def test_the_draw_among_kept_tokens_is_generates(with_candidates):
    """TokenChooser(top_k=k) against TopKLogitsWarper + softmax + torch.multinomial over several steps: the same
    tokens and the same generator state after, from whole rows or from a screened head's candidates (a superset of
    each row's top k, row-major, columns ascending)."""
    for case, (scores, k) in enumerate(_cases()):
        theirs = torch.Generator().manual_seed(case)
        chooser = TokenChooser(True, case, top_k=k)
        for step in range(3):
            step_scores = scores + step
            candidates = None
            if with_candidates:
                room = min(k + 5, scores.shape[1])
                kth = step_scores.topk(room).values[:, -1:]
                candidates = np.argwhere((step_scores >= kth).numpy())
            expected = torch.multinomial(TopKLogitsWarper(top_k=k)(None, step_scores.clone()).softmax(dim=-1), 1,
                                         generator=theirs).squeeze(1)
            assert torch.equal(chooser(step_scores.clone(), candidates), expected), (case, step)
        assert torch.equal(chooser.generator.get_state(), theirs.get_state())


def test_rows_that_are_no_distribution_get_torchs_error():
    """NaN, +inf or a row all -inf: the whole rows are drawn as generate() draws them, and torch.multinomial
    refuses them in its own words."""
    for bad in (float("nan"), float("inf")):
        scores = torch.randn(2, 1000, generator=torch.Generator().manual_seed(1))
        scores[1, 5] = bad
        with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
            TokenChooser(True, 0, top_k=50)(scores)
    scores = torch.full((1, 1000), float("-inf"))
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        TokenChooser(True, 0, top_k=50)(scores)


def test_a_zero_uniform_draws_from_the_whole_table(monkeypatch):
    """A uniform of exactly 0 at a probability-0 element gives torch's ratio 0/0 = NaN there, which its argmax
    takes: the draw among kept tokens then takes the whole table, as torch.multinomial does."""
    scores = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    uniforms = torch.rand(2, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    uniforms[0, 250] = 0.0
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, generator=None: self.copy_(uniforms))
    probs = TopKLogitsWarper(top_k=20)(None, scores.clone()).softmax(dim=-1)
    expected = torch.argmax(probs / (-torch.log1p(-uniforms)).float(), dim=-1)
    assert probs[0, 250] == 0 and expected.tolist()[0] == 250
    assert torch.equal(TokenChooser(True, 0, top_k=20)(scores.clone()), expected)
    assert CpuDraw.is_exact()


def test_each_rows_first_largest_key():
    keys = np.array([1.0, 3.0, 3.0, 0.5, 2.0, 2.0, 7.0])
    row = np.array([0, 0, 0, 1, 1, 2, 2])
    assert first_max_of_runs(keys, row, 3).tolist() == [1, 4, 6]
    assert first_max_of_runs(keys[:3], row[:3], 1).tolist() == [1]


def test_stopping_criteria_get_the_scores_generates_warpers_leave(tiny_gpt2_dir):
    """generate() gives stopping criteria its processed scores, top-k included; the draw applies top-k itself, so
    the loop applies it to what the criteria see."""
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    seen = []

    def stopping(tokens, scores):
        seen.append(torch.isfinite(scores).sum(dim=-1).tolist())
        return torch.zeros(len(tokens), dtype=torch.bool)

    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    model.generate(ids, max_new_tokens=3, do_sample=True, top_k=7, seed=1, stopping=stopping)
    assert seen == [[7, 7]] * 3
