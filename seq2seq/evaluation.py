"""LAMBADA for encoder-decoder models, scored as lm-evaluation-harness 0.4.13's `hf` model (`backend=seq2seq`)
scores them: its figures equal lm-eval's own on the same model and passages (tests/test_lm_eval.py runs both).

A passage is split as for decoder-only models: context = all but the last space-separated word, target = ' ' + that
word. The context is encoded WITH the tokenizer's special tokens and goes to the encoder (T5: `... </s>`; BART:
`<s> ... </s>`; mBART-50: `en_XX ... </s>`, its source language code first). The target is encoded WITHOUT special
tokens (lm-eval's `_encode_pair`: `add_special_tokens=False`), and those tokens are the decoder's labels,
teacher-forced: the decoder reads the inputs the model's own forward builds from labels (the start token, then the
labels shifted right; mBART's forward wraps the last label to the front instead, see
`FamilyHooks.decoder_input_ids`). So exactly the target word's tokens are scored: no `</s>`, `<s>` or language code.
Both sides are cut from the left to the model's positions.

What each column of `accuracy` scores for these models:

- lm-eval acc: share of passages whose every target token is the argmax; lm-eval ppl: exp(-mean over passages of
  the target's summed natural-log likelihood), per passage, not per token;
- top-1 / top-N / top-10: share of the target's tokens that are among the N highest logits at their position (NVIDIA's
  demo defines its TopN for decoder-only models only; this is the same count over the target word's tokens);
- token ppl: exp(mean over passages of the target's mean negative log-likelihood per token, each clipped at 12 as
  NVIDIA clips it), capped at 1e5; there is no sequence ppl (`--tokens-to-generate` does not apply).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from nndf.batching import length_groups, pad_right
from nndf.errors import UsageError
from nndf.evaluation import (MAX_LOG_PPL, MAX_PPL, FidelityMetrics, LambadaMetrics, check_lambada_settings,
                             lm_eval_pair, shared_reference_fidelities)
from nndf.loglikelihood import score

# (encoder ids (B, S), encoder mask (B, S), decoder ids (B, T)), each padded on the right -> logits (B, T, V)
Seq2SeqLogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# target (label) ids -> the decoder's teacher-forced input ids, as long as the target
DecoderInputsFn = Callable[[list[int]], list[int]]


def encode_pair(tokenizer, text: str, max_positions: int) -> tuple[list[int], list[int]]:
    """(encoder ids, target ids) of a passage as lm-eval's seq2seq `_encode_pair` builds them, each cut from the
    left to `max_positions` as its `hf` model cuts them."""
    context_ids, target_ids = lm_eval_pair(tokenizer, text, separately=True)
    if not target_ids:
        raise UsageError(f"passage {text[:40]!r} gives an empty target word; pass LAMBADA-style passages")
    return context_ids[-max_positions:], target_ids[-max_positions:]


def pair_groups(pairs: Sequence[tuple[list[int], list[int]]], batch_size: int, max_batch_tokens: int | None):
    """Batches (indices) of (encoder ids, target ids) pairs whose encoder and target lengths are equal
    (`nndf.batching`: the figures of one pair at a time)."""
    return length_groups([(len(c), len(t)) for c, t in pairs], batch_size, max_batch_tokens)


def pair_logits(logits_fn: Seq2SeqLogitsFn, pairs: Sequence[tuple[list[int], list[int]]], group: list[int],
                decoder_inputs: DecoderInputsFn) -> list[torch.Tensor]:
    """The float32 logits (T, V) of the pairs of one batch (`group`), T = each target's length, in the group's
    order."""
    context_ids, context_mask = pad_right([pairs[i][0] for i in group])
    decoder_ids, _ = pad_right([decoder_inputs(pairs[i][1]) for i in group])
    with torch.no_grad():
        out = torch.as_tensor(logits_fn(context_ids, context_mask, decoder_ids))
    out = out.detach().to(device="cpu", dtype=torch.float32)
    return [out[row, : len(pairs[index][1])] for row, index in enumerate(group)]


def teacher_forced_logits(logits_fn: Seq2SeqLogitsFn, pairs: Sequence[tuple[list[int], list[int]]],
                          decoder_inputs: DecoderInputsFn, batch_size: int, max_batch_tokens: int | None):
    """(index, logits (T, V)) for every (encoder ids, target ids) pair, batch by batch (`pair_groups`)."""
    for group in pair_groups(pairs, batch_size, max_batch_tokens):
        yield from zip(group, pair_logits(logits_fn, pairs, group, decoder_inputs))


def seq2seq_scores(logits_fn: Seq2SeqLogitsFn, pairs: Sequence[tuple[list[int], list[int]]],
                   decoder_inputs: DecoderInputsFn, *, batch_size: int = 1, max_batch_tokens: int | None = None,
                   progress: bool = True) -> list[tuple[float, bool]]:
    """(summed log-likelihood, all greedy) of every (encoder ids, target ids) pair, in the pairs' order."""
    if any(not target for _, target in pairs):
        raise UsageError("a loglikelihood request has an empty continuation; there is nothing to score")
    scores: list = [None] * len(pairs)
    with tqdm(total=len(pairs), desc="loglikelihood", unit="request", file=sys.stderr, disable=not progress) as bar:
        for index, logits in teacher_forced_logits(logits_fn, pairs, decoder_inputs, batch_size, max_batch_tokens):
            scores[index] = score(logits, pairs[index][1])
            bar.update(1)
    return scores


