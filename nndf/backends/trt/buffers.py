"""The memory the runner binds: staging buffers for inputs and outputs, and the KV cache, at stable addresses.

- `Staging`: inputs are copied into preallocated buffers, cast to the dtype the engine declares (int64 ids become
  int32 for an engine that wants int32); buffers only grow, so their addresses stay put (CUDA graphs need that).
- `PingPongCache`: the KV cache as two preallocated max-length buffers per tensor, used alternately. The engine
  writes each layer's present (rows, heads, L+T, head dim) contiguously into the buffer we bind; the next step
  reads that same memory as its past (shape L+T) while its present goes to the other buffer. No copy, no
  allocation per step; beam reorder is an `index_select` into the other buffer.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from nndf.errors import HarnessError
from nndf.kvcache import KINDS, past_name, present_name


class Staging:
    """One growing flat buffer per tensor name; `view` gives a tensor of the requested shape at its start.

    Buffers grow geometrically and are never shrunk, so after the first steps of a generation their addresses no
    longer change (CUDA graph replays depend on that) and no step allocates.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < max(count, 1):
            size = max(count, 1, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            with torch.inference_mode(False):  # a normal tensor: written in and outside inference mode alike
                buf = torch.empty(size, dtype=dtype, device=self.device)
            self.buffers[name] = buf
        return buf[:count].view(shape)

    def stage(self, name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Copy `value` in, cast to `dtype` (int64 ids to an int32 engine input, say)."""
        target = self.view(name, tuple(value.shape), dtype)
        target.copy_(value)
        return target


ALIGNMENT = 256  # bytes: TensorRT wants every bound address 256-byte aligned (NvInferRuntime.h, setTensorAddress)


def aligned_count(count: int, dtype: torch.dtype) -> int:
    """`count` elements of `dtype` rounded up to a whole number of ALIGNMENT bytes, so that buffers laid end to end
    in one allocation (whose start PyTorch's CUDA allocator aligns to 512 bytes) each start aligned."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block = ALIGNMENT // math.gcd(ALIGNMENT, itemsize)
    return max(-(-count // per_block) * per_block, per_block)


class PingPongCache:
    """KV cache for engines: two max-length buffers per past tensor, read and written alternately.

    Same interface as `nndf.kvcache.KVCache` (`length`, `past_feeds`, `store`, `reorder`) plus `present_targets`,
    the views the engine writes its presents into. A present (rows, heads, L+T, head dim) is written contiguously
    at the start of the spare buffer, which is exactly the layout of the next step's past of length L+T: `store`
    then only flips which buffer is current.
    """

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 storage: torch.Tensor | None = None) -> None:
        self.num_layers = num_layers
        self.names = [past_name(layer, kind) for layer in range(num_layers) for kind in KINDS]
        self.present_names = [present_name(layer, kind) for layer in range(num_layers) for kind in KINDS]
        self._dims = (rows, kv_heads, head_dim)
        self.max_len = max_len
        needed = aligned_count(rows * kv_heads * max_len * head_dim, dtype)
        device = torch.device(device)
        if (storage is None or storage.dtype != dtype or storage.device != device
                or storage.shape[1] != len(self.names) or storage.shape[2] < max(needed, 1)):
            with torch.inference_mode(False):  # a normal tensor: written in and outside inference mode alike
                storage = torch.zeros((2, len(self.names), max(needed, 1)), dtype=dtype, device=device)
        self.storage = storage
        self.current = 0
        self.length = 0

    @property
    def rows(self) -> int:
        return self._dims[0]

    def _view(self, side: int, index: int, length: int) -> torch.Tensor:
        rows, heads, head_dim = self._dims
        return self.storage[side, index, : rows * heads * length * head_dim].view(rows, heads, length, head_dim)

    def past_feeds(self) -> dict[str, torch.Tensor]:
        """The filled positions, keyed by past input names (length 0 before the prompt)."""
        return {name: self._view(self.current, i, self.length) for i, name in enumerate(self.names)}

    def owns(self, feeds: Mapping[str, torch.Tensor]) -> bool:
        """Whether `feeds` hold this cache's current pasts (so presents can be written into its spare buffer)."""
        first = feeds.get(self.names[0]) if self.names else None
        # Compared by storage and offset: an empty view (the first step's past) has no data pointer of its own.
        return (first is not None and first.shape[2] == self.length
                and first.untyped_storage().data_ptr() == self.storage.untyped_storage().data_ptr()
                and first.storage_offset() == self.storage[self.current, 0].storage_offset())

    def present_targets(self, new_length: int) -> dict[str, torch.Tensor]:
        """Where a step that ends at `new_length` positions writes its presents: the spare buffer."""
        if new_length > self.max_len:
            raise HarnessError(f"the KV cache holds {self.max_len} positions and a step needs {new_length}")
        spare = 1 - self.current
        return {name: self._view(spare, i, new_length) for i, name in enumerate(self.present_names)}

    def store(self, outputs: Mapping[str, torch.Tensor], new_length: int) -> None:
        """Make the step's presents (now `new_length` positions) the current pasts. When the engine wrote them
        into `present_targets` (the normal case) this only flips buffers; presents from anywhere else are copied."""
        targets = self.present_targets(new_length)
        for name, target in targets.items():
            present = outputs[name]
            if present.data_ptr() != target.data_ptr() or present.shape != target.shape:
                target.copy_(present)
        self.current = 1 - self.current
        self.length = new_length

    def restart(self) -> None:
        """Hold no positions again: the next step feeds the whole sequence and writes it from the start."""
        self.length = 0

    def reorder(self, row_index: torch.Tensor) -> None:
        """Row r takes what row `row_index[r]` held (beam search); gathered into the spare buffer, then flipped."""
        index = row_index.to(self.storage.device)
        spare = 1 - self.current
        for i in range(len(self.names)):
            torch.index_select(self._view(self.current, i, self.length), 0, index,
                               out=self._view(spare, i, self.length))
        self.current = spare


def tensor_address(tensor: torch.Tensor, fallback: torch.Tensor) -> int:
    """A tensor's device address; an empty tensor may have none, and TensorRT wants a valid one even then."""
    address = tensor.data_ptr()
    return address if address or tensor.numel() else fallback.data_ptr()
