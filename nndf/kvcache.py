"""Preallocated key/value cache buffers, filled in place and reordered in place for beam search.

As in gpt-fast, the buffers are allocated once at the largest length a generation can reach, so a decode step
allocates no cache memory of its own; sessions read views of the filled part (`past_key_values.{i}.key|value`)
and return the new positions in their `present.{i}.key|value` outputs, which `store` copies into place.
"""

from __future__ import annotations

from typing import Mapping

import torch

KINDS = ("key", "value")
PAST_LENGTH = "past_length"  # a static step's extra input: how many positions its buffers hold (0-d int64)


def past_name(layer: int, kind: str) -> str:
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    return f"present.{layer}.{kind}"


def past_names(num_layers: int) -> list[str]:
    return [past_name(i, k) for i in range(num_layers) for k in KINDS]


def present_names(num_layers: int) -> list[str]:
    return [present_name(i, k) for i in range(num_layers) for k in KINDS]


class KVCache:
    """Per-layer key and value buffers of shape (rows, kv_heads, max_len, head_dim); `length` positions are valid."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (rows, kv_heads, max_len, head_dim)
        self.buffers = {
            name: torch.zeros(shape, dtype=dtype, device=device) for name in past_names(num_layers)
        }
        self.num_layers = num_layers
        self.max_len = max_len
        self.length = 0

    @property
    def rows(self) -> int:
        return next(iter(self.buffers.values())).shape[0]

    def past_feeds(self) -> dict[str, torch.Tensor]:
        """Views of the filled positions, keyed by the sessions' past input names (length 0 before prefill)."""
        return {name: buf[:, :, : self.length] for name, buf in self.buffers.items()}

    def store(self, outputs: Mapping[str, torch.Tensor], new_length: int) -> None:
        """Copy the positions a step added from its `present.*` outputs into the buffers; the cache then holds
        `new_length` positions (the loop's tokens so far).

        A present holds past and new positions together (as attention concatenates them); only the new tail is
        copied, so the cost of a step is independent of how long the sequence already is.
        """
        if new_length > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, a step produced {new_length}")
        for layer in range(self.num_layers):
            for kind in KINDS:
                present = outputs[present_name(layer, kind)]
                self.buffers[past_name(layer, kind)][:, :, self.length : new_length].copy_(
                    present[:, :, self.length : new_length]
                )
        self.length = new_length

    def restart(self) -> None:
        """Hold no positions again: the next step feeds the whole sequence and writes it from the start."""
        self.length = 0

    def reorder(self, row_index: torch.Tensor) -> None:
        """Make row r hold what row `row_index[r]` held (beam search keeps the cache of the beams it continues)."""
        for buf in self.buffers.values():
            filled = buf[:, :, : self.length]
            filled.copy_(filled.index_select(0, row_index.to(buf.device)))


class StaticKVCache(KVCache):
    """Buffers that a static step writes into itself (`nndf.export.wrapper`'s static step, the frameworks backend
    on CUDA): fed whole, with the number of filled positions as a 0-d tensor on their device, so that every decode
    step has the same shapes and addresses (what CUDA graphs replay). `store` only advances the count.

    The buffers belong to the session (one set per number of rows, reused by every generation), so a cache is a
    view of them for one generation at a time.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], num_layers: int, past_length: torch.Tensor) -> None:
        self.buffers = buffers
        self.num_layers = num_layers
        self.max_len = next(iter(buffers.values())).shape[2]
        self.past_length = past_length
        self.length = 0

    def past_feeds(self) -> dict[str, torch.Tensor]:
        """The whole buffers and `past_length` (set on the device without a host synchronisation)."""
        self.past_length.fill_(self.length)
        return {**self.buffers, PAST_LENGTH: self.past_length}

    def store(self, outputs: Mapping[str, torch.Tensor], new_length: int) -> None:
        if new_length > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, a step produced {new_length}")
        self.length = new_length


class GrowingKVCache:
    """The cache as PyTorch's attention leaves it, as in `generate()`'s DynamicCache: each step's presents (the model
    concatenates past and new positions) become the next step's pasts as they are, so a step copies nothing more
    (the frameworks backend over the dynamic cache, on the CPU)."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.empty = torch.zeros((rows, kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.tensors = {name: self.empty for name in past_names(num_layers)}
        self.num_layers = num_layers
        self.max_len = max_len
        self.length = 0

    def restart(self) -> None:
        """Hold no positions again: the next step feeds the whole sequence."""
        self.tensors = {name: self.empty for name in self.tensors}
        self.length = 0

    def past_feeds(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def store(self, outputs: Mapping[str, torch.Tensor], new_length: int) -> None:
        if new_length > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, a step produced {new_length}")
        self.tensors = {past_name(layer, kind): outputs[present_name(layer, kind)]
                        for layer in range(self.num_layers) for kind in KINDS}
        self.length = new_length

    def reorder(self, row_index: torch.Tensor) -> None:
        index = row_index.to(next(iter(self.tensors.values())).device)
        self.tensors = {name: tensor.index_select(0, index) for name, tensor in self.tensors.items()}
