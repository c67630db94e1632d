"""LAMBADA for encoder-decoder models, scored the way lm-evaluation-harness scores them.

lm-evaluation-harness 0.4 (`HFLM` with the seq2seq backend) splits a passage as for decoder-only models (context =
all but the last space-separated word, target = ' ' + that word) but encodes the two separately, each with the
tokenizer's special tokens (T5 ends each with `</s>`; BART wraps each in `<s> ... </s>`): the context goes to the
encoder and the target's tokens are the decoder's labels, teacher-forced behind the decoder start token. A passage
counts as correct when every target token is the argmax; perplexity is exp(-mean over passages of the target's
summed log-likelihood). Top-1 / top-N / top-10 and token perplexity are reported over the same target tokens
(NVIDIA's demo defines its accuracy for decoder-only models only).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from nndf.batching import length_groups, pad_right
from nndf.errors import UsageError
from nndf.evaluation import (MAX_LOG_PPL, MAX_PPL, FidelityMetrics, LambadaMetrics, lm_eval_score, compare_logits,
                             lm_eval_context_target)

# (encoder ids (B, S), encoder mask (B, S), decoder ids (B, T)), each padded on the right -> logits (B, T, V)
Seq2SeqLogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def encode_pair(tokenizer, text: str, max_positions: int) -> tuple[list[int], list[int]]:
    """(encoder ids, target ids) as lm-eval's seq2seq `_encode_pair` builds them, each cut from the left."""
    context, target = lm_eval_context_target(text)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        target = context[-n_spaces:] + target
        context = context[:-n_spaces]
    context_ids = list(tokenizer(context)["input_ids"])[-max_positions:]
    target_ids = list(tokenizer(target)["input_ids"])[-max_positions:]
    if not context_ids or not target_ids:
        raise UsageError(f"passage {text[:40]!r} gives an empty context or target; pass LAMBADA-style passages")
    return context_ids, target_ids


def _teacher_forced(logits_fn: Seq2SeqLogitsFn, pairs: Sequence[tuple[list[int], list[int]]], start: int,
                    dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Logits (T, V) for each target position of each (context, target) pair, run as one right-padded batch: the
    encoder reads the contexts under their mask, the decoder the start token and the target shifted right."""
    context_ids, context_mask = pad_right([context for context, _ in pairs])
    decoder_ids, _ = pad_right([[start, *target[:-1]] for _, target in pairs])
    with torch.no_grad():
        out = torch.as_tensor(logits_fn(context_ids, context_mask, decoder_ids))
    out = out.detach().to(device="cpu", dtype=dtype)
    return [out[row, : len(target)] for row, (_, target) in enumerate(pairs)]


def _groups(pairs: Sequence[tuple[list[int], list[int]]], batch_size: int, max_batch_tokens: int | None):
    return length_groups([(len(c), len(t)) for c, t in pairs], batch_size, max_batch_tokens)


def evaluate_lambada_seq2seq(texts: Sequence[str], tokenizer, logits_fn: Seq2SeqLogitsFn, *, start_token_id: int,
                             top_n: int = 5, max_positions: int, progress: bool = True, batch_size: int = 1,
                             max_batch_tokens: int | None = None) -> LambadaMetrics:
    """Every metric of `LambadaMetrics` over the target word's tokens (see the module docstring)."""
    if top_n < 1:
        raise UsageError(f"--topN must be at least 1, got {top_n}")
    if not texts:
        raise UsageError("there are no LAMBADA passages to evaluate; pass a dataset with at least one passage")
    top_ns = tuple(dict.fromkeys((1, top_n, 10)))
    hits = dict.fromkeys(top_ns, 0)
    tokens = greedy_count = 0
    logliks: list[float] = []
    token_log_ppls: list[float] = []
    pairs = [encode_pair(tokenizer, text, max_positions) for text in texts]
    scores: list = [None] * len(pairs)
    with tqdm(total=len(pairs), desc="LAMBADA", unit="passage", file=sys.stderr, disable=not progress) as bar:
        for group in _groups(pairs, batch_size, max_batch_tokens):
            for index, logits in zip(group, _teacher_forced(logits_fn, [pairs[i] for i in group], start_token_id)):
                target = pairs[index][1]
                expected = torch.tensor(target)[:, None]
                passage_hits = {n: int((logits.topk(min(n, logits.shape[-1]), dim=-1).indices == expected)
                                       .any(dim=-1).sum()) for n in top_ns}
                scores[index] = (*lm_eval_score(logits, target), passage_hits)
            bar.update(len(group))
    for (loglik, greedy, passage_hits), (_, target) in zip(scores, pairs):  # in passage order
        logliks.append(loglik)
        greedy_count += greedy
        token_log_ppls.append(min(-loglik / len(target), MAX_LOG_PPL))
        for n in top_ns:
            hits[n] += passage_hits[n]
        tokens += len(target)
    token_ppl = min(math.exp(sum(token_log_ppls) / len(texts)), MAX_PPL)
    try:
        lm_ppl = math.exp(-sum(logliks) / len(logliks))
    except OverflowError:
        lm_ppl = math.inf
    return LambadaMetrics(samples=len(texts), top_n=top_n, top1=hits[1] / tokens, topN=hits[top_n] / tokens,
                          top10=hits[10] / tokens, token_perplexity=token_ppl, sequence_perplexity=math.nan,
                          lm_eval_accuracy=greedy_count / len(texts), lm_eval_perplexity=lm_ppl)


def logit_fidelity_seq2seq(texts: Sequence[str], tokenizer, reference_fn: Seq2SeqLogitsFn,
                           candidate_fn: Seq2SeqLogitsFn, *, start_token_id: int, max_positions: int,
                           progress: bool = True, batch_size: int = 1,
                           max_batch_tokens: int | None = None) -> FidelityMetrics:
    """Top-1 agreement and mean KL(reference || candidate) over the teacher-forced target positions."""
    pairs = [encode_pair(tokenizer, text, max_positions) for text in texts]
    per_passage: list = [None] * len(pairs)
    with tqdm(total=len(pairs), desc="fidelity", unit="passage", file=sys.stderr, disable=not progress) as bar:
        for group in _groups(pairs, batch_size, max_batch_tokens):
            batch = [pairs[i] for i in group]
            refs = _teacher_forced(reference_fn, batch, start_token_id, torch.float64)
            cands = _teacher_forced(candidate_fn, batch, start_token_id, torch.float64)
            for index, ref, cand in zip(group, refs, cands):
                per_passage[index] = compare_logits(ref, cand)
            bar.update(len(group))
    positions = agree = 0
    kl_sum = 0.0
    for n, a, k in per_passage:  # in passage order
        positions, agree, kl_sum = positions + n, agree + a, kl_sum + k
    if positions == 0:
        raise UsageError("there are no tokens to compare; pass at least one non-empty passage")
    return FidelityMetrics(positions=positions, top1_agreement=agree / positions, mean_kl=kl_sum / positions)
