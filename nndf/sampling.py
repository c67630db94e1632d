"""Sampling in the one loop: `generate()`'s warpers, its draw, and its seed.

Hugging Face `generate(do_sample=True)` appends warpers to its logits processors (temperature, top-k, top-p, min-p,
typical-p, epsilon and eta cutoffs, in that order: `GenerationMixin._get_logits_processor`), turns the scores into
probabilities with a softmax and draws each row's next token with `torch.multinomial(probs, num_samples=1)` from
the default generator of the logits' device. `Sampling` holds those settings and builds the same warpers from
transformers' own classes; `TokenChooser` makes the same draw, so that a backend whose logits equal PyTorch's
picks the same tokens as `torch.manual_seed(S); model.generate(do_sample=True, ...)` for `seed=S`.

`seed` S draws from a private `torch.Generator` seeded with S: its stream is the one `torch.manual_seed(S)` gives
the default generator (a CPU generator and a CUDA one alike start from the seed alone), without touching the
caller's global random state. A `torch.Generator` as `seed` is drawn from and left advanced (a chat continues one
stream across its replies, as one `torch.manual_seed` before several `generate()` calls does); None draws from the
global generator, as `generate()` does.

On the CPU the draw is `CpuDraw`: torch.multinomial's own computation, its logarithm and ratio taken only where the
probability is not 0, the same tokens and the same random numbers consumed (checked against torch.multinomial once
per process);
elsewhere it is torch.multinomial itself. Temperature 0 means greedy search, as in llama.cpp and ONNX Runtime
GenAI (`generate()` refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from nndf.errors import UsageError
from nndf.fast_draw import FastDraw
from nndf.kept_tokens import first_max_of_runs, kept_softmax, kept_top_k, masked_softmax
from nndf.processors import FastTopK, FastTopP

# generate()'s keywords that choose how the next token is picked, in the order its flags are listed.
SAMPLING_KEYWORDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p")
# Where the draws come from: generate()'s own random stream (exact seeded parity), or nndf's (nndf.fast_draw).
SAMPLING_STREAMS = ("generate", "fast")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_repetition_penalty(penalty) -> None:
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
        raise UsageError(f"repetition_penalty (--repetition-penalty) must be a number above 0 (1: off), "
                         f"got {penalty!r}")


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked; the defaults are `generate()`'s (greedy; when sampling, top-k 50).

    Only `do_sample` and a temperature above 0 make it sample; the other settings then shape the distribution as
    `generate()`'s warpers do (top_k 0, top_p 1, typical_p 1, min_p None: off). `top_h`, `epsilon_cutoff` and
    `eta_cutoff` come from a model's generation config only (no flag), so that such a model samples as its
    `generate()` does. `stream` is where the draws come from: "generate" (`generate()`'s own, so a seed gives its
    tokens) or "fast" (the same distribution from a stream of nndf's own at a fraction of the CPU cost:
    `nndf.fast_draw`).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float | None = None
    typical_p: float = 1.0
    top_h: float | None = None
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    seed: int | torch.Generator | None = None
    stream: str = "generate"

    def __post_init__(self) -> None:
        checks = (
            ("do_sample", self.do_sample, isinstance(self.do_sample, bool), "True or False"),
            ("temperature", self.temperature, _is_number(self.temperature) and self.temperature >= 0,
             "a number >= 0 (0: greedy)"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
             "a whole number >= 0 (0: off)"),
            ("top_p", self.top_p, _is_number(self.top_p) and 0 <= self.top_p <= 1, "a number from 0 to 1 (1: off)"),
            ("min_p", self.min_p, self.min_p is None or (_is_number(self.min_p) and 0 <= self.min_p <= 1),
             "a number from 0 to 1"),
            ("typical_p", self.typical_p, _is_number(self.typical_p) and 0 < self.typical_p <= 1,
             "a number above 0 and at most 1 (1: off)"),
            ("seed", self.seed, self.seed is None or isinstance(self.seed, torch.Generator)
             or (isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed < 2**63),
             "a whole number from 0 to 2**63 - 1 or a torch.Generator"),
        )
        for name, value, ok, allowed in checks:
            if not ok:
                raise UsageError(f"{name} (--{name.replace('_', '-')}) must be {allowed}, got {value!r}")
        if self.stream not in SAMPLING_STREAMS:
            raise UsageError(f"sampling_stream (--sampling-stream) must be one of {', '.join(SAMPLING_STREAMS)}, "
                             f"got {self.stream!r}")

    @classmethod
    def resolve(cls, generation_config, seed=None, stream: str | None = None, **given) -> "Sampling":
        """The settings `generate(**given)` would use: a keyword given (not None), else the model's generation
        config, else transformers' own defaults (`GenerationConfig._get_default_generation_params`, the table
        `generate()` itself fills unset fields from; private, so tests/test_sampling.py checks the result against
        `generate()`'s own processor list)."""
        from transformers import GenerationConfig

        unknown = set(given) - set(SAMPLING_KEYWORDS)
        if unknown:
            raise UsageError(f"unknown sampling keyword(s) {sorted(unknown)}; allowed: {', '.join(SAMPLING_KEYWORDS)}")
        defaults = GenerationConfig._get_default_generation_params()
        values = {}
        for field in fields(cls):
            if field.name in ("seed", "stream"):
                continue
            for source in (given.get(field.name), getattr(generation_config, field.name, None),
                           defaults.get(field.name)):
                if source is not None:
                    values[field.name] = source
                    break
        return cls(seed=seed, stream=stream or "generate", **values)

    @property
    def samples(self) -> bool:
        """Whether tokens are drawn (else the highest score is taken: greedy or beam search)."""
        return bool(self.do_sample) and self.temperature != 0

    def scores_read(self) -> int | None:
        """How many of the highest scores the pick reads exactly, the rest only as "lower": 1 for greedy, top_k when
        sampling with top-k (the temperature before it keeps the order; every warper after it and the draw read the
        kept scores alone); None where the whole vocabulary counts (top-k off, or top-h, which reads every score, before
        it). A screened LM head (`nndf.export.screened_head`) computes those exactly and the others approximately."""
        if not self.samples:
            return 1
        return None if self.top_k == 0 or self.top_h is not None else int(self.top_k)

    def warpers(self, device: torch.device | None = None) -> list:
        """`generate()`'s warpers for these settings, in its order (nothing when not sampling), less the top-k that
        the draw applies itself (`drawn_top_k`)."""
        warpers = self._generate_warpers(device)
        return warpers[:-1] if self.drawn_top_k(warpers) else warpers

    def drawn_top_k(self, warpers: list | None = None) -> int:
        """The k the draw applies itself, else 0: where top-k is the last of `generate()`'s warpers (as in its
        defaults), either stream's draw finds the kept tokens without rewriting the vocabulary
        (`nndf.kept_tokens`)."""
        warpers = self._generate_warpers() if warpers is None else warpers
        if warpers and isinstance(warpers[-1], FastTopK):
            return warpers[-1].top_k
        return 0

    def _generate_warpers(self, device: torch.device | None = None) -> list:
        from transformers import (
            EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper, TemperatureLogitsWarper, TopHLogitsWarper,
            TypicalLogitsWarper,
        )

        if not self.samples:
            return []
        warpers = []
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_h is not None:
            warpers.append(TopHLogitsWarper(top_h=self.top_h))
        if self.top_k != 0:
            warpers.append(FastTopK(top_k=int(self.top_k)))
        if self.top_p < 1.0:
            warpers.append(FastTopP(top_p=self.top_p))
        if self.min_p is not None:
            warpers.append(MinPLogitsWarper(min_p=self.min_p))
        if self.typical_p < 1.0:
            warpers.append(TypicalLogitsWarper(mass=self.typical_p))
        if 0.0 < self.epsilon_cutoff < 1.0:
            warpers.append(EpsilonLogitsWarper(epsilon=self.epsilon_cutoff))
        if 0.0 < self.eta_cutoff < 1.0:
            warpers.append(EtaLogitsWarper(epsilon=self.eta_cutoff, device=device))
        return warpers

    def chooser(self):
        """What picks each row's token from the processed scores: `TokenChooser`, or on the fast stream when
        sampling, `nndf.fast_draw.FastDraw`."""
        top_k = self.drawn_top_k()
        if self.samples and self.stream == "fast":
            return FastDraw(self.seed, TokenChooser(True, self.seed, top_k), top_k)
        return TokenChooser(self.samples, self.seed, top_k)

    def describe(self) -> str:
        """One phrase for a table's title or a chat's banner: "greedy", or the settings that shape the draw."""
        if not self.samples:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k != 0:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top-p {self.top_p:g}")
        if self.min_p is not None:
            parts.append(f"min-p {self.min_p:g}")
        if self.typical_p < 1.0:
            parts.append(f"typical-p {self.typical_p:g}")
        if isinstance(self.seed, int):
            parts.append(f"seed {self.seed}")
        if self.stream != "generate":
            parts.append(f"{self.stream} stream")
        return f"sampling ({', '.join(parts)})"


