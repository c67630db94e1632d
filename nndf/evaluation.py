"""LAMBADA accuracy/perplexity and logit fidelity as pure functions over a logits callable.

Backends hand us a *logits function*: input ids and attention mask of shape (B, T), sequences padded on the right
(`nndf.batching`) -> float logits (B, T, V). Everything here consumes that callable only, so the same numbers come out of PyTorch, ONNX Runtime
and TensorRT runs, and the metrics can be tested with a fake model whose logits were chosen by hand.

Two LAMBADA metric families are reported side by side because people compare against both:

* NVIDIA's TensorRT HuggingFace demo (`run.py accuracy`): TopN accuracy and token/sequence perplexity of the last
  `tokens_to_generate` tokens of the passage, teacher-forced.
* lm-evaluation-harness 0.4 `lambada_openai`: greedy accuracy and perplexity of the last space-separated word.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from nndf.batching import length_groups, pad_right
from nndf.errors import HarnessError, UsageError

# (input ids (B, T), attention mask (B, T), right-padded) -> float logits (B, T, V)
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

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


def _plain_ids(tokenizer, text: str) -> list[int]:
    """Ids without special tokens: lm-evaluation-harness encodes causal-LM requests without BOS."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def _lm_eval_pair(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(context ids, target ids) exactly as lm-evaluation-harness 0.4 `HFLM._encode_pair` builds them.

    The target's ids are whatever follows the context's own encoding length inside the encoding of the joined
    string, so a BPE merge across the boundary is attributed the way lm-eval attributes it.
    """
    context, target = lm_eval_context_target(text)
    if context == "":
        # lm-eval scores a context-free continuation after the BOS (else EOS) token.
        prefix = getattr(tokenizer, "bos_token_id", None)
        if prefix is None:
            prefix = getattr(tokenizer, "eos_token_id", None)
        if prefix is None:
            raise UsageError(
                f"passage {text[:40]!r} has no space-separated context and the tokenizer has no BOS/EOS token to "
                "stand in for it; pass LAMBADA-style passages whose last word follows a space"
            )
        return [prefix], _plain_ids(tokenizer, target)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        target = context[-n_spaces:] + target
        context = context[:-n_spaces]
    whole = _plain_ids(tokenizer, context + target)
    ctx = _plain_ids(tokenizer, context)
    return ctx, whole[len(ctx):]


def _demo_ids(tokenizer, text: str, max_positions: int) -> list[int]:
    """The NVIDIA demo's sequence: `tokenizer(text)` with its default special tokens, cut from the right."""
    return list(tokenizer(text)["input_ids"])[:max_positions]


# ----------------------------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------------------------


