"""The "fast" sampling stream: `generate()`'s distribution, drawn with a random stream of nndf's own.

`generate(do_sample=True)` draws each token with `torch.multinomial`, which takes one float64 uniform per vocabulary
entry from PyTorch's Mersenne Twister, serially: 0.4 ms per row of GPT-2's 50257 logits on the 2-core AVX2 machine
(`bench/sampling_cpu.py`), whatever top-k has kept, because the stream must advance as `generate()`'s does. The
default stream ("generate") pays that for exact seeded parity with `generate()`. This one draws from the same
distribution (softmax of the processed scores, top-k applied) without that cost:

- the Gumbel-max trick: the row's argmax of `score - log(E)`, E ~ Exp(1), is a draw from softmax(scores); random
  numbers are drawn only for the tokens that can be picked (top-k's few dozen, or every finite score), from numpy's
  PCG64 seeded with the seed;
- top-k, when it is the last warper (`generate()`'s default, k 50), is applied here instead of as a warper, as
  the default stream's draw applies it too (`nndf.kept_tokens`): the k-th largest score is found among the scores
  above a threshold read from a strided sample of the row (checked: when fewer than k scores pass it, the whole
  row is searched), so the vocabulary is not rewritten with -inf; after a screened LM head
  (`nndf.export.screened_head`), among its candidates alone (a few hundred of GPT-2's 50257 at top-k 50), which
  hold every score that can be in the top k: no pass over the vocabulary at all.

A seed S gives the same tokens on every run and every backend whose logits agree, but not `generate()`'s tokens for
`torch.manual_seed(S)`. Without a seed, the stream's seed is drawn once per generation from PyTorch's global
generator (so `torch.manual_seed` still makes a run repeatable); a `torch.Generator` as seed is drawn from the same
way. On CUDA, where the draw costs the device little, scores are drawn as `generate()` draws them.
"""

from __future__ import annotations

import numpy as np
import torch

from nndf.errors import HarnessError
from nndf.kept_tokens import first_max_of_runs, sampled_top_k
from nndf.processors import screened_top_k


class FastDraw:
    """Picks each row's next token from processed scores by the Gumbel-max trick over the tokens that can be picked;
    with `top_k` > 0 it applies top-k itself (a warper `Sampling.warpers` then leaves out)."""

    def __init__(self, seed: int | torch.Generator | None, generate_draw, top_k: int = 0) -> None:
        """`generate_draw`: the default stream's chooser for the same seed and top-k (`nndf.sampling.TokenChooser`),
        which draws scores this one does not take (on CUDA, or in half precision)."""
        self.seed = seed
        self.top_k = top_k
        self.reads_candidates = bool(top_k)  # the loop passes a screened head's candidates (`__call__`)
        self.generate_draw = generate_draw
        self.rng: np.random.Generator | None = None

    def _stream_seed(self) -> int:
        if isinstance(self.seed, int):
            return self.seed
        generator = self.seed if isinstance(self.seed, torch.Generator) else None  # None: the global generator
        return int(torch.randint(0, 2**62, (1,), generator=generator))

    def __call__(self, scores: torch.Tensor, candidates: np.ndarray | None = None) -> torch.Tensor:
        """`candidates`: a screened head's (`nndf.decoder.Decoder.candidates`: (row, column) pairs in row-major
        order, among which every score that can be in a row's top k is), so that top-k reads them alone; the same
        tokens and random numbers as without them."""
        if scores.device.type != "cpu" or scores.requires_grad or scores.dtype not in (torch.float32, torch.float64):
            return self._on_device(scores)
        if self.rng is None:
            self.rng = np.random.Generator(np.random.PCG64(self._stream_seed()))
        table = scores.numpy()
        rows, vocab = table.shape
        kept = None if candidates is None else screened_top_k(table, candidates, self.top_k)
        if kept is None:
            best = table.max(axis=-1)  # NaN anywhere in a row makes its max NaN
            if not np.isfinite(best).all():
                raise HarnessError("cannot sample: a row's scores hold NaN or +inf, or are all -inf (a probability "
                                   "distribution needs finite scores; torch.multinomial refuses them too)")
            if not 0 < self.top_k < vocab:  # every finite score can be picked: a number for each
                keys = table - np.log(self.rng.standard_exponential(table.shape))
                return torch.from_numpy(keys.argmax(axis=-1))
            kept = sampled_top_k(table, self.top_k)
        row, column, values = kept[:3]
        keys = values.astype(np.float64) - np.log(self.rng.standard_exponential(len(row)))
        return torch.from_numpy(column[first_max_of_runs(keys, row, rows)])

    def warped(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores as `generate()`'s warpers leave them (top-k applied, in place), for stopping criteria."""
        return self.generate_draw.warped(scores)

    def _on_device(self, scores: torch.Tensor) -> torch.Tensor:
        """generate()'s own draw, top-k included: the default stream's chooser (`generate_draw`)."""
        return self.generate_draw(scores)

