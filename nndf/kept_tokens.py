"""The tokens top-k sampling keeps, found and weighed without rewriting the vocabulary.

`generate()`'s default sampling (top-k 50 as the last warper) sets every score below a row's k-th largest to -inf,
takes the softmax of the whole row and draws. All but k of GPT-2's 50257 scores then play no part, yet each of
those steps reads and writes the whole row: on a 2-core CPU, where an ONNX Runtime decode step of GPT-2 small takes
13-16 ms, that is a few percent of a step per row. Both sampling streams apply top-k inside their draw instead
(`nndf.sampling.TokenChooser`, `nndf.fast_draw.FastDraw`), from what this module finds:

- `kept_top_k`: (row, column, score) of every score at or above its row's k-th largest (ties kept, as
  `TopKLogitsWarper` keeps them), rows in order and columns ascending: from a screened LM head's candidates where
  there are some (`nndf.processors.screened_top_k`), else searched above a threshold read from a strided sample of
  the row (`sampled_top_k`).
- `kept_softmax`: the softmax those scores get in their -inf row, bit for bit, computed over a narrow row.
- `first_max_of_runs`: each row's first maximum among its kept entries (argmax's choice in the whole row).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nndf.processors import VerifiedRows, kth_largest_of_runs, screened_top_k

# The threshold's sample: about this many scores per token kept, and a threshold expected to pass 4 x top-k scores.
SAMPLE_PER_KEPT = 16
MARGIN = 4
# The narrow row keeps each kept score's column modulo this many, and the order within each of those classes, so that
# a softmax summing in SIMD lanes of up to this many floats (or that many accumulators) adds the same numbers in the
# same order as over the vocabulary; the -inf elsewhere add exact zeros.
LANES = 64
SOFTMAX_ROWS = VerifiedRows()  # `kept_softmax` against the whole row's softmax, per vocabulary width


def kept_top_k(table: np.ndarray, k: int, candidates: np.ndarray | None = None):
    """(row, column, score) of every score of `table` [rows, vocab] that top-k keeps; None where that is not a few
    per row: top-k off (k 0 or at least the vocabulary), or a row holding NaN or +inf, or only -inf (the caller's
    whole-row path then does what `generate()` does, and torch.multinomial says what is wrong). `candidates`: a
    screened LM head's, among which every score that can be in a row's top k is (`nndf.export.screened_head`)."""
    if candidates is not None:
        found = screened_top_k(table, candidates, k)
        if found is not None:
            return found[:3]
    if not 0 < k < table.shape[-1] or not np.isfinite(table.max(axis=-1)).all():  # max gives NaN where one is
        return None
    return sampled_top_k(table, k)


def sampled_top_k(table: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, column, score) of every score at or above its row's k-th largest (ties kept), rows in order. The k-th
    largest is searched among the scores above a threshold taken from a strided sample; where fewer than k of a
    row pass it, among whole rows."""
    rows, vocab = table.shape
    stride = max(1, vocab // (SAMPLE_PER_KEPT * k))
    sample = table[:, ::stride]
    rank = min(sample.shape[1], math.ceil(MARGIN * k / stride))  # the sample's rank-th largest: ~MARGIN*k above it
    threshold = np.partition(sample, sample.shape[1] - rank, axis=-1)[:, -rank:][:, :1]
    row, column = _where(table >= threshold)
    counts = np.bincount(row, minlength=rows)
    if (counts < k).any():  # a threshold above some row's k-th largest: search whole rows
        kth = np.partition(table, vocab - k, axis=-1)[:, vocab - k: vocab - k + 1]
        row, column = _where(table >= kth)
        return row, column, table[row, column]
    values = table[row, column]
    kth = kth_largest_of_runs(values, counts, k)
    keep = values >= kth[row]
    return row[keep], column[keep], values[keep]


def _where(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.nonzero(mask)` of a 2-D mask, row-major: through `flatnonzero`, ten times faster on a vocabulary's row."""
    return np.divmod(np.flatnonzero(mask), mask.shape[1])


def first_max_of_runs(keys: np.ndarray, row: np.ndarray, rows: int) -> np.ndarray:
    """The index into `keys` of each row's first largest key, where each of the `rows` rows is one run of `keys`
    (rows in order, every row present): what argmax picks in the row, the entries outside the runs being lower."""
    if rows == 1:  # one run: no counts to take (each numpy call costs microseconds right after a decode step)
        return np.array([int(keys.argmax())])
    counts = np.bincount(row, minlength=rows)
    ends = np.cumsum(counts)
    starts = ends - counts
    return np.array([start + int(keys[start:end].argmax()) for start, end in zip(starts, ends)])


def masked_softmax(row: np.ndarray, column: np.ndarray, values: np.ndarray, shape) -> torch.Tensor:
    """The softmax of rows of -inf holding `values` at (row, column): the probabilities `generate()` draws from
    after top-k, computed over the whole vocabulary."""
    masked = np.full(shape, -np.inf, dtype=np.float32)
    masked[row, column] = values
    return torch.from_numpy(masked).softmax(dim=-1)


def kept_softmax(row: np.ndarray, column: np.ndarray, values: np.ndarray, shape) -> np.ndarray:
    """`masked_softmax(...)[row, column]`, the same float32 values, computed over a narrow row: the blocks of
    `LANES` columns that hold a kept score, in order, then the vocabulary's last partial block (GPT-2 at top-k 50:
    about 3300 of 50257 columns). PyTorch's softmax sums a row in SIMD lanes from its start to its end, so every
    lane sees the same nonzero terms in the same order, and the partial block at the end is its tail as before.

    That reading of PyTorch's kernel is checked, not trusted: the first rows of each vocabulary width in a process
    (`SOFTMAX_ROWS`) are computed both ways, and one difference makes that width's softmax the whole row's for
    good (`tests/test_kept_tokens.py` checks both ways on this build)."""
    rows, vocab = shape
    trusted = SOFTMAX_ROWS.trusted(vocab)
    if trusted is False:
        return masked_softmax(row, column, values, shape).numpy()[row, column]
    position, width = _narrow_positions(row, column, rows, vocab)
    narrow = np.full((rows, width), -np.inf, dtype=np.float32)
    narrow[row, position] = values
    probs = torch.from_numpy(narrow).softmax(dim=-1).numpy()[row, position]
    if trusted is None:
        expected = masked_softmax(row, column, values, shape).numpy()[row, column]
        SOFTMAX_ROWS.record(vocab, np.array_equal(probs, expected), rows)
        return expected
    return probs


def _narrow_positions(row: np.ndarray, column: np.ndarray, rows: int, vocab: int) -> tuple[np.ndarray, int]:
    """Each kept score's place in `kept_softmax`'s narrow rows, and their width: the same column modulo `LANES`,
    the blocks in order, the last partial block at the end of every row."""
    block = column // LANES
    opens = np.empty(len(column), dtype=bool)  # an entry that opens a new block of its row
    opens[0] = True
    np.not_equal(block[1:], block[:-1], out=opens[1:])
    tail_start = vocab - vocab % LANES
    if rows == 1:  # the partial block, where kept, is the row's last: the same place as a whole block's
        rank = np.cumsum(opens) - 1
        blocks = int(rank[-1]) + (column[-1] < tail_start)
        return rank * LANES + column % LANES, blocks * LANES + vocab % LANES
    new_row = np.flatnonzero(row[1:] != row[:-1]) + 1
    opens[new_row] = True
    rank = np.cumsum(opens) - 1
    rank -= rank[np.r_[0, new_row]][row]  # the block's rank among its row's kept blocks
    in_tail = column >= tail_start
    blocks = int(rank[~in_tail].max()) + 1 if not in_tail.all() else 0
    position = np.where(in_tail, blocks * LANES + column - tail_start, rank * LANES + column % LANES)
    return position, blocks * LANES + vocab % LANES
