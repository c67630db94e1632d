"""LAMBADA accuracy/perplexity and logit fidelity as pure functions over a logits callable.

Backends hand us a *logits function*: input ids and attention mask of shape (B, T), sequences padded on the right
(`nndf.batching`) -> float logits (B, T, V). Everything here consumes that callable only, so the same numbers come out of PyTorch, ONNX Runtime
and TensorRT runs, and the metrics can be tested with a fake model whose logits were chosen by hand.

Two LAMBADA metric families are reported side by side because people compare against both:

* NVIDIA's TensorRT HuggingFace demo (`run.py accuracy`): TopN accuracy and token/sequence perplexity of the last
  `tokens_to_generate` tokens of the passage, teacher-forced.
* lm-evaluation-harness 0.4.13 `lambada_openai`: greedy accuracy and perplexity of the last space-separated word,
  equal to lm-eval's own `hf` model's figures (its request encoding: `nndf.loglikelihood`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from nndf.batching import LogitsFn, batch_logits, batched_logits, length_groups
from nndf.errors import HarnessError, UsageError
from nndf.loglikelihood import causal_window, encode_pair, score

# NVIDIA demo/HuggingFace/NNDF/interface.py: `MAX_LOG_PPL = 12.0`, applied with `min(...)` to each sample's mean
# cross-entropy (not to each token's), and NNDF/checkpoints.py NNLambadaCheckpoint.summary caps the reported
# perplexity with `min(math.exp(avg_log_ppl), 100000.0)`.
MAX_LOG_PPL = 12.0
MAX_PPL = 100000.0

# ----------------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LambadaMetrics:
    """LAMBADA results: NVIDIA-demo TopN/perplexities and lm-evaluation-harness `lambada_openai` acc/ppl.

    Accuracies are fractions in [0, 1]. `samples` counts every passage scored by lm-eval; the NVIDIA-demo fields
    leave out passages with fewer than `tokens_to_generate + 1` tokens and are NaN when none was long enough.
    """

    samples: int
    top_n: int
    top1: float
    topN: float  # noqa: N815 - NVIDIA's name for the user-chosen TopN accuracy
    top10: float
    token_perplexity: float
    sequence_perplexity: float
    lm_eval_accuracy: float
    lm_eval_perplexity: float
    cut_passages: int = 0  # longer than the model's positions: cut as each family cuts them (`evaluate_lambada`)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FidelityMetrics:
    """How closely a candidate's next-token distributions follow a reference's, over every scored position."""

    positions: int
    top1_agreement: float
    mean_kl: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------------
# Tokenisation
# ----------------------------------------------------------------------------------------------------------------


def lm_eval_context_target(text: str) -> tuple[str, str]:
    """Split as `lambada_openai` does: on single spaces, context = all but the last piece, target = ' ' + last."""
    pieces = text.split(" ")
    return " ".join(pieces[:-1]), " " + pieces[-1]


def lm_eval_pair(tokenizer, text: str, *, separately: bool = False) -> tuple[list[int], list[int]]:
    """(context ids, target ids) of a LAMBADA passage as lm-evaluation-harness 0.4.13 encodes its `lambada_openai`
    request (see `nndf.loglikelihood`; `separately`: for an encoder-decoder model)."""
    return encode_pair(tokenizer, *lm_eval_context_target(text), separately=separately)


def _demo_ids(tokenizer, text: str) -> list[int]:
    """The NVIDIA demo's sequence, before it is cut from the right: `tokenizer(text)` with its default special
    tokens."""
    return list(tokenizer(text)["input_ids"])


# ----------------------------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------------------------


def _demo_scores(
    logits: torch.Tensor, ids: list[int], tokens_to_generate: int, top_ns: tuple[int, ...]
) -> tuple[float, float, dict[int, int]]:
    """One passage in NVIDIA-demo semantics (decoder-only, batch 1, greedy), from logits over `ids[:-1]`.

    Returns (clipped mean NLL of the whole shifted sequence, clipped mean NLL of the last `tokens_to_generate`
    targets, {N: number of those targets among the N highest logits at their position}).
    """
    targets = torch.tensor(ids[1:], dtype=torch.long)
    nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    seq_log_ppl = min(float(nll.mean()), MAX_LOG_PPL)
    token_log_ppl = min(float(nll[-tokens_to_generate:].mean()), MAX_LOG_PPL)
    last_logits = logits[-tokens_to_generate:]
    last_targets = targets[-tokens_to_generate:]
    vocab = logits.shape[-1]
    hits: dict[int, int] = {}
    for n in top_ns:
        top = last_logits.topk(min(n, vocab), dim=-1).indices
        hits[n] = int((top == last_targets[:, None]).any(dim=-1).sum())
    return seq_log_ppl, token_log_ppl, hits


def check_lambada_settings(tokens_to_generate: int, top_n: int) -> None:
    """The NVIDIA-demo metrics' settings: `accuracy` checks them before any model loads, the scorers again (API)."""
    if tokens_to_generate < 1:
        raise UsageError(f"--tokens-to-generate must be at least 1, got {tokens_to_generate}")
    if top_n < 1:
        raise UsageError(f"--topN must be at least 1, got {top_n}")


