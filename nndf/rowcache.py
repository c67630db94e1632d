"""The KV cache of a continuous batch: rows that join and leave between decode steps (`nndf.continuous`).

`nndf.kvcache` holds the cache of one generation, whose rows start together and share one length. A server's batch
does not: a request joins while others are halfway through, and leaves when it is done. Here every row is aligned
on the right, as `generate()` aligns a padded batch on the left: all rows end at the cache's `length` T, a row of L
positions holds [T - L, T) and its attention mask is 0 before them, so one decode step (one new column) serves
every row whatever its own length, and position ids come from the mask as for any padded batch.

- `admit` writes a request's prefilled keys and values (its own cache, from a step of batch 1) into a free row;
  when its prompt is longer than T, every row first moves right to make room.
- `retire` moves the last row into the freed one, so the rows in flight are always rows [0, n) of the buffers:
  a step feeds a view of them, and nothing is computed for free rows.
- `make_room` drops the columns that every row masks (the common left padding) or, if none, grows the buffers.

The buffers are PyTorch tensors, zeroed once (a freed row's stale keys are finite, so masking them is exact). For
a session that writes its cache in place (ONNX Runtime's shared layout: `in_place`), the step feeds the rows'
whole buffers and the graph writes column T itself; otherwise (growing layouts) it feeds the filled columns and
`store` copies the new column from the step's presents, as `KVCache.store` does.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from nndf.kvcache import KINDS, past_name, present_name

MIN_DROP = 16  # columns of common padding worth a copy of the cache to drop (see `RowCache.make_room`)


def _as_tensor(value) -> torch.Tensor:
    """A present output as a tensor: torch already, a numpy array, or an ONNX Runtime OrtValue."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(value if isinstance(value, np.ndarray) else value.numpy())