def _batch_logits(logits_fn: LogitsFn, sequences: Sequence[Sequence[int]],
                  dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Run the backend on sequences padded into one batch and return each one's logits, (T_i, V) CPU tensors.

    LAMBADA scoring uses float32 because both references do: lm-eval takes `F.log_softmax` of float32 logits and
    NVIDIA calls `.float()` before `CrossEntropyLoss` (float64 moves lm-eval's published ppl in the 6th digit).
    """
    ids, mask = pad_right(sequences)
    with torch.no_grad():
        out = torch.as_tensor(logits_fn(ids, mask))
    if out.dim() != 3 or tuple(out.shape[:2]) != tuple(ids.shape):
        raise HarnessError(
            f"the logits function returned shape {tuple(out.shape)} for input ids of shape {tuple(ids.shape)}; "
            "a backend must return logits of shape (batch, T, vocab) for input (batch, T)"
        )
    out = out.detach().to(device="cpu", dtype=dtype)
    return [out[row, : len(tokens)] for row, tokens in enumerate(sequences)]


def batched_logits(logits_fn: LogitsFn, sequences: Sequence[Sequence[int]], batch_size: int,
                   max_tokens: int | None, dtype: torch.dtype = torch.float32):
    """(index, logits) for every sequence, computed in batches of one length (see `nndf.batching`)."""
    for group in length_groups([len(s) for s in sequences], batch_size, max_tokens):
        yield from zip(group, _batch_logits(logits_fn, [sequences[i] for i in group], dtype))


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


def lm_eval_score(logits: torch.Tensor | None, target: list[int]) -> tuple[float, bool]:
    """(summed log-likelihood, every target token is the argmax) from logits whose last rows predict `target`."""
    if not target:
        return 0.0, True
    rows = logits[-len(target):]
    tgt = torch.tensor(target, dtype=torch.long)
    logp = torch.log_softmax(rows, dim=-1)
    loglik = float(logp.gather(1, tgt[:, None]).sum())
    greedy = bool((rows.argmax(dim=-1) == tgt).all())
    return loglik, greedy


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

    lm-evaluation-harness 0.4 `lambada_openai`: context = `text.split(' ')[:-1]` joined by ' ', target =
    ' ' + last piece, tokenised without BOS as `HFLM._encode_pair` does; one forward pass over
    `(context + target)[-(max_positions + 1):][:-1]`. acc = every target token is the argmax; perplexity =
    `exp(-mean over passages of the target's summed log-likelihood)` (per passage, not per token).

    Both families usually need the same forward pass (the lm-eval sequence equals `tokenizer(text)` when the
    tokenizer adds no special tokens and nothing is truncated), so the backend is called once per passage then and
    twice otherwise. Those passes run up to `batch_size` sequences of one length at a time (at most
    `max_batch_tokens` positions per batch, see `nndf.batching`); every figure is summed in passage order, so the
    figures do not depend on the batching.
    """
    if tokens_to_generate < 1:
        raise UsageError(f"--tokens-to-generate must be at least 1, got {tokens_to_generate}")
    if top_n < 1:
        raise UsageError(f"--topN must be at least 1, got {top_n}")
    _check_max_positions(max_positions)
    if len(texts) == 0:
        raise UsageError("there are no LAMBADA passages to evaluate; pass a dataset with at least one passage")

    top_ns = tuple(dict.fromkeys((1, top_n, 10)))
    # Every forward pass the passages need, once each: sequence -> [(passage, "lm" | "demo"), ...]. Both metric
    # families usually share one pass (see the docstring); identical passages share theirs too.
    wanted: dict[tuple[int, ...], list[tuple[int, str]]] = {}
    targets: list[list[int]] = []
    demos: list[list[int] | None] = []
    for index, text in enumerate(texts):
        ctx, target = _lm_eval_pair(tokenizer, text)
        lm_seq = ctx + target
        window = lm_seq[-(max_positions + 1):][:-1]
        if len(target) > len(window):
            raise UsageError(
                f"max_positions {max_positions} is too small to score passage {index}: its target word alone is "
                f"{len(target)} tokens; use the model's real maximum sequence length"
            )
        demo = _demo_ids(tokenizer, text, max_positions)
        demo_usable = len(demo) >= tokens_to_generate + 1
        targets.append(target)
        demos.append(demo if demo_usable else None)
        if target:
            wanted.setdefault(tuple(window), []).append((index, "lm"))
        if demo_usable:
            # Same sequence for both families and no truncation: window == demo[:-1], one pass for both.
            wanted.setdefault(tuple(demo[:-1]), []).append((index, "demo"))

    lm_scores: list[tuple[float, bool]] = [lm_eval_score(None, [])] * len(texts)  # an empty target's score
    demo_scores: list[tuple[float, float, dict[int, int]] | None] = [None] * len(texts)
    sequences = list(wanted)
    remaining = [0] * len(texts)
    for parts in wanted.values():
        for index, _ in parts:
            remaining[index] += 1
    with tqdm(total=len(texts), desc="LAMBADA", unit="passage", file=sys.stderr, disable=not progress) as bar:
        bar.update(remaining.count(0))
        for request, logits in batched_logits(logits_fn, sequences, batch_size, max_batch_tokens):
            for index, part in wanted[sequences[request]]:
                if part == "lm":
                    lm_scores[index] = lm_eval_score(logits, targets[index])
                else:
                    demo_scores[index] = _demo_scores(logits, demos[index], tokens_to_generate, top_ns)
                remaining[index] -= 1
                bar.update(remaining[index] == 0)

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
    )


def compare_logits(ref: torch.Tensor, cand: torch.Tensor) -> tuple[int, int, float]:
    """(positions, positions whose argmax agrees, summed KL(reference || candidate)) of two (T, V) logit tensors."""
    if ref.shape != cand.shape:
        raise HarnessError(
            f"reference logits have shape {tuple(ref.shape)} but candidate logits {tuple(cand.shape)}; "
            "compare two models that share the tokenizer and vocabulary"
        )
    ref_logp = torch.log_softmax(ref.double(), dim=-1)
    cand_logp = torch.log_softmax(cand.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - cand_logp)).sum(dim=-1)
    return ref.shape[0], int((ref.argmax(dim=-1) == cand.argmax(dim=-1)).sum()), float(kl.sum())


def logit_fidelity(
    texts: Sequence[str],
    tokenizer,
    reference_fn: LogitsFn,
    candidate_fn: LogitsFn,
    *,
    max_positions: int,
    progress: bool = True,
    batch_size: int = 1,
    max_batch_tokens: int | None = None,
) -> FidelityMetrics:
    """Top-1 agreement and mean KL(reference || candidate) over every position of every passage, in float64.

    Meant for judging int8/int4 models against fp32: accuracy on a small sample moves in coarse steps, while these
    per-position numbers show drift long before a greedy answer flips. Each passage is `tokenizer(text)` cut from
    the right to `max_positions`; every position counts once, so long passages weigh more than short ones.
    """
    if max_positions < 1:
        raise UsageError(f"max_positions must be at least 1, got {max_positions}")
    sequences = [ids for ids in (list(tokenizer(text)["input_ids"])[:max_positions] for text in texts) if ids]
    per_passage: list[tuple[int, int, float]] = [(0, 0, 0.0)] * len(sequences)
    lengths = [len(ids) for ids in sequences]
    with tqdm(total=len(texts), desc="fidelity", unit="passage", file=sys.stderr, disable=not progress) as bar:
        bar.update(len(texts) - len(sequences))
        for group in length_groups(lengths, batch_size, max_batch_tokens):
            batch = [sequences[i] for i in group]
            refs = _batch_logits(reference_fn, batch, torch.float64)
            cands = _batch_logits(candidate_fn, batch, torch.float64)
            for index, ref, cand in zip(group, refs, cands):
                per_passage[index] = compare_logits(ref, cand)
            bar.update(len(group))
    positions = sum(n for n, _, _ in per_passage)
    agree = sum(a for _, a, _ in per_passage)
    kl_sum = 0.0
    for _, _, k in per_passage:  # in passage order, as the figures must not depend on the batching
        kl_sum += k
    if positions == 0:
        raise UsageError("there are no tokens to compare; pass at least one non-empty passage")
    return FidelityMetrics(positions=positions, top1_agreement=agree / positions, mean_kl=kl_sum / positions)