def _check_max_positions(max_positions: int) -> None:
    if max_positions < 2:
        raise UsageError(f"max_positions must be at least 2 (one context token and one target), got {max_positions}")


def evaluate_lambada(
    texts: Sequence[str],
    tokenizer,
    logits_fn: LogitsFn,
    *,
    tokens_to_generate: int = 1,
    top_n: int = 5,
    max_positions: int,
    progress: bool = True,
    batch_size: int = 1,
    max_batch_tokens: int | None = None,
) -> LambadaMetrics:
    """Score LAMBADA passages in both NVIDIA-demo and lm-evaluation-harness `lambada_openai` semantics.

    NVIDIA demo (matched to TensorRT demo/HuggingFace/NNDF/interface.py `NetworkCommand.execute_accuracy` and
    NNDF/checkpoints.py `NNLambadaCheckpoint.summary`, TensorRT 9.x/10.x): the passage is tokenised with
    `tokenizer(text)` and cut from the right to `max_positions`; the last `tokens_to_generate` tokens are the
    targets and are teacher-forced. Per passage, sequence log-ppl = mean cross-entropy over the whole shifted
    sequence and token log-ppl = mean cross-entropy over the targets, each clipped with `min(., 12.0)` (the mean is
    clipped, not each token). Reported perplexity = `min(exp(mean over passages), 1e5)`. TopN accuracy counts, for
    each N in {1, top_n, 10}, target tokens that are among the N highest logits at their position, divided by
    (passages x tokens_to_generate). Passages with fewer than `tokens_to_generate + 1` tokens have no context to
    predict from and are left out of these metrics only. NVIDIA's own loader also normalises curly quotes
    (checkpoints.py `process_text`); that is a property of its dataset reader, so the texts are scored as given here.

    lm-evaluation-harness 0.4.13 `lambada_openai` (equal to its `hf` model's figures, tests/test_lm_eval.py):
    context = `text.split(' ')[:-1]` joined by ' ', target = ' ' + last piece, encoded as its `HFLM` encodes a
    decoder-only request (`nndf.loglikelihood`: the tokenizer's own special tokens, so a BOS where the tokenizer
    adds one, as OPT's and Llama's do; the target is what follows the context's own ids in the encoding of the
    whole string); one forward pass over `(context + target)[-(max_positions + 1):][:-1]`. acc = every target token
    is the argmax; perplexity = `exp(-mean over passages of the target's summed log-likelihood)` (per passage, not
    per token).

    Both families usually need the same forward pass (the lm-eval sequence is `tokenizer(text)` as well, so they
    share it unless the passage is longer than `max_positions`), so the backend is called once per passage then
    and twice otherwise. Those passes run up to `batch_size` sequences of one length at a time (at most
    `max_batch_tokens` positions per batch, see `nndf.batching`); every figure is summed in passage order, so the
    figures do not depend on the batching.
    """
    check_lambada_settings(tokens_to_generate, top_n)
    _check_max_positions(max_positions)
    if len(texts) == 0:
        raise UsageError("there are no LAMBADA passages to evaluate; pass a dataset with at least one passage")

    top_ns = tuple(dict.fromkeys((1, top_n, 10)))
    # Every forward pass the passages need, once each: sequence -> [(passage, "lm" | "demo"), ...]. Both metric
    # families usually share one pass (see the docstring); identical passages share theirs too.
    wanted: dict[tuple[int, ...], list[tuple[int, str]]] = {}
    targets: list[list[int]] = []
    demos: list[list[int] | None] = []
    cut = 0  # passages longer than max_positions
    for index, text in enumerate(texts):
        ctx, target = lm_eval_pair(tokenizer, text)
        window = causal_window(ctx, target, max_positions)
        if len(target) > len(window):
            raise UsageError(
                f"max_positions {max_positions} is too small to score passage {index}: its target word alone is "
                f"{len(target)} tokens; use the model's real maximum sequence length"
            )
        demo = _demo_ids(tokenizer, text)
        cut += len(demo) > max_positions or len(ctx) + len(target) > max_positions + 1
        demo = demo[:max_positions]
        demo_usable = len(demo) >= tokens_to_generate + 1
        targets.append(target)
        demos.append(demo if demo_usable else None)
        if target:
            wanted.setdefault(tuple(window), []).append((index, "lm"))
        if demo_usable:
            # Same sequence for both families and no truncation: window == demo[:-1], one pass for both.
            wanted.setdefault(tuple(demo[:-1]), []).append((index, "demo"))

    lm_scores: list[tuple[float, bool]] = [score(None, [])] * len(texts)  # an empty target's score
    demo_scores: list[tuple[float, float, dict[int, int]] | None] = [None] * len(texts)
    sequences = list(wanted)
    remaining = [0] * len(texts)
    for parts in wanted.values():
        for index, _ in parts:
            remaining[index] += 1
    with tqdm(total=len(texts), desc="LAMBADA", unit="passage", file=sys.stderr, disable=not progress) as bar:
        if remaining.count(0):  # an update of 0 would draw the bar a second time
            bar.update(remaining.count(0))
        for request, logits in batched_logits(logits_fn, sequences, batch_size, max_batch_tokens):
            for index, part in wanted[sequences[request]]:
                if part == "lm":
                    lm_scores[index] = score(logits, targets[index])
                else:
                    demo_scores[index] = _demo_scores(logits, demos[index], tokens_to_generate, top_ns)
                remaining[index] -= 1
                if remaining[index] == 0:
                    bar.update(1)

    # Summed in passage order, so that the figures do not depend on how the passages were batched.
    hits = dict.fromkeys(top_ns, 0)
    seq_log_ppls: list[float] = []
    token_log_ppls: list[float] = []
    logliks = [loglik for loglik, _ in lm_scores]
    greedy_count = sum(greedy for _, greedy in lm_scores)
    for scores in demo_scores:
        if scores is not None:
            seq_lp, tok_lp, passage_hits = scores
            seq_log_ppls.append(seq_lp)
            token_log_ppls.append(tok_lp)
            for n, h in passage_hits.items():
                hits[n] += h

    demo_passages = len(token_log_ppls)
    if demo_passages:
        denominator = demo_passages * tokens_to_generate
        accuracy = {n: h / denominator for n, h in hits.items()}
        token_ppl = min(math.exp(sum(token_log_ppls) / demo_passages), MAX_PPL)
        seq_ppl = min(math.exp(sum(seq_log_ppls) / demo_passages), MAX_PPL)
    else:
        accuracy = dict.fromkeys(top_ns, math.nan)
        token_ppl = seq_ppl = math.nan

    mean_loglik = sum(logliks) / len(logliks)
    try:
        lm_ppl = math.exp(-mean_loglik)
    except OverflowError:
        lm_ppl = math.inf

    return LambadaMetrics(
        samples=len(texts),
        top_n=top_n,
        top1=accuracy[1],
        topN=accuracy[top_n],
        top10=accuracy[10],
        token_perplexity=token_ppl,
        sequence_perplexity=seq_ppl,
        lm_eval_accuracy=greedy_count / len(texts),
        lm_eval_perplexity=lm_ppl,
        cut_passages=cut,
    )


