"""The KV cache of the onnxrt backend as ONNX Runtime sees it, and the IO binding of a shared-buffer generation.

`PresentCache` (growing layout) feeds each step's presents back as the next step's pasts; `SharedBufferCache`
(shared layout) keeps one whole-length buffer per past that the graph writes in place. `SharedStep` is why the shared
layout's step costs the host little: the 48 past/present bindings of GPT-2 are made once per generation, not once
per step, and the last position's logits land in a buffer made once, so a decode step binds four small inputs and
reads no output back through ONNX Runtime's Python objects. That matters because the host's work between two
steps runs on cold caches (the step has just streamed every weight through them): `OrtSession.run`'s generic
binding and `get_outputs` took about 0.3 ms per GPT-2 step there against 30 us in a warm loop (`bench/onnxrt_io.py`
measures the host's share).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from nndf.backends.ort_runtime import ort_module
from nndf.export.screened_head import CANDIDATES
from nndf.kvcache import KINDS, past_name, present_name


def as_numpy(value):
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and not value.requires_grad:
            return value.numpy()  # a view; detach() and cpu() would each make a new tensor object per step
        return value.detach().cpu().numpy()
    return value


class PresentCache:
    """The cache as the runtime returned it: each step's presents are fed back as the next step's pasts."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype=np.float32) -> None:
        self.empty = np.zeros((rows, kv_heads, 0, head_dim), dtype=dtype)
        self.values = {past_name(i, k): self.empty for i in range(num_layers) for k in KINDS}
        self.num_layers = num_layers
        self.max_len = max_len
        self.length = 0

    def restart(self) -> None:
        """Hold no positions again: the next step feeds the whole sequence."""
        self.values = {name: self.empty for name in self.values}
        self.length = 0

    def past_feeds(self) -> dict:
        return dict(self.values)

    def store(self, outputs: Mapping[str, object], new_length: int) -> None:
        for layer in range(self.num_layers):
            for kind in KINDS:
                self.values[past_name(layer, kind)] = outputs[present_name(layer, kind)]
        self.length = new_length

    def reorder(self, row_index: torch.Tensor) -> None:
        index = row_index.cpu().numpy()
        for name, value in self.values.items():
            array = value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else value
            self.values[name] = np.ascontiguousarray(np.take(array, index, axis=0))


