"""Options that would change nothing on the backend asked for are refused in one sentence, by the command line
(nndf.actions.common) and `nndf.load` alike, rather than ignored."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

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


def check_load_arguments(family, backend, device, threads, settings, working_dir, switches: dict) -> None:
    """`nndf.load`'s arguments of the wrong kind, each in one sentence: a family or backend that is no name, a device
    torch cannot read, threads that are no whole number, settings that are no BuildSettings, a working dir that is
    a file, and switches that are not True or False (`use_cache="no"` is truthy: it would have kept the cache on)."""
    if not isinstance(family, str):
        raise UsageError(f"family must be a family name such as 'GPT2' (nndf.run('list') lists them), got {family!r}")
    if not isinstance(backend, str):
        raise UsageError(f"backend must be a backend name such as 'frameworks', 'onnxrt' or 'onnxrt-int8', got "
                         f"{backend!r}")
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be True or False, got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        raise UsageError(f"threads must be a whole number of at least 1, got {threads!r}")
    if settings is not None and not isinstance(settings, BuildSettings):
        raise UsageError(f"settings must be an nndf.spec.BuildSettings, got a {type(settings).__name__}; or leave it "
                         "out and give use_cache= and fp16=")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise UsageError(f"device must be 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got {device!r}") from None
    if not isinstance(working_dir, (str, os.PathLike)):
        raise UsageError(f"working_dir must be a folder's path, got {working_dir!r}")
    if Path(working_dir).exists() and not Path(working_dir).is_dir():  # (a read-only one may hold built exports)
        raise UsageError(f"working_dir {working_dir} is a file; it takes a folder (created if missing)")