class RowCache:
    """Per-layer key and value buffers of shape (max_rows, kv_heads, capacity, head_dim); rows [0, rows) are in
    flight and every one ends at column `length`."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_rows: int, capacity: int,
                 max_capacity: int, in_place: bool, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.shape = (max_rows, kv_heads, capacity, head_dim)
        self.buffers = {past_name(i, k): torch.zeros(self.shape, dtype=dtype, device=device)
                        for i in range(num_layers) for k in KINDS}
        # The rows' attention mask over the same columns (1 where a row has a position), moved with the buffers.
        self.mask = torch.zeros((max_rows, capacity), dtype=torch.long, device=device)
        self.num_layers = num_layers
        self.max_capacity = max_capacity
        self.in_place = in_place
        self.rows = 0
        self.length = 0
        self.starts: list[int] = []  # the first column each row's positions occupy

    @property
    def capacity(self) -> int:
        return self.shape[2]

    @property
    def max_rows(self) -> int:
        return self.shape[0]

    def past_feeds(self) -> dict[str, torch.Tensor]:
        if self.in_place:  # whole rows: the graph writes the new column at `length` itself
            return {name: buf[: self.rows] for name, buf in self.buffers.items()}
        return {name: buf[: self.rows, :, : self.length] for name, buf in self.buffers.items()}

    def store(self, outputs: Mapping[str, object], new_length: int) -> None:
        if new_length > self.capacity:
            raise ValueError(f"the batch's KV cache holds {self.capacity} positions, a step produced {new_length}")
        if not self.in_place:
            for layer in range(self.num_layers):
                for kind in KINDS:
                    present = _as_tensor(outputs[present_name(layer, kind)])
                    self.buffers[past_name(layer, kind)][: self.rows, :, self.length : new_length].copy_(
                        present[:, :, self.length : new_length])
        self.length = new_length

    def restart(self) -> None:
        raise RuntimeError("a continuous batch's cache cannot restart (its rows started at different steps)")

    def admit(self, pasts: Mapping[str, torch.Tensor], prompt_len: int) -> int:
        """Copy one request's `prompt_len` cached positions ((1, kv_heads, >= prompt_len, head_dim) per past) into a
        new row, ending at `length`; returns the row."""
        if self.rows == self.max_rows:
            raise RuntimeError(f"the batch is full ({self.max_rows} rows)")
        if self.rows == 0:
            self.length = 0
            self.starts = []
        if prompt_len > self.length:
            self._shift(prompt_len - self.length)
        row, end = self.rows, self.length
        for name, buf in self.buffers.items():
            buf[row, :, end - prompt_len : end].copy_(_as_tensor(pasts[name])[0, :, :prompt_len])
        self.mask[row].zero_()
        self.mask[row, end - prompt_len : end] = 1
        self.rows += 1
        self.starts.append(end - prompt_len)
        return row

    def retire(self, row: int) -> int | None:
        """Free `row`; the last row moves into it. Returns the row that moved (its old index), or None."""
        last = self.rows - 1
        moved = None
        if row != last:
            for buf in self._all():
                _at(buf, row, slice(0, self.length)).copy_(_at(buf, last, slice(0, self.length)))
            self.starts[row] = self.starts[last]
            moved = last
        self.starts.pop()
        self.rows -= 1
        if self.rows == 0:
            self.length = 0
        return moved

    def padding(self) -> int:
        """Columns that every row masks (the common left padding)."""
        return min(self.starts) if self.starts else self.length

    def make_room(self, columns: int) -> None:
        """Make `length + columns` fit: drop the common left padding when that is enough, else grow the buffers.

        Padding is also dropped once it is half the length (at least `MIN_DROP` columns): every step attends over
        it, and a long-lived batch would otherwise drag the columns of rows long gone."""
        needed = self.length + columns
        drop = self.padding()
        if drop >= max(MIN_DROP, self.length // 2):
            self._shift(-drop)
            needed -= drop
        if needed <= self.capacity:
            return
        drop = self.padding()
        if drop and needed - drop <= self.capacity:
            self._shift(-drop)
            return
        if needed > self.max_capacity:
            raise RuntimeError(f"the batch needs {needed} positions, more than the {self.max_capacity} allowed")
        self._grow(min(self.max_capacity, max(needed, 2 * self.capacity)))

    def _shift(self, by: int) -> None:
        """Move every row `by` columns right (> 0, growing the buffers if needed) or left (< 0)."""
        if by > 0 and self.length + by > self.capacity:
            if self.length + by > self.max_capacity:
                raise RuntimeError(f"the batch needs {self.length + by} positions, more than the "
                                   f"{self.max_capacity} allowed")
            self._grow(min(self.max_capacity, max(self.length + by, 2 * self.capacity)))
        rows = slice(0, self.rows)
        length = self.length
        for buf in self._all():
            if by > 0:
                _at(buf, rows, slice(by, length + by)).copy_(_at(buf, rows, slice(0, length)).clone())
            else:
                _at(buf, rows, slice(0, length + by)).copy_(_at(buf, rows, slice(-by, length)).clone())
            if by > 0:  # the columns the rows left: no row has a position there
                _at(buf, rows, slice(0, by)).zero_()
        self.length += by
        self.starts = [start + by for start in self.starts]

    def _grow(self, capacity: int) -> None:
        rows, length = slice(0, self.rows), slice(0, self.length)
        self.shape = (self.shape[0], self.shape[1], capacity, self.shape[3])
        for name, buf in self.buffers.items():
            bigger = torch.zeros(self.shape, dtype=buf.dtype, device=buf.device)
            _at(bigger, rows, length).copy_(_at(buf, rows, length))
            self.buffers[name] = bigger
        mask = torch.zeros((self.shape[0], capacity), dtype=self.mask.dtype, device=self.mask.device)
        mask[rows, length] = self.mask[rows, length]
        self.mask = mask

    def _all(self):
        return [*self.buffers.values(), self.mask]


def _at(buf: torch.Tensor, rows, columns) -> torch.Tensor:
    """The view of `rows` x `columns` of a key/value buffer (rows, heads, columns, head_dim) or of the mask."""
    return buf[rows, :, columns] if buf.dim() == 4 else buf[rows, columns]
