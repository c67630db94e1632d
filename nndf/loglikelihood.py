"""lm-evaluation-harness's loglikelihood requests without lm-eval: how a (context, continuation) pair becomes token
ids, and how its score comes out of logits.

`accuracy` prints lm-eval's `lambada_openai` figures on machines without lm-eval installed, and `nndf.lm_eval`
(the lm-eval model class) scores any task's requests; both need the same encoding, checked against lm-eval 0.4.13's
own `hf` model by running it (tests/test_lm_eval.py), not only by reading its code:

- a string is encoded as `HFLM.tok_encode` encodes it: `tokenizer.encode(text)` with the tokenizer's own special
  tokens (GPT-2's tokenizer adds none, OPT's and Llama's prepend BOS, T5's appends `</s>`, BART's wraps in
  `<s> ... </s>`, mBART-50's adds its source language code and `</s>`), or none when the text already starts with the
  prefix token's text;
- a pair as `TemplateLM._encode_pair` does: trailing spaces of the context move to the continuation; a decoder-only
  model encodes context + continuation as one string and the continuation is what follows the context's own
  encoding (so a merge across the boundary counts as lm-eval counts it); an encoder-decoder model encodes the two
  apart, the continuation WITHOUT special tokens (no `</s>`, no `<s>`, no language code is scored);
- an empty context is the prefix token (BOS, else EOS), unless the continuation starts with it;
- a score is (summed natural-log likelihood of the continuation's tokens, every one of them the argmax), from
  float32 log-softmax as lm-eval computes it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from tqdm import tqdm

from nndf.batching import LogitsFn, batched_logits
from nndf.errors import UsageError


def prefix_token_id(tokenizer) -> int:
    """The token an empty context becomes (lm-eval's `prefix_token_id`): BOS, else EOS."""
    for token in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if token is not None:
            return int(token)
    raise UsageError("the tokenizer has neither a BOS nor an EOS token, so an empty context cannot be scored; "
                     "give a tokenizer with one (--tokenizer-dir)")


def encode(tokenizer, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """Token ids as lm-eval's `HFLM.tok_encode` gives them (None: the tokenizer's own special tokens)."""
    if add_special_tokens is None:
        start = getattr(tokenizer, "bos_token_id", None)
        if start is None:
            start = getattr(tokenizer, "eos_token_id", None)
        # lm-eval leaves special tokens out of a string that already starts with the prefix token's text
        if start is not None and text.startswith(tokenizer.decode([start])):
            add_special_tokens = False
    kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    return list(tokenizer.encode(text, **kwargs))


def encode_pair(tokenizer, context: str, continuation: str, *, separately: bool) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's `TemplateLM.loglikelihood` builds them; `separately`: as for an
    encoder-decoder model (lm-eval's seq2seq backend), else as for a decoder-only one."""
    if context == "":
        continuation_ids = encode(tokenizer, continuation, add_special_tokens=False)
        prefix = prefix_token_id(tokenizer)
        if continuation_ids and continuation_ids[0] == prefix:
            return continuation_ids[:1], continuation_ids[1:]
        return [prefix], continuation_ids
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    context_ids = encode(tokenizer, context)
    if separately:
        return context_ids, encode(tokenizer, continuation, add_special_tokens=False)
    whole = encode(tokenizer, context + continuation)
    return context_ids, whole[len(context_ids):]


def causal_window(context: Sequence[int], continuation: Sequence[int], max_positions: int) -> list[int]:
    """The one forward pass lm-eval runs for a decoder-only pair: context + continuation without its last token,
    cut from the left to the model's positions (its last `len(continuation)` logits predict the continuation)."""
    return [*context, *continuation][-(max_positions + 1):][:-1]


def score(logits: torch.Tensor | None, continuation: list[int]) -> tuple[float, bool]:
    """(summed log-likelihood, every continuation token is the argmax) from logits whose last rows predict
    `continuation`."""
    if not continuation:
        return 0.0, True
    rows = logits[-len(continuation):]
    target = torch.tensor(continuation, dtype=torch.long)
    logp = torch.log_softmax(rows, dim=-1)
    loglik = float(logp.gather(1, target[:, None]).sum())
    greedy = bool((rows.argmax(dim=-1) == target).all())
    return loglik, greedy


def causal_scores(logits_fn: LogitsFn, pairs: Sequence[tuple[list[int], list[int]]], *, max_positions: int,
                  batch_size: int = 1, max_batch_tokens: int | None = None,
                  progress: bool = True) -> list[tuple[float, bool]]:
    """`score` of every (context ids, continuation ids) pair of a decoder-only model, in the pairs' order, the
    forward passes batched as `nndf.batching` batches them (rows of one length: the figures of one pair at a time)."""
    windows = []
    for context, continuation in pairs:
        if not continuation:
            raise UsageError("a loglikelihood request has an empty continuation; there is nothing to score")
        if len(continuation) > max_positions:
            raise UsageError(f"a continuation of {len(continuation)} tokens exceeds the model's {max_positions} "
                             "positions")
        windows.append(causal_window(context, continuation, max_positions))
    scores: list = [None] * len(pairs)
    with tqdm(total=len(pairs), desc="loglikelihood", unit="request", file=sys.stderr, disable=not progress) as bar:
        for index, logits in batched_logits(logits_fn, windows, batch_size, max_batch_tokens):
            scores[index] = score(logits, pairs[index][1])
            bar.update(1)
    return scores
