"""transformers' logits processors as the loop applies them, with the per-step cost of the cheap ones kept cheap.

The loop builds `generate()`'s processors from transformers' own classes (`GenerationOptions.processors`). Two of
them, the minimum-length EOS bans, rebuild an arange over the vocabulary, a `torch.isin` over it and a copy of the
scores at every step, before and after the minimum is reached: 0.6 ms of a 21 ms GPT-2 step on ONNX Runtime
(`bench/onnxrt_io.py`), where every benchmark pays it (its generations are forced to an exact length). The
subclasses here compute the same scores (the EOS ids set to -inf while the minimum is not reached, the scores
unchanged after) by indexing the EOS ids alone. Sampling's top-k warper (`generate()`'s default, k 50) is
computed here in place with numpy's selection (`FastTopK`), and top-p after it over the scores top-k left
(`FastTopP`). `tests/test_fast_processors.py` checks each against its transformers parent.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from transformers import (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, TopKLogitsWarper,
                          TopPLogitsWarper)


class PlainProcessors(list):
    """transformers' processors applied in order, as `LogitsProcessorList(tokens, scores)` applies them, without its
    per-call `inspect.signature` of every processor (it looks for processors that take extra keywords: none of
    those built here do), which costs more per decode step than most of the processors themselves."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, candidates=None) -> torch.Tensor:
        """`candidates`: a screened head's (`nndf.decoder.Decoder.candidates`), for the top-k warper to read."""
        for processor in self:
            if candidates is not None and isinstance(processor, FastTopK):
                scores = processor(input_ids, scores, candidates)
            else:
                scores = processor(input_ids, scores)
        return scores

    @property
    def reads_candidates(self) -> bool:
        """Whether a screened head's candidates would spare a warper a pass over the vocabulary (top-k's)."""
        return any(isinstance(processor, FastTopK) for processor in self)


class _EosBan:
    """Sets the EOS ids that index the scores' vocabulary to -inf (one `index_fill_`), as `torch.where(isin(...))`
    does; the ids that fit are worked out once per vocabulary size and device, not at every step.

    In place: the loop hands the processors scores of its own (a step's logits, read once), and a copy of the
    vocabulary's scores per step, allocated and written right after the step, cost ~90 us of a 18 ms GPT-2 step."""

    eos_token_id: torch.Tensor

    def banned(self, scores: torch.Tensor) -> torch.Tensor:
        key = (scores.shape[-1], scores.device)
        cached = getattr(self, "_fitting_eos", None)
        if cached is None or cached[0] != key:
            eos = self.eos_token_id.to(scores.device)
            cached = self._fitting_eos = (key, eos[(eos >= 0) & (eos < scores.shape[-1])])
        return scores.index_fill_(-1, cached[1], -math.inf)


def screen_room(processors) -> tuple[int, bool] | None:
    """What `processors` may do to a step's scores, where a screened LM head (`nndf.export.screened_head`) can
    tolerate it: (how many tokens they may set to -inf: the minimum-length EOS bans' ids, whether they may lower the
    scores of the tokens already in the sequences: a repetition penalty above 1); None where one changes scores
    otherwise (a penalty below 1 raises them, an n-gram ban bans any number), which needs the full head."""
    from transformers import RepetitionPenaltyLogitsProcessor

    banned, lowers_seen = 0, False
    for processor in processors:
        if isinstance(processor, _EosBan):
            banned += int(processor.eos_token_id.numel())
        elif isinstance(processor, RepetitionPenaltyLogitsProcessor) and processor.penalty > 1:
            lowers_seen = True
        else:
            return None
    return banned, lowers_seen


# Above this many exact leaders over a step's rows (k x rows), a screened head costs about what the full head does:
# the leaders' rows of the table, TopK over the vocabulary, and the candidates they let through (GPT-2 small, random
# weights: one row 2.5 ms at k = 51, 6.7 at 1024; four rows 6.4 at 130, 12.9 at 512; the full head 10.8-11.2).
SCREEN_MOST = 1024


def head_screen(options, processors, stopping) -> Callable[[torch.Tensor], int]:
    """What greedy search and sampling (`options`: a `GenerationOptions`; `processors`: its `processors()`) ask of
    a decoder's screened head (`nndf.export.screened_head`) at a step over the given sequences: k >= 1 where the
    pick reads only the k - b highest scores (1 greedy, top_k sampling: `Sampling.scores_read`) after the
    processors lower at most b of them: the EOS ids banned before the minimum length, and with a repetition penalty
    every token already in the sequences (at most their length); 0, the full head, with stopping criteria (they
    are given the scores), processors that change scores otherwise, sampling that reads every score (top-k off), or
    more than `SCREEN_MOST` leaders over the rows."""
    read = options.sampling.scores_read()
    room = screen_room(processors[:len(processors) - len(options.sampling.warpers())])
    if read is None or room is None or stopping is not None:
        return lambda tokens: 0
    banned, lowers_seen = room

    def screen(tokens: torch.Tensor) -> int:
        k = read + banned + (tokens.shape[1] if lowers_seen else 0)
        return k if k * tokens.shape[0] <= SCREEN_MOST else 0

    return screen


