"""A decoder-only model as a module with flat tensor inputs and outputs.

Hugging Face models take and return cache objects; ONNX graphs and TensorRT engines take and return plain named
tensors. This wrapper is the one bridge: positional inputs `input_ids, attention_mask, [position_ids,] past...`
and outputs `logits, present...`, in the order of `kvcache.past_names` / `present_names`. The frameworks backend
runs it step by step, and the ONNX exporter traces exactly the same module, so the two cannot drift apart.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from nndf.kvcache import KINDS, past_names, present_names


def accepts_position_ids(model: torch.nn.Module) -> bool:
    """Whether the model takes explicit position ids (models with ALiBi, for example, do not)."""
    return "position_ids" in inspect.signature(model.forward).parameters


class DecoderWrapper(torch.nn.Module):
    """`forward(input_ids, attention_mask, [position_ids], *past) -> (logits, *present)` over a causal LM."""

    def __init__(self, model: torch.nn.Module, num_layers: int, use_cache: bool) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.use_cache = use_cache
        self.with_position_ids = accepts_position_ids(model)
        self.eval()

    @property
    def input_names(self) -> tuple[str, ...]:
        names = ["input_ids", "attention_mask"] + (["position_ids"] if self.with_position_ids else [])
        return tuple(names + (past_names(self.num_layers) if self.use_cache else []))

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(["logits"] + (present_names(self.num_layers) if self.use_cache else []))

    def forward(self, input_ids, attention_mask, *rest):
        extra = {}
        if self.with_position_ids:
            extra["position_ids"], rest = rest[0], rest[1:]
        cache = None
        if self.use_cache:
            cache = DynamicCache(config=self.model.config)
            for layer in range(self.num_layers):
                cache.update(rest[2 * layer], rest[2 * layer + 1], layer)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=self.use_cache,
            **extra,
        )
        if not self.use_cache:
            return (out.logits,)
        present = out.past_key_values
        flat = []
        for layer in range(self.num_layers):
            flat.extend(getattr(present.layers[layer], kind + "s") for kind in KINDS)
        return (out.logits, *flat)
