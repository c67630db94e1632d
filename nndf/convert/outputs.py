"""What `convert_model` writes in -o, and the removal of what an earlier run wrote there and this run does not.

For its -n NAME a run writes, in transformer-deploy's layout: the graphs (`GRAPHS`), with --backend tensorrt an
engine `NAME-{fp16,int8}-<hash>.engine` with its metadata and the GPU's timing cache, and the Triton models
`NAME_{onnx,tensorrt}_{tokenize,model,inference}`. Each is replaced when written again, but a re-run that writes
fewer of them left the rest: a `model-int8.onnx` of an earlier -q beside the new graphs, engines of other settings,
and Triton models of a backend this run did not convert, which the server goes on loading and serving (the old
model under the old name). So a run removes them, and -o holds what it wrote.

Only what convert itself writes is removed: the graphs and timing caches by their names, the engines of this NAME
by theirs (another NAME's engines and Triton models in the same -o are another model, served beside this one), and
a Triton model folder only where writing it would replace it (its config.pbtxt, or empty: the rule of
`check_model_folders`, `nndf.paths.holds_other_files`); every other file and folder is the user's and stays. Each goes under its lock
(`nndf.workspace.remove_artifact`), as it is written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from nndf.paths import holds_other_files
from nndf.progress import say
from nndf.triton.repository import ENGINES, model_names
from nndf.workspace import metadata_path, remove_artifact

# the graphs by role (`nndf.convert.cli._graphs`): the export, ONNX Runtime's optimized graph, int8 (CPU, GPU)
GRAPHS = {"original": "model-original.onnx", "optimized": "model.onnx", "int8": "model-int8.onnx",
          "qdq": "model-qdq.onnx"}
TIMING_CACHES = "timing-cache-*.cache"  # `nndf.export.engine_cache.timing_cache_path`, one per TensorRT and GPU


def _engine_name(name: str) -> re.Pattern:
    """An engine of `name` as the engine cache names convert's (`engine_path`: stem, precision, settings hash),
    with its metadata file: `transformer-fp16-0123456789ab.engine`, never `transformer-x-fp16-....engine`."""
    return re.compile(rf"{re.escape(name)}-(fp16|int8)-[0-9a-f]{{12}}\.engine(\.meta\.json)?")


def written_by_convert(out: Path, name: str) -> list[Path]:
    """What `out` holds of convert's for the model `name`, whichever run wrote it."""
    if not out.is_dir():
        return []
    found = [out / graph for graph in GRAPHS.values() if (out / graph).is_file()]
    found += sorted(out.glob(TIMING_CACHES))
    engine = _engine_name(name)
    found += sorted(p for p in out.iterdir() if engine.fullmatch(p.name) and p.is_file())
    for backend in ENGINES:
        for folder in model_names(name, backend).values():
            path = out / folder
            if path.is_dir() and not holds_other_files(path, "config.pbtxt"):  # a model (or an empty folder)
                found.append(path)
    return found


def remove_stale(out: Path, name: str, kept: Iterable[Path]) -> list[Path]:
    """Remove what `out` holds of convert's for `name` that is not in `kept` (this run's files and the Triton
    model folders it is about to write; an engine's metadata stays with it); returns what went."""
    kept = {Path(p) for p in kept}
    kept |= {metadata_path(p) for p in kept}
    stale = [p for p in written_by_convert(out, name) if p not in kept]
    for path in stale:
        remove_artifact(path, say)
    if stale:
        say(f"removed from {out} what an earlier run wrote there and this one did not: "
            f"{', '.join(p.name for p in stale)}")
    return stale
