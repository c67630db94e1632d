"""`export`: build (or verify and reuse) every artifact the given backends run, and say where they are."""

from __future__ import annotations

from pathlib import Path

from nndf.actions.common import describe, label, open_models
from nndf.backends import split_backend
from nndf.errors import UsageError
from nndf.export.graph_files import graph_bytes
from nndf.measure import format_bytes
from nndf.results import Column, Result


def add_arguments(parser) -> None:
    """No flags of its own: the build flags say what to export."""


def run(args) -> list[Result]:
    if all(split_backend(name)[0] == "frameworks" for name in args.backends):  # before the (slow) load
        raise UsageError("export builds the ONNX graphs and engines of onnxrt and trt; frameworks runs the PyTorch "
                         "model itself and has nothing to export: name onnxrt or trt")
    models = open_models(args)
    rows = []
    for model in models:
        files = model.artifacts or [None]
        for artifact in files:
            size = _size(Path(artifact)) if artifact else None
            rows.append({"backend": label(model), "artifact": artifact or "(runs the PyTorch model; nothing to export)",
                         "size": format_bytes(size) if size else "-"})
    columns = [Column("backend", "backend"), Column("artifact", "artifact"), Column("size", "size")]
    first = models[0]
    notes = ["Artifacts are reused only when their metadata matches these settings, library versions and weights.",
             "size: an ONNX graph's with its external data (the weights beside it), an engine's file."]
    return [Result("export", f"export {first.spec.family} {first.loaded.name}", columns, rows, describe(first), notes)]


def _size(artifact: Path) -> int:
    """What one artifact weighs on disk: an encoder-decoder's three graphs share a folder, each counting its own."""
    return graph_bytes(artifact) if artifact.suffix == ".onnx" else artifact.stat().st_size
