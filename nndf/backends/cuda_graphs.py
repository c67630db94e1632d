"""Decode steps of a PyTorch module captured as CUDA graphs and replayed (`--cuda-graph` on `frameworks`).

A decode step of a small model is hundreds of small kernels; launched one by one from Python, the host is the
bottleneck (gpt2 on an H100: 7-8 ms per step eagerly for well under 1 ms of GPU work). Captured once as a CUDA
graph and replayed, the whole step is one launch. A graph replays fixed addresses, so it needs a step whose
inputs keep their shapes and memory from one token to the next: the static step of `nndf.export.wrapper`, whose
KV buffers are written in place at `past_length`.

One graph per input layout (shapes, strides, dtypes: in practice one per number of rows, and per encoder length for
an encoder-decoder model), through PyTorch's own `torch.cuda.CUDAGraph`:
- the first step of a layout runs eagerly (its result is the step's result), then one warm-up run on a side
  stream and the capture follow; a static step writes the same keys and values to the same positions again, so
  neither changes anything;
- inputs the caller keeps in place (the session's KV buffers, mask and length) are bound as they are; the others
  are copied into the graph's own tensors before each replay, except a tensor that is the very object copied at
  the previous step (the loop's fixed inputs: an encoder's mask, cross-attention keys and values, which it never
  writes to), so that the cross-attention inputs are copied once per generation, not once per step;
- outputs live at the graph's fixed addresses: the next replay overwrites them, so the loop reads a step's logits
  before it runs the next step (it does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from nndf.progress import say


# transformers before this version builds eager attention masks with `torch.tensor(0.0, device=...)`, a host copy no
# CUDA graph capture allows (BLOOM, BLIP): their steps fall back to eager there.
EAGER_MASKS_CAPTURABLE_SINCE = "5.21"


def eager_masks_copy_from_host() -> bool:
    """Whether the installed transformers builds eager attention masks with a host copy (see above)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(EAGER_MASKS_CAPTURABLE_SINCE)


def known_cause(exc: Exception) -> str:
    """What the user can do about a capture failure whose cause is known (else nothing)."""
    import transformers

    if "between CPU and CUDA tensors" in str(exc) and eager_masks_copy_from_host():
        return (f" (transformers {transformers.__version__} builds eager attention masks with a host copy, which "
                f"{EAGER_MASKS_CAPTURABLE_SINCE} and later do not: upgrade transformers)")
    return ""


@dataclass
class _Graph:
    graph: object
    inputs: list[torch.Tensor]  # the tensors the graph reads (bound ones are the caller's own)
    outputs: tuple[torch.Tensor, ...]
    last_sources: list = field(default_factory=list)  # what was copied into each input last (None: not copied)


class StepGraphs:
    """Captures and replays `step(*args)` per input layout. `bound` lists the argument positions whose tensors the
    caller keeps at fixed addresses and updates in place; every other argument is copied in."""

    def __init__(self, step: Callable[..., tuple], device: torch.device, bound: Sequence[int]) -> None:
        self.step = step
        self.device = torch.device(device)
        self.bound = frozenset(bound)
        self.enabled = self.device.type == "cuda"
        self._graphs: dict[tuple, _Graph] = {}

    @staticmethod
    def layout(args: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(a.shape), a.stride(), a.dtype) for a in args)

    def run(self, args: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One step: replayed when this layout was captured (and its bound tensors are the same), otherwise run
        eagerly and captured for the next steps."""
        if not self.enabled:
            return self.step(*args)
        key = self.layout(args)
        entry = self._graphs.get(key)
        if entry is not None and all(entry.inputs[i] is args[i] for i in self.bound):
            self._feed(entry, args)
            entry.graph.replay()
            return entry.outputs
        outputs = self.step(*args)
        try:
            self._graphs[key] = self._capture(args)
        except Exception as exc:  # a step that syncs with the host or allocates where a graph cannot
            say(f"warning: CUDA graph capture failed ({type(exc).__name__}: {exc}){known_cause(exc)}; running "
                "without CUDA graphs")
            self.enabled = False
            self._graphs.clear()
        return outputs

    def _feed(self, entry: _Graph, args: Sequence[torch.Tensor]) -> None:
        for i, value in enumerate(args):
            if i in self.bound or entry.last_sources[i] is value:
                continue
            entry.inputs[i].copy_(value)
            entry.last_sources[i] = value

    def _capture(self, args: Sequence[torch.Tensor]) -> _Graph:
        inputs = [a if i in self.bound else a.clone() for i, a in enumerate(args)]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            self.step(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.step(*inputs)
        sources = [None if i in self.bound else a for i, a in enumerate(args)]
        return _Graph(graph, inputs, tuple(outputs), sources)

    @property
    def captured(self) -> int:
        """How many graphs are held (one per layout seen)."""
        return len(self._graphs)
