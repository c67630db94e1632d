"""Backends: each turns a loaded model into a `Session` with the same call (named tensors in, named tensors out).

`BACKENDS` maps a backend name to the module that implements it; modules are imported only when asked for, so
that TensorRT and CUDA libraries are never imported unless the `trt` backend is chosen.
"""

from __future__ import annotations

import importlib
from typing import Mapping, Protocol

import torch

from nndf.errors import UsageError

# Backend name -> module with `open_session(loaded, settings, working_dir) -> Session` and a `DESCRIPTION`.
BACKENDS: dict[str, str] = {
    "frameworks": "nndf.backends.frameworks",
}


class Session(Protocol):
    """One executable decoder graph. Inputs it does not list in `input_names` must not be fed."""

    name: str
    device: torch.device
    dtype: torch.dtype
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def backend_module(name: str):
    """The module of backend `name`, or a UsageError listing the known backends."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend '{name}'; allowed: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