def last_dim_argmax(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(dim=-1)`, the same indices (the first of equal maxima; NaN counts as the largest), computed by
    numpy for a CPU tensor: PyTorch's CPU argmax is not vectorised and takes 65 us for one row of GPT-2's 50257 logits
    on one thread (260 us for four), a sizeable share of an ONNX Runtime decode step, where numpy's takes 6 us
    (`bench/onnxrt_io.py` measures the host's share of a step). Elsewhere (CUDA) it is torch's own."""
    if scores.device.type != "cpu" or scores.requires_grad or scores.dtype not in (torch.float32, torch.float64):
        return scores.argmax(dim=-1)
    return torch.from_numpy(scores.numpy().argmax(axis=-1))


class TokenChooser:
    """Picks each row's next token from processed scores: their argmax, or `generate()`'s draw.

    The draw is `torch.multinomial(softmax(scores), 1)`, made once per step for every row (finished rows too), so
    the random stream advances exactly as `generate()`'s does. A seeded generator is made on the scores' device at
    the first draw. On the CPU the same draw is made faster (`CpuDraw`). With `top_k`, the chooser applies
    `generate()`'s last warper, top-k, itself (`Sampling.drawn_top_k`): on the CPU it weighs and draws among the
    kept tokens alone (`nndf.kept_tokens`, from a screened head's candidates where the loop passes them), the
    same probabilities and tokens without writing -inf over the vocabulary; elsewhere it is the warper.
    """

    def __init__(self, samples: bool, seed: int | torch.Generator | None = None, top_k: int = 0) -> None:
        self.samples = samples
        self.seed = seed
        self.generator = seed if isinstance(seed, torch.Generator) else None
        self.cpu_draw: CpuDraw | None = None
        self.top_k = top_k if samples else 0
        self.top_k_warper = FastTopK(top_k=self.top_k) if self.top_k else None
        self.reads_candidates = bool(self.top_k)  # the loop then passes a screened head's candidates

    def __call__(self, scores: torch.Tensor, candidates=None) -> torch.Tensor:
        if not self.samples:
            return last_dim_argmax(scores)
        if self.generator is None and self.seed is not None:
            self.generator = torch.Generator(device=scores.device).manual_seed(self.seed)
        if self.top_k_warper is not None:
            drawn = self._draw_kept(scores, candidates)
            if drawn is not None:
                return drawn
            scores = self.top_k_warper(None, scores, candidates)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        if probs.device.type == "cpu" and probs.dtype == torch.float32 and CpuDraw.is_exact():
            return self._cpu_draw(probs.shape)(probs, self.generator)
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)

    def warped(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores as `generate()`'s warpers leave them (the top-k this chooser applies itself, in place), for
        stopping criteria, which `generate()` gives the processed scores."""
        return scores if self.top_k_warper is None else self.top_k_warper(None, scores)

    def _cpu_draw(self, shape: torch.Size) -> CpuDraw:
        if self.cpu_draw is None or self.cpu_draw.shape != shape:
            self.cpu_draw = CpuDraw(shape)
        return self.cpu_draw

    def _draw_kept(self, scores: torch.Tensor, candidates) -> torch.Tensor | None:
        """The draw among top-k's kept tokens alone (CPU float32 rows); None where the whole rows must be taken."""
        if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2 \
                or scores.requires_grad or not CpuDraw.is_exact():
            return None
        table = scores.numpy()
        kept = kept_top_k(table, self.top_k, candidates)
        if kept is None:
            return None
        row, column, values = kept
        probs = kept_softmax(row, column, values, table.shape)
        return self._cpu_draw(scores.shape).among(
            row, column, probs, lambda: masked_softmax(row, column, values, table.shape), self.generator)


class CpuDraw:
    """`torch.multinomial(probs, 1).squeeze(1)` for float32 softmax probabilities of one shape on the CPU: the same
    tokens and the same random numbers drawn, at a fraction of the cost.

    For one sample torch draws q ~ Exp(1) per element (`exponential_`) and takes argmax(probs / q). Its CPU
    exponential_ takes one 53-bit uniform u per element from the generator, serially, and computes
    float(-log1p(-u)) one element at a time (ATen's `exponential_distribution<double>`, glibc's log1p). Here the same
    uniforms come from `uniform_` on a float64 tensor (the same draws, in a buffer kept from step to step), and the
    rest is computed only where the probability is not 0: an element of probability 0 has the ratio 0 and cannot be
    the argmax, and after top-k (`generate()`'s default keeps 50) that leaves a few dozen elements of the 50257, so
    the logarithm and the ratio cost next to nothing (numpy's log1p is glibc's too), for all rows at once. Where most
    elements are live (no top-k) every element is computed with the logarithm vectorised by torch (glibc's, one
    element at a time, would cost more than it saves), and so it is where some u is exactly 0 (a probability-0
    element is 0/0 = NaN there, which argmax takes, as in torch). `is_exact` checks once per process, on full and
    on masked distributions, that this build gives identical tokens and generator states, else the loop calls
    torch.multinomial itself.

    The probabilities are a softmax's, so a row is either a distribution or all NaN (a NaN or +inf score, or every
    score -inf, spreads through the sum): a NaN at the chosen element is how an invalid row shows, and then
    torch.multinomial is called to raise its own error."""

    _exact: bool | None = None

    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape
        self.uniform = torch.empty(shape, dtype=torch.float64)
        # kept from step to step (a fresh tensor of a batch's vocabulary costs more in page faults than the arithmetic)
        self.exponential = torch.empty(shape, dtype=torch.float32)
        self.ratio = self.exponential.numpy()  # the same memory: q, then the ratio written over it

    def __call__(self, probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        self.uniform.uniform_(generator=generator)
        return self._pick(probs, generator)

    def among(self, row: np.ndarray, column: np.ndarray, probs: np.ndarray, whole, generator=None) -> torch.Tensor:
        """The draw for a probability table that is `probs` at (row, column) (rows in order, columns ascending,
        every row present) and 0 elsewhere: the same uniforms drawn, the logarithm and ratio taken at those entries
        alone, each row's first largest ratio. `whole()` gives the table itself (a tensor), for the draw where some
        uniform is exactly 0 (torch's ratio is then 0/0 = NaN at a probability-0 element, which argmax takes)."""
        self.uniform.uniform_(generator=generator)
        uniform = self.uniform.numpy()
        if not uniform.all():
            return self._pick(whole(), generator)
        ratio = probs / _exponential(uniform[row, column])
        return torch.from_numpy(column[first_max_of_runs(ratio, row, len(uniform))])

    def _pick(self, probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The draw from `probs` with the uniforms already drawn (`self.uniform`)."""
        uniform, table = self.uniform.numpy(), probs.numpy()
        live = table != 0
        if np.count_nonzero(live) * 8 > live.size or (uniform == 0.0).any():
            # mostly live (no top-k), or a zero uniform: every element, the logarithm vectorised by torch
            self.exponential.copy_(self.uniform.neg_().log1p_().neg_())  # q ~ Exp(1), rounded to float32 as torch does
            ratio = self.ratio
            with np.errstate(divide="ignore", invalid="ignore"):  # q = 0: inf or NaN, as torch's division
                np.divide(table, ratio, out=ratio)
        else:  # a probability-0 element's ratio is 0, as in torch's own division
            ratio = self.ratio
            ratio.fill(0.0)
            ratio[live] = table[live] / _exponential(uniform[live])
        tokens = ratio.argmax(axis=-1)
        if np.isnan(table[np.arange(len(table)), tokens]).any() or not live.any(axis=-1).all():
            return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)  # it says what is wrong
        return torch.from_numpy(tokens)

    @classmethod
    def is_exact(cls) -> bool:
        """Whether the draw equals torch.multinomial on this build of torch (asked once per process, on 64 rows of
        random probabilities, then the same with all but 20 of each row's 1000 scores at -inf, as top-k leaves
        them: the same tokens and the same generator state after)."""
        if cls._exact is None:
            with torch.inference_mode():
                scores = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
                masked = scores.masked_fill(scores < scores.topk(20).values[:, -1:], float("-inf"))
                theirs, ours = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
                cls._exact = True
                for probs in (scores.softmax(dim=-1), masked.softmax(dim=-1)):
                    expected = torch.multinomial(probs, num_samples=1, generator=theirs).squeeze(1)
                    cls._exact &= torch.equal(cls(probs.shape)(probs, ours), expected)
                cls._exact &= torch.equal(ours.get_state(), theirs.get_state())
        return cls._exact


def _exponential(uniform: np.ndarray) -> np.ndarray:
    """torch's Exp(1) draws for these uniforms, as its CPU `exponential_` computes them: -log1p(-u) in float64
    (glibc's log1p, as numpy's), rounded to float32."""
    return (-np.log1p(-uniform)).astype(np.float32)
