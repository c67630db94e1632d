"""Options that would change nothing on the backend asked for are refused in one sentence, by the command line
(nndf.actions.common) and `nndf.load` alike, rather than ignored."""

from __future__ import annotations

import re

from nndf.architectures import architecture
from nndf.backends import RUNS_ONNX_FILES
from nndf.errors import UsageError
from nndf.spec import BuildSettings


def check_unused_options(backend: str, spec, settings: BuildSettings, given: dict, cuda_graph: bool,
                         kv_layout: str | None) -> None:
    """One sentence for an option of `nndf.load` that `backend` would ignore (the command line refuses the same):
    `given` holds its given ONNX files by keyword."""
    for name, path in given.items():
        if path is not None and backend not in RUNS_ONNX_FILES:
            raise UsageError(f"{name}= runs a given ONNX file on the {', '.join(RUNS_ONNX_FILES)} backend; "
                             f"{backend} does not run ONNX files")
    if cuda_graph and backend not in ("frameworks", "trt"):
        raise UsageError(f"cuda_graph=True applies to the frameworks and trt backends, not {backend}")
    check_kv_layout(kv_layout, [backend], spec, settings.use_cache)


def check_kv_layout(kv_layout: str | None, backends: list[str], spec, use_cache: bool) -> None:
    """A KV layout asked for (not None) must change something: a cached decoder-only graph on a backend that runs
    ONNX files. In the command line's terms; `load` says them in its keywords'."""
    if kv_layout is None:
        return
    if not use_cache:
        raise UsageError(f"--kv-layout {kv_layout} lays out the decoder's KV cache, and --no-use-cache exports a "
                         "graph without one; drop one of them")
    if architecture(spec).has_encoder:
        raise UsageError(f"--kv-layout applies to decoder-only models; {spec.family}'s encoder-decoder graphs have "
                         "their own cache inputs")
    if not set(RUNS_ONNX_FILES) & set(backends):
        raise UsageError(f"--kv-layout lays out the {', '.join(RUNS_ONNX_FILES)} backend's graph, and no "
                         f"{' or '.join(RUNS_ONNX_FILES)} backend is asked for")


def check_engine_postfix(postfix: str) -> None:
    """--engine-postfix ends up in an engine's file name: letters, digits and `. _ + -` only, which are safe in a
    file name everywhere. Checked with the other engine flags, before anything loads (and again where an engine is
    named, for `nndf.load`): a `/` would otherwise reach `--info`'s trtexec command as a folder."""
    if postfix and not re.fullmatch(r"[A-Za-z0-9._+-]+", postfix):
        raise UsageError(f"--engine-postfix '{postfix}' may contain only letters, digits and . _ + -")