class SharedBufferCache:
    """Whole-length buffers, (rows, kv_heads, max_len, head_dim) per past, that the graph writes in place.

    `past_feeds` hands out OrtValues over the buffers (made once); the session binds each present output to its
    past's OrtValue, so a step's presents are these buffers and `store` only counts positions. The buffers are
    not zeroed: the attention reads only the positions the mask covers."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype=np.float32) -> None:
        ort = ort_module()
        shape = (rows, kv_heads, max_len, head_dim)
        self.arrays = {past_name(i, k): np.empty(shape, dtype=dtype) for i in range(num_layers) for k in KINDS}
        self.values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self.arrays.items()}
        self.num_layers = num_layers
        self.max_len = max_len
        self.length = 0
        self.step: SharedStep | None = None  # the binding of this cache's steps, made by the session at the first
        self.reads_candidates = False  # whether that binding fetches a screened head's candidates (the loop reads them)

    def restart(self) -> None:
        """Hold no positions again: the next step feeds the whole sequence and writes it from the start."""
        self.length = 0

    def past_feeds(self) -> dict:
        return dict(self.values)

    def store(self, outputs: Mapping[str, object], new_length: int) -> None:
        if new_length > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, a step produced {new_length}")
        self.length = new_length

    def reorder(self, row_index: torch.Tensor) -> None:
        """Row r takes what row `row_index[r]` held, in place, over the filled positions only."""
        index = row_index.cpu()
        for array in self.arrays.values():
            filled = torch.from_numpy(array)[:, :, : self.length]
            filled.copy_(filled.index_select(0, index))


class SharedStep:
    """The IO binding of one `SharedBufferCache` (so of one generation): pasts and presents bound once, the small inputs
    rebound each step, and the last position's logits written into a buffer of this binding's own.

    The logits a step returns for one position per row are a view of that buffer: valid until this cache's next
    step, which overwrites them (every loop reads a step's logits before running the next). Logits of several
    positions (scoring a sequence) come from ONNX Runtime's own allocation, as in the generic path. A screened
    head's candidates (`nndf.export.screened_head.CANDIDATES`), of a size that changes from step to step, come
    from ONNX Runtime's allocation too, as a function that reads them (valid until the next step)."""

    def __init__(self, session, pasts: Mapping[str, object], shared_presents: Mapping[str, str],
                 candidates: bool = False) -> None:
        """`pasts`: the cache's OrtValue per past input; `shared_presents`: present output -> its past's name;
        `candidates`: whether the graph gives the screened head's candidates."""
        self.binding = session.io_binding()  # it holds the OrtValues, so the cache's buffers, as long as it lives
        self.binding.bind_output("logits", "cpu")  # bound first, so that get_outputs()[0] is the logits
        for present, past in shared_presents.items():
            self.binding.bind_ortvalue_input(past, pasts[past])
            self.binding.bind_ortvalue_output(present, pasts[past])
        self.candidates = candidates
        if candidates:  # bound last, where rebinding keeps it: get_outputs()[-1]
            self.binding.bind_output(CANDIDATES, "cpu")
        self.pasts = frozenset(shared_presents.values())
        # The value each small input was last bound to, kept alive with its memory: a step that feeds the very same
        # tensor again (a decode step's logits_to_keep, an encoder's fixed inputs) keeps the binding, one bind less.
        # Fed values are never written in place (the loop makes new tensors), so the same object means same data.
        self.bound: dict[str, object] = {}
        self.logits: tuple | None = None  # (OrtValue, torch view) over the one-position logits buffer
        self.logits_bound = False  # whether that buffer is the bound output now (a binding keeps its outputs)

    def run(self, session, feeds: Mapping[str, object]) -> dict:
        """The step's logits (and, where the graph gives them, a function that reads the screened head's
        candidates)."""
        binding = self.binding
        bound = self.bound
        for name, value in feeds.items():
            if name not in self.pasts and bound.get(name) is not value:
                binding.bind_cpu_input(name, np.ascontiguousarray(as_numpy(value)))
                bound[name] = value
        if self.candidates:  # of another size each step: ONNX Runtime allocates them anew, where the binding
            binding.bind_output(CANDIDATES, "cpu")  # would otherwise keep the last step's
        keep = feeds.get("logits_to_keep")
        one_position = keep is not None and len(keep) == 1
        if one_position and self.logits is not None:
            if not self.logits_bound:
                binding.bind_ortvalue_output("logits", self.logits[0])
                self.logits_bound = True
            session.run_with_iobinding(binding)
            return self._outputs(self.logits[1])
        self.logits_bound = False
        binding.bind_output("logits", "cpu")
        session.run_with_iobinding(binding)
        logits = self._output_values()[0].numpy()  # bound first
        if one_position:  # the shape every later step's logits have: give them a buffer of their own
            buffer = np.empty_like(logits)
            self.logits = (ort_module().OrtValue.ortvalue_from_numpy(buffer), torch.from_numpy(buffer))
        return self._outputs(torch.from_numpy(logits))

    def _outputs(self, logits: torch.Tensor) -> dict:
        if not self.candidates:
            return {"logits": logits}
        return {"logits": logits, CANDIDATES: self._read_candidates}  # read only if a draw asks, before the next run

    def _read_candidates(self) -> np.ndarray:
        """The last run's candidates. Reading them costs 60-70 us a step right after a step (greedy search does
        not need them); IOBinding.get_outputs would add 0.12-0.18 ms more, wrapping every output in a Python OrtValue
        (GPT-2: 26 with the presents), where the vector of ONNX Runtime's own values beneath it gives the one."""
        outputs = self._output_values()
        return outputs[len(outputs) - 1].numpy()

    def _output_values(self):
        """The last run's outputs as ONNX Runtime's own vector of values, in binding order, without the Python
        OrtValue the public `IOBinding.get_outputs` wraps each of them in (GPT-2: 26 with the presents, of which a
        caller reads one)."""
        return getattr(self.binding, "_iobinding", self.binding).get_outputs()