class ReferenceLogits:
    """One passage's reference logits (T, V), prepared once for comparing any number of candidates with them: its
    float64 log-probabilities, their probabilities and its argmax. `accuracy` judges every backend against the same
    PyTorch pass, so this half of the work is done once per passage, not once per backend, and each candidate's
    figures are, to the last bit, those of comparing it alone.

    float64 because a KL of 1e-12 (what an exact export shows) is a small difference of log-probabilities near -10,
    lost to float32's rounding of 1e-7. Rewriting KL as  sum p log p - sum p c + logsumexp(c)  (c: the candidate's
    logits) would spare a candidate one pass over the vocabulary (about a quarter of its comparison), but then two
    identical backends would differ by a rounding KL of ~1e-14 instead of 0: not done."""

    def __init__(self, ref: torch.Tensor):
        self.shape = tuple(ref.shape)
        self.log_probs = torch.log_softmax(ref.double(), dim=-1)
        self.probs = self.log_probs.exp()
        self.argmax = ref.argmax(dim=-1)

    def compare(self, cand: torch.Tensor) -> tuple[int, int, float]:
        """(positions, positions whose argmax agrees, summed KL(reference || candidate)) for candidate logits
        (T, V)."""
        if self.shape != tuple(cand.shape):
            raise HarnessError(
                f"reference logits have shape {self.shape} but candidate logits {tuple(cand.shape)}; "
                "compare two models that share the tokenizer and vocabulary"
            )
        cand_logp = torch.log_softmax(cand.double(), dim=-1)
        kl = (self.probs * (self.log_probs - cand_logp)).sum(dim=-1)
        return self.shape[0], int((self.argmax == cand.argmax(dim=-1)).sum()), float(kl.sum())