class FastMinLength(_EosBan, MinLengthLogitsProcessor):
    """`MinLengthLogitsProcessor`: EOS banned while the sequences are shorter than `min_length`."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.banned(scores) if input_ids.shape[-1] < self.min_length else scores


class FastMinNewTokensLength(_EosBan, MinNewTokensLengthLogitsProcessor):
    """`MinNewTokensLengthLogitsProcessor`: EOS banned until `min_new_tokens` tokens follow the prompt."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.prompt_length_to_skip < self.min_new_tokens:
            return self.banned(scores)
        return scores


class FastTopK(TopKLogitsWarper):
    """`TopKLogitsWarper`: every score below the k-th largest set to `filter_value`, in place, the k-th largest found
    by numpy's selection (`np.partition`, the same value as `torch.topk`'s k-th, ties and NaN ranked alike) on float
    CPU scores. transformers' own sorts the k largest and allocates a mask and a copy of the scores: 0.5 ms per row
    of GPT-2's 50257 on the AVX2 machine, about the draw's own cost (`bench/sampling_cpu.py`). Elsewhere (CUDA,
    half precision) it is the parent's.

    The draws' search above a sampled threshold (`nndf.kept_tokens.sampled_top_k`), with the rows then filled and the
    kept scores written back, was tried here: faster warm (77 against 106 us a row, 300 against 550 at batch 4, one
    thread), slower where it runs, right after a decode step, where each of its ten numpy calls meets cold caches
    (timed inside the loop on the Xeon: 426 against 260 us at batch 1, 812 against 884 at batch 4).

    After a screened LM head the k-th largest comes from its candidates (`screened_kth`: a few hundred scores, not
    the vocabulary), and only the write of `filter_value` reads whole rows."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, candidates=None) -> torch.Tensor:
        """`candidates`: a screened head's, among which each row's k-th largest is found (`screened_kth`)."""
        if scores.device.type != "cpu" or scores.requires_grad or scores.dtype not in (torch.float32, torch.float64):
            return super().__call__(input_ids, scores)
        k = min(self.top_k, scores.shape[-1])
        values = scores.numpy()
        screened = screened_kth(values, candidates, k) if candidates is not None and values.ndim == 2 else None
        if screened is not None:
            kth = screened[3][:, None]
        else:
            kth = np.partition(values, -k, axis=-1)[..., -k:-k + 1 or None]
        values[values < kth] = self.filter_value
        return scores


def screened_kth(table: np.ndarray, candidates: np.ndarray, k: int):
    """Each row's k-th largest score of `table`, read from a screened head's candidates alone
    (`nndf.export.screened_head`: (row, column) pairs, row-major, among which is every score that can be in a row's
    top k after the processors `screen_room` counted): (row, column, score) of every candidate and that k-th largest
    per row; None where the whole rows must be read: a row with fewer than k candidates (a batch's rows and the
    candidates' disagree), a NaN or +inf among them, or a k-th largest of -inf (top-k then keeps every score of the
    row). Few numpy calls: each costs microseconds right after a decode step, whose stream of weights leaves nothing
    of them in the caches."""
    if not 0 < k < table.shape[-1]:
        return None
    row, column = candidates.T
    if len(table) == 1:  # batch 1: no counts to take (fewer calls, each of them microseconds after a step)
        values = table[0, column]
        if len(values) < k or row[-1] != 0 or not values.max() < np.inf:  # NaN and +inf fail the last
            return None
        kth = np.partition(values, len(values) - k)[len(values) - k:len(values) - k + 1]
        return None if kth[0] == -np.inf else (row, column, values, kth)
    values = table[row, column]
    counts = np.bincount(row, minlength=len(table))
    if len(counts) != len(table) or counts.min() < k or not (values < np.inf).all():  # NaN and +inf fail it
        return None
    kth = kth_largest_of_runs(values, counts, k)
    if kth.min() == -np.inf:
        return None
    return row, column, values, kth


def screened_top_k(table: np.ndarray, candidates: np.ndarray, k: int):
    """`screened_kth`'s (row, column, score) cut to the candidates at or above their row's k-th largest, rows in
    order, and the k-th largest per row; None where `screened_kth` gives None."""
    found = screened_kth(table, candidates, k)
    if found is None:
        return None
    row, column, values, kth = found
    keep = values >= kth[row]
    return row[keep], column[keep], values[keep], kth


def kth_largest_of_runs(values: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """The k-th largest of each row's run of `values` (rows in order, `counts` of each, every count >= k)."""
    ends = np.cumsum(counts)
    return np.array([np.partition(values[end - count: end], count - k)[count - k]
                     for count, end in zip(counts, ends)])


