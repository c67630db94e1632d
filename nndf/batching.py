"""Forward passes over a data set in batches: which sequences go together, and how they are laid out.

Scoring LAMBADA one passage per forward pass leaves a model idle between small calls. Only sequences of the same
length share a batch: padding would be harmless in exact arithmetic (a causal model's real positions never see pad
tokens after them, and a mask keeps them out of an encoder), but it lengthens the attention's reductions and so
moves the last bits of every logit (4e-5 on the shared tiny GPT-2), and a data set's figures must not depend on how
it was batched. Rows of one length run through the same kernels as one row does (measured bit-identical with
PyTorch and ONNX Runtime on the CPU), and LAMBADA's passages fall into few lengths (1000 of them into 63 lengths of
GPT-2 tokens), so batches stay full.

Callers score each batch's rows and drop the logits before the next batch: a data set's logits do not fit in memory
(1000 passages x 82 tokens x GPT-2's 50257-word vocabulary are 16 GB of float32), and `token_budget` bounds one
batch's logits the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from nndf.errors import HarnessError, UsageError

# (input ids (B, T), attention mask (B, T), right-padded) -> float logits (B, T, V)
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Logits of one batch are kept under this many bytes (the batch gets fewer rows when its sequences are long).
LOGITS_BUDGET_BYTES = 1 << 30


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {batch_size}")


def token_budget(vocab_size: int, bytes_per_value: int = 4, budget_bytes: int = LOGITS_BUDGET_BYTES) -> int:
    """How many token positions of logits over `vocab_size` words fit in `budget_bytes` (at least 1)."""
    return max(1, budget_bytes // (max(1, vocab_size) * bytes_per_value))


def length_groups(lengths: Sequence[int | tuple[int, ...]], batch_size: int,
                  max_tokens: int | None = None) -> Iterator[list[int]]:
    """Indices of `lengths` in groups of equal length (a tuple: every part equal, as an encoder-decoder pair's),
    longest first, at most `batch_size` rows and `max_tokens` positions (rows x longest part) each; a single
    sequence longer than `max_tokens` still gets a group of its own."""
    check_batch_size(batch_size)

    def size(length) -> int:
        return max(length) if isinstance(length, tuple) else length

    order = sorted(range(len(lengths)), key=lambda i: (-size(lengths[i]), lengths[i]))
    group: list[int] = []
    for index in order:
        over_budget = max_tokens is not None and (len(group) + 1) * size(lengths[index]) > max_tokens
        full = len(group) == batch_size or over_budget
        if group and (lengths[group[0]] != lengths[index] or full):
            yield group
            group = []
        group.append(index)
    if group:
        yield group


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape (rows, longest): each sequence from position 0, `pad_id` and mask 0 after its end
    (`length_groups` gives sequences of one length, so the mask is all ones there; other callers may pad)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        ids[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
        mask[row, : len(tokens)] = 1
    return ids, mask


def batch_logits(logits_fn: LogitsFn, sequences: Sequence[Sequence[int]],
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
    """(index, logits) for every sequence, computed in batches of one length (`length_groups`)."""
    for group in length_groups([len(s) for s in sequences], batch_size, max_tokens):
        yield from zip(group, batch_logits(logits_fn, [sequences[i] for i in group], dtype))