def evaluate_lambada_seq2seq(texts: Sequence[str], tokenizer, logits_fn: Seq2SeqLogitsFn, *,
                             decoder_inputs: DecoderInputsFn, top_n: int = 5, max_positions: int,
                             progress: bool = True, batch_size: int = 1,
                             max_batch_tokens: int | None = None) -> LambadaMetrics:
    """Every metric of `LambadaMetrics` over the target word's tokens (see the module docstring)."""
    check_lambada_settings(1, top_n)
    if not texts:
        raise UsageError("there are no LAMBADA passages to evaluate; pass a dataset with at least one passage")
    top_ns = tuple(dict.fromkeys((1, top_n, 10)))
    pairs = [encode_pair(tokenizer, text, max_positions) for text in texts]
    scores: list = [None] * len(pairs)
    with tqdm(total=len(pairs), desc="LAMBADA", unit="passage", file=sys.stderr, disable=not progress) as bar:
        for index, logits in teacher_forced_logits(logits_fn, pairs, decoder_inputs, batch_size, max_batch_tokens):
            expected = torch.tensor(pairs[index][1])[:, None]
            passage_hits = {n: int((logits.topk(min(n, logits.shape[-1]), dim=-1).indices == expected)
                                   .any(dim=-1).sum()) for n in top_ns}
            scores[index] = (*score(logits, pairs[index][1]), passage_hits)
            bar.update(1)
    hits = dict.fromkeys(top_ns, 0)
    tokens = greedy_count = 0
    logliks: list[float] = []
    token_log_ppls: list[float] = []
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


def logit_fidelities_seq2seq(texts: Sequence[str], tokenizer, reference_fn: Seq2SeqLogitsFn,
                             candidate_fns: Sequence[Seq2SeqLogitsFn], *, decoder_inputs: DecoderInputsFn,
                             max_positions: int, progress: bool = True, batch_size: int = 1,
                             max_batch_tokens: int | None = None) -> list[FidelityMetrics]:
    """Top-1 agreement and mean KL(reference || candidate) of each candidate over the teacher-forced target
    positions, the reference run once for all of them (`nndf.evaluation.shared_reference_fidelities`)."""
    pairs = [encode_pair(tokenizer, text, max_positions) for text in texts]

    def rows_of(logits_fn: Seq2SeqLogitsFn):
        return lambda group: pair_logits(logits_fn, pairs, group, decoder_inputs)

    return shared_reference_fidelities(pair_groups(pairs, batch_size, max_batch_tokens), rows_of(reference_fn),
                                       [rows_of(fn) for fn in candidate_fns], rows=len(pairs), passages=len(texts),
                                       progress=progress)
