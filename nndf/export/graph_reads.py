"""A cached ONNX graph that its reader cannot read: the export is rebuilt once, and a rebuilt one that still fails
is one sentence (`rebuilt_once`).

Why: reuse checks an export's settings and its files' sizes, not their bytes (hashing gigabytes of weights on every
run would cost as much as the load), so a file damaged in place at its recorded size passes; the first code that
reads it is the check. Three readers meet an export's graph: ONNX Runtime's session load (the onnxrt backend), the
int8/int4 quantizer (`nndf.export.quantize`, which reads the fp32 graph with its weights) and a TensorRT engine
build (`nndf.backends.trt`, which reads the graph before the build). Each raises `GraphLoadError` naming the graph
it could not read, and the backend that opens the graphs wraps its whole opening in `rebuilt_once`: one rule for
all of them, and the export is found damaged wherever it is first read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Collection, TypeVar

from nndf.errors import HarnessError
from nndf.progress import say

ORT_HINT = "that this onnxruntime runs what this torch exports"
ONNX_HINT = "that this onnx reads what this torch exports"


def first_line(exc: Exception, with_type: bool = False) -> str:
    """An exception's first line, without ONNX Runtime's "[ONNXRuntimeError] : 7 : INVALID_PROTOBUF :" prefix and
    its "Load model ... failed:" lead-in; `with_type` puts the type's name before it (for errors whose text alone,
    "scale issue", does not say what failed)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text).split("failed:", 1)[-1].strip().rstrip(".")
    if with_type or not text:
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text


class GraphLoadError(HarnessError):
    """A reader could not read a graph file (a damaged protobuf, damaged weights, a missing external data file): one
    sentence naming the file, with `reason` the reader's own words; `rebuilt_once` rebuilds a cached graph on it.

    `reader` and `failed` make the sentence ("ONNX Runtime could not load X", "onnx could not read X", "int8
    quantization failed on X"), `hint` what to check when a graph exported anew just now fails too."""

    def __init__(self, graph: Path, exc: Exception, reader: str = "ONNX Runtime", failed: str = "could not load",
                 hint: str = ORT_HINT, with_type: bool = False) -> None:
        self.graph, self.reason = Path(graph), first_line(exc, with_type)
        self.reader, self.failed, self.hint = reader, failed, hint
        super().__init__(f"{reader} {failed} {graph} ({self.reason})")


def read_graph(graph: Path, reader: str = "onnx"):
    """The ModelProto of `graph` without its weights (the protobuf alone: milliseconds, external data not read),
    or a GraphLoadError: the check a reader that would otherwise fail deep inside (TensorRT's parser) runs first."""
    import onnx

    try:
        return onnx.load(str(graph), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends: the file is not the graph it was
        raise GraphLoadError(graph, exc, reader, "could not read", ONNX_HINT, with_type=True) from exc


Opened = TypeVar("Opened")


def rebuilt_once(open_graphs: Callable[[], Opened], given: Collection[str | None] = ()) -> Opened:
    """`open_graphs()`, which exports (or reuses) graphs and opens them; a cached graph that a reader cannot read
    (`GraphLoadError`) is removed with its export and `open_graphs()` runs once more, which builds it anew.

    The rebuild is said as a stale export's is ("rebuilding X: ONNX Runtime could not load it (...)"). A `given`
    file (--decoder-onnx) is the user's: said, never removed. A graph that fails again, exported just now, is one
    sentence with what to check."""
    try:
        return open_graphs()
    except GraphLoadError as exc:
        if exc.graph.resolve() in {Path(path).resolve() for path in given if path is not None}:
            raise
        from nndf.workspace import discard_artifact

        discard_artifact(exc.graph.parent, f"{exc.reader} {exc.failed} it ({exc.reason})", say)
    try:
        return open_graphs()
    except GraphLoadError as exc:
        raise HarnessError(f"{exc.reader} {exc.failed} {exc.graph}, exported anew just now ({exc.reason}): check "
                           f"the disk of the working dir, and {exc.hint}") from exc