def compare_logits(ref: torch.Tensor, cand: torch.Tensor) -> tuple[int, int, float]:
    """(positions, positions whose argmax agrees, summed KL(reference || candidate)) of two (T, V) logit tensors."""
    return ReferenceLogits(ref).compare(cand)


def fidelity_metrics(per_passage: Sequence[tuple[int, int, float]]) -> FidelityMetrics:
    """Top-1 agreement and mean KL from each passage's `compare` triple, summed in passage order (so that the figures
    do not depend on the batching)."""
    positions = agree = 0
    kl_sum = 0.0
    for n, a, k in per_passage:
        positions, agree, kl_sum = positions + n, agree + a, kl_sum + k
    if positions == 0:
        raise UsageError("there are no tokens to compare; pass at least one non-empty passage")
    return FidelityMetrics(positions=positions, top1_agreement=agree / positions, mean_kl=kl_sum / positions)


FIDELITY_DESC = "fidelity vs PyTorch (--no-fidelity skips)"  # the progress bar's name for the comparison pass

# a batch (row indices) -> each row's logits (T, V), in the batch's order
RowsFn = Callable[[list[int]], Sequence[torch.Tensor]]


def shared_reference_fidelities(
    groups: Iterable[list[int]],
    reference_rows: RowsFn,
    candidate_rows: Sequence[RowsFn],
    *,
    rows: int,
    passages: int,
    progress: bool = True,
) -> list[FidelityMetrics]:
    """Top-1 agreement and mean KL(reference || candidate) of each candidate, over `rows` scored sequences, with the
    reference run once for all of them: every architecture's fidelity pass (`logit_fidelities`, the encoder-decoder
    `logit_fidelities_seq2seq`) is this loop, only what a row is and how a batch of them is scored differ.

    `groups` are the batches (row indices); `reference_rows(group)` and each `candidate_rows[i](group)` return the
    group's logits, one (T, V) tensor per row in the group's order. The reference runs once per batch and every
    candidate is compared with it there: the reference pass (PyTorch) and its float64 log-softmax cost as much as a
    candidate's, so judging three backends costs four passes, not six, and no reference logits are kept beyond their
    batch (a whole data set's would not fit in memory). The progress bar counts `passages`; those beyond `rows`
    (passages with nothing to score) are counted at once."""
    per_passage = [[(0, 0, 0.0)] * rows for _ in candidate_rows]
    with tqdm(total=passages, desc=FIDELITY_DESC, unit="passage", file=sys.stderr, disable=not progress) as bar:
        if passages > rows:  # done at once (an update of 0 draws the bar again)
            bar.update(passages - rows)
        for group in groups:
            refs = [ReferenceLogits(ref) for ref in reference_rows(group)]
            for scores, candidate in zip(per_passage, candidate_rows):
                for index, ref, cand in zip(group, refs, candidate(group)):
                    scores[index] = ref.compare(cand)
            bar.update(len(group))
    return [fidelity_metrics(scores) for scores in per_passage]


def logit_fidelities(
    texts: Sequence[str],
    tokenizer,
    reference_fn: LogitsFn,
    candidate_fns: Sequence[LogitsFn],
    *,
    max_positions: int,
    progress: bool = True,
    batch_size: int = 1,
    max_batch_tokens: int | None = None,
) -> list[FidelityMetrics]:
    """Top-1 agreement and mean KL(reference || candidate) of each candidate, over every position of every passage
    (`shared_reference_fidelities`: the reference runs once for all candidates).

    Meant for judging int8/int4 models against fp32: accuracy on a small sample moves in coarse steps, while these
    per-position numbers show drift long before a greedy answer flips. Each passage is `tokenizer(text)` cut from
    the right to `max_positions`; every position counts once, so long passages weigh more than short ones.
    """
    if max_positions < 1:
        raise UsageError(f"max_positions must be at least 1, got {max_positions}")
    sequences = [ids for ids in (list(tokenizer(text)["input_ids"])[:max_positions] for text in texts) if ids]

    def rows_of(logits_fn: LogitsFn) -> RowsFn:
        return lambda group: batch_logits(logits_fn, [sequences[i] for i in group])

    groups = length_groups([len(ids) for ids in sequences], batch_size, max_batch_tokens)
    return shared_reference_fidelities(groups, rows_of(reference_fn), [rows_of(fn) for fn in candidate_fns],
                                       rows=len(sequences), passages=len(texts), progress=progress)


def logit_fidelity(texts: Sequence[str], tokenizer, reference_fn: LogitsFn, candidate_fn: LogitsFn,
                   **keywords) -> FidelityMetrics:
    """`logit_fidelities` of one candidate."""
    return logit_fidelities(texts, tokenizer, reference_fn, [candidate_fn], **keywords)[0]
