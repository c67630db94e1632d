"""The loop's faster equivalents of torch's and transformers' sampling pieces on the CPU, each against the original
on the same inputs: the draw (`CpuDraw` against torch.multinomial), the argmax, top-k, top-p and the minimum-length
EOS bans (`nndf.processors`)."""

from __future__ import annotations

import pytest
import torch


def test_the_cpu_draw_is_torch_multinomial():
    """CpuDraw against torch.multinomial on full and top-k-masked distributions, two steps each: the same tokens
    and the same generator state after; NaN probabilities raise torch.multinomial's own error."""
    from nndf.sampling import CpuDraw

    assert CpuDraw.is_exact()
    scores = torch.randn(20, 4, 5000, generator=torch.Generator().manual_seed(0)) * 3
    scores[::2, :, 50:] = float("-inf")
    for seed, step_scores in enumerate(scores):
        probs = step_scores.softmax(dim=-1)
        draw = CpuDraw(probs.shape)
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(2):
            assert torch.equal(draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
        assert torch.equal(ours.get_state(), theirs.get_state())
    probs[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        CpuDraw(probs.shape)(probs)


def test_the_cpu_draw_takes_every_element_where_a_uniform_is_zero(monkeypatch):
    """Where a row's uniform is exactly 0 (one draw in 2**53), torch's q is 0 there and a probability-0 element's
    ratio is 0/0 = NaN, which argmax takes: CpuDraw then computes the whole row as torch does, not only the
    nonzero probabilities."""
    from nndf.sampling import CpuDraw

    scores = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    scores[:, 20:] = float("-inf")  # 20 live elements per row
    probs = scores.softmax(dim=-1)
    uniforms = torch.rand(2, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    uniforms[0, 100] = 0.0  # at a probability-0 element of row 0
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, generator=None: self.copy_(uniforms))
    expected = torch.argmax(probs / (-torch.log1p(-uniforms)).float(), dim=-1)
    assert expected.tolist()[0] == 100  # NaN at 100: torch's own draw picks the probability-0 element
    assert torch.equal(CpuDraw(probs.shape)(probs), expected)


def test_the_fast_argmax_is_torch_argmax():
    """Greedy's argmax (numpy's on the CPU) picks torch's index: the first of equal maxima, NaN above all, -0.0 equal
    to 0.0, strided rows (the last position of (rows, positions, vocab) logits) and float64 too."""
    from nndf.sampling import last_dim_argmax

    nan, inf = float("nan"), float("inf")
    edge = torch.tensor([[1.0, nan, 3.0, nan], [2.0, 2.0, 1.0, 0.0], [-inf] * 4, [0.0, -0.0, 0.0, -1.0],
                         [1.0, inf, inf, nan], [-inf, -1e30, -1e30, -inf]])
    logits = torch.randn(3, 5, 50257, generator=torch.Generator().manual_seed(0))
    logits[1, -1, 7:9] = logits[1, -1].max() + 1  # a tie at the top
    for scores in (edge, edge.double(), logits[:, -1, :], logits[:, 2:4, :]):
        got = last_dim_argmax(scores)
        assert got.dtype == torch.int64 and torch.equal(got, scores.argmax(dim=-1))


@pytest.mark.parametrize("k", [1, 3, 50, 6000])  # 6000: more than the vocabulary
def test_fast_top_k_equals_transformers(k):
    """FastTopK sets what TopKLogitsWarper sets, in place: ties at the k-th score kept, -inf and NaN ranked as torch
    ranks them, strided rows (the last position of (rows, positions, vocab) logits) and float64 too."""
    from transformers import TopKLogitsWarper

    from nndf.kept_tokens import SAMPLE_PER_KEPT
    from nndf.processors import FastTopK

    nan, inf = float("nan"), float("inf")
    logits = torch.randn(3, 2, 5000, generator=torch.Generator().manual_seed(0))
    logits[0, -1, 10:14] = logits[0, -1].max() + 1  # a tie across the top 3
    logits[1, -1, :4000] = -inf
    edge = torch.tensor([[1.0, nan, 3.0, nan, 2.0], [2.0, 2.0, 1.0, 0.0, -inf], [-inf] * 5])
    # vocabulary-wide rows: a NaN among them (ranked largest, as torch ranks it), the k - 1 largest all where a
    # strided sample would read (a search above a sampled threshold, tried here, must then fall back), all tied
    wide = torch.randn(4, 50257, generator=torch.Generator().manual_seed(1))
    stride = max(1, 50257 // (SAMPLE_PER_KEPT * k))
    wide[0, 1] = nan
    wide[1, ::stride][: k - 1] = 10 + torch.arange(k - 1, dtype=torch.float32)[: len(wide[1, ::stride])]
    wide[2] = 0.5
    for fresh in (lambda: logits.clone()[:, -1, :], lambda: logits.double()[:, -1, :], edge.clone, wide.clone,
                  lambda: wide[1:].clone()):
        expected = TopKLogitsWarper(top_k=k)(None, fresh())
        given = fresh()
        got = FastTopK(top_k=k)(None, given)
        assert got is given and torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0))


def _top_p_cases(vocabulary: int) -> list[tuple[torch.Tensor, float]]:
    """Scores as the loop hands top-p them (after top-k; strided rows of (rows, positions, vocab) logits), then the
    cases the fast path leaves to the parent: a tie among the kept, NaN beside a row all -inf, no top-k before."""
    from nndf.processors import FastTopK

    generator = torch.Generator().manual_seed(0)
    cases = []
    for i, (k, spread, top_p) in enumerate([(50, 3.0, 0.9), (300, 1.0, 0.5), (50, 10.0, 0.99), (20, 0.5, 0.1),
                                            (1, 3.0, 0.9), (50, 3.0, 1e-9), (2000, 2.0, 0.8), (50, 0.01, 0.95)]):
        # distinct scores (equal ones are the parent's to order): a permutation of the vocabulary's positions
        positions = torch.stack([torch.randperm(vocabulary, generator=generator) for _ in range(6)]).view(3, 2, -1)
        logits = (positions / vocabulary - 0.5) * spread * 6
        cases.append((FastTopK(top_k=k)(None, logits[:, -1, :]), top_p))
    tie, odd = cases[0][0].clone(), cases[0][0].clone()
    kept = tie[0].isfinite().nonzero().flatten()
    tie[0, kept[:2]] = tie[0, kept[2]].item()  # a three-way tie
    odd[1, kept[0]], odd[2] = float("nan"), float("-inf")
    return cases + [(tie, 0.9), (odd, 0.9), (torch.randn(2, vocabulary, generator=generator), 0.9)]


@pytest.mark.parametrize("vocabulary", [50257, 1000])
def test_fast_top_p_equals_transformers(vocabulary, monkeypatch):
    """FastTopP sets what TopPLogitsWarper sets, bit for bit (the kept tokens decide the draw), once its first rows
    have been checked against the parent, and it takes its own path in most of these cases."""
    from transformers import TopPLogitsWarper

    from nndf.processors import FastTopP, VerifiedRows

    monkeypatch.setattr(FastTopP, "VERIFIED", VerifiedRows())
    parent_calls = []
    parent = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, ids, s: parent_calls.append(1) or parent(self, ids, s))
    FastTopP(top_p=0.9)(None, _top_p_cases(vocabulary)[0][0].clone())
    assert FastTopP.VERIFIED.seen[vocabulary] == 3  # its 3 rows computed both ways: equal
    monkeypatch.setattr(FastTopP.VERIFIED, "needed", 3)
    parent_calls.clear()
    for scores, top_p in _top_p_cases(vocabulary):
        expected = parent(TopPLogitsWarper(top_p=top_p), None, scores.clone())
        got = FastTopP(top_p=top_p)(None, scores.clone())
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0)), top_p
    # the tie, the NaN and all -inf rows, no top-k before; and top-k keeping more than an eighth of the vocabulary
    assert len(parent_calls) == (3 if vocabulary > 2000 * 8 else 5)


