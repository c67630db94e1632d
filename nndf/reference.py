"""The PyTorch reference that other backends are judged against, and the seeded inputs it is judged on.

`Model.reference_logits`, the architectures' fp16-check hooks and the trt backend's fp16 check all score a PyTorch
model the same way and feed it the same seeded prompts; they live here, below all of them, so that none of those
modules has to import another for it.
"""

from __future__ import annotations

import torch


def pytorch_logits(model: torch.nn.Module, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """A PyTorch model's float logits (on the CPU) for what `Model.logits` scores: every position of `input_ids`,
    or of `decoder_input_ids` (teacher-forced) given `input_ids` on an encoder-decoder model's encoder."""
    device = next(model.parameters()).device
    extra = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids.to(device)}
    if attention_mask is not None:
        extra["attention_mask"] = attention_mask.to(device)
    with torch.inference_mode():
        return model(input_ids.to(device), **extra).logits.float().cpu()


def seeded_prompts(rows: int, limit: int, vocab: int, lengths=(8, 16, 32), seed: int = 0) -> list[torch.Tensor]:
    """Seeded random token ids (rows, n), one batch per length in `lengths` capped at `limit`, shortest first."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rows, n), generator=generator) for n in sorted({min(n, limit) for n in lengths})]