class VerifiedRows:
    """Per vocabulary width, whether a shortcut has given what it stands for, bit for bit, on the first `needed`
    rows of that width in this process (the caller computes both ways until then and returns the original's
    result): None while checking, True once it has, False for good after one difference. For shortcuts that rely
    on how PyTorch's kernels round (the order of a softmax's sums), which a build or a CPU could change."""

    def __init__(self, needed: int = 16) -> None:
        self.needed = needed
        self.seen: dict[int, int | bool] = {}  # vocabulary width -> rows found equal so far, or False

    def trusted(self, width: int) -> bool | None:
        seen = self.seen.get(width, 0)
        return False if seen is False else (True if seen >= self.needed else None)

    def record(self, width: int, equal: bool, rows: int) -> None:
        seen = self.seen.get(width, 0)
        if seen is not False:
            self.seen[width] = seen + rows if equal else False


class FastTopP(TopPLogitsWarper):
    """`TopPLogitsWarper` over the finite scores alone, where few are finite (after top-k, `generate()`'s default
    when sampling): the same scores set to `filter_value`, in place.

    transformers' sorts the whole vocabulary (50257 scores, 50207 of them -inf after top-k 50) for every row at every
    step: 1.5 ms of a 21 ms GPT-2 step at batch 1, 6 at batch 4 (one thread). Here each row's finite scores are
    sorted alone and laid at the end of a row of -inf whose width is the vocabulary's modulo `ALIGN` (plus `ALIGN`s
    until they fit), so that every finite score sits in the same SIMD lane as in the vocabulary-wide sorted row;
    the softmax and the cumulative sum then round exactly as transformers' do (the -inf add exact zeros). Without
    that alignment the sums differed in the last bit in 1 row in 10.

    The first rows of each vocabulary width in a process (`VERIFIED`) are computed both ways and the parent's
    result returned; one difference makes that width the parent's for good. It is the parent's own too where its
    order would decide (two equal finite scores in a row), where a score is NaN or +inf, where a row has no finite
    score or more than an eighth of the vocabulary, and on another device or dtype."""

    ALIGN = 1024
    VERIFIED = VerifiedRows()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.device.type != "cpu" or scores.requires_grad or scores.dtype != torch.float32 or scores.dim() != 2:
            return super().__call__(input_ids, scores)
        trusted = self.VERIFIED.trusted(scores.shape[-1])
        if trusted is False:
            return super().__call__(input_ids, scores)
        if trusted is None:
            expected, ours = super().__call__(input_ids, scores), scores.clone()
            if self._in_place(ours):
                self.VERIFIED.record(scores.shape[-1], torch.equal(ours, expected), len(ours))
            return expected
        return scores if self._in_place(scores) else super().__call__(input_ids, scores)

    def _in_place(self, scores: torch.Tensor) -> bool:
        """The parent's result written into `scores`; False (nothing written) where it cannot be had this way."""
        values = scores.numpy()
        if not np.isfinite(values.max(axis=-1)).all():  # a NaN or +inf (max gives it), or a row all -inf
            return False
        finite = values > -np.inf
        counts = finite.sum(axis=-1)
        if counts.max() * 8 > values.shape[-1]:
            return False
        width = values.shape[-1] % self.ALIGN
        width += -(-max(int(counts.max()) - width, 0) // self.ALIGN) * self.ALIGN
        tail = np.full((len(values), width), -np.inf, dtype=np.float32)
        kept = []
        for row, (row_values, row_finite) in enumerate(zip(values, finite)):
            columns = np.flatnonzero(row_finite)
            ordered = columns[np.argsort(row_values[columns], kind="stable")]
            ascending = row_values[ordered]
            if (ascending[1:] == ascending[:-1]).any():  # a tie: which of the two goes first is the parent's sort's
                return False
            tail[row, width - len(ordered):] = ascending
            kept.append(ordered)
        cumulative = torch.from_numpy(tail).softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - self.top_p)
        remove[..., -self.min_tokens_to_keep:] = False
        remove = remove.numpy()
        for row, ordered in enumerate(kept):
            values[row, ordered[remove[row, width - len(ordered):]]] = self.filter_value
        return True