def test_fast_top_p_is_the_parents_for_good_once_a_row_differs(monkeypatch):
    """A row of the first ones computed both ways that differs from the parent's (here made to: one kept score
    changed) leaves every result the parent's, and that vocabulary width to the parent from then on."""
    from transformers import TopPLogitsWarper

    from nndf.processors import FastTopK, FastTopP, VerifiedRows

    monkeypatch.setattr(FastTopP, "VERIFIED", VerifiedRows())
    ours, calls = FastTopP._in_place, []

    def differing(self, scores):
        done = ours(self, scores)
        scores[0, scores[0].isfinite().nonzero()[-1]] += 1.0
        calls.append(1)
        return done

    monkeypatch.setattr(FastTopP, "_in_place", differing)
    logits = torch.randn(8, 50257, generator=torch.Generator().manual_seed(1)) * 3
    for rows in FastTopK(top_k=50)(None, logits).split(4):
        expected = TopPLogitsWarper(top_p=0.9)(None, rows.clone())
        assert torch.equal(FastTopP(top_p=0.9)(None, rows.clone()), expected)
    assert FastTopP.VERIFIED.seen[50257] is False and len(calls) == 1


@pytest.mark.parametrize("eos", [[7], [3, 99, 7], [-1, 5, 5000]])  # several, one outside the vocabulary
def test_fast_length_processors_equal_transformers(eos):
    """nndf.processors' minimum-length EOS bans give their transformers parents' scores, bit for bit, before and
    after the minimum, on rows with -inf and NaN scores too."""
    from transformers import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    from nndf.processors import FastMinLength, FastMinNewTokensLength

    scores = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    scores[1, 7], scores[2, 3] = float("-inf"), float("nan")
    pairs = [(FastMinLength(6, eos), MinLengthLogitsProcessor(6, eos)),
             (FastMinNewTokensLength(4, 2, eos), MinNewTokensLengthLogitsProcessor(4, 2, eos))]
    for length in (4, 5, 6, 7):
        ids = torch.zeros(3, length, dtype=torch.long)
        for ours, theirs in pairs:
            expected, given = theirs(ids, scores.clone()), scores.clone()
            got = ours(ids, given)  # in place: the loop's scores are its own
            assert got.data_ptr() == given.data_ptr()
            assert torch.equal(got.isnan(), expected.isnan())
            assert torch.equal(got.nan_to_num(), expected.nan_to_num())
