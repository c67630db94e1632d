"""Backends: each turns a loaded model into a `Session` with the same call (named tensors in, named tensors out).

`BACKENDS` maps a backend name to the module that implements it; modules are imported only when asked for, so
that TensorRT and CUDA libraries are never imported unless the `trt` backend is chosen.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

from nndf.errors import UsageError

# Backend name -> module with `open_session(loaded, settings, options) -> Session` and a `DESCRIPTION`.
BACKENDS: dict[str, str] = {
    "frameworks": "nndf.backends.frameworks",
    "onnxrt": "nndf.backends.onnxrt",
    "trt": "nndf.backends.trt",
}

# Backends whose sessions run the loaded PyTorch model itself; the others only build from its weights
# (LoadedModel.weights_for_build lets those weights go once the build is done).
RUNS_TORCH_MODEL = ("frameworks",)

# Backends that run ONNX graphs as they are, so that --int8/--int4 and --decoder-onnx mean something to them.
RUNS_ONNX_FILES = ("onnxrt",)

QUANTIZATIONS = ("int8", "int4")
KV_LAYOUTS = ("growing", "shared")  # nndf.export.fused_attention.LAYOUTS, named here without importing the exporter


@dataclass(frozen=True)
class BackendOptions:
    """How a backend runs, beyond the build settings: where artifacts go, threads, given files, quantization."""

    working_dir: str = "temp"
    threads: int | None = None  # intra-op threads (None: the runtime's default, one per core)
    decoder_onnx: str | None = None  # run this ONNX file instead of exporting one
    encoder_onnx: str | None = None  # encoder-decoder models: the encoder graph to run instead of exporting one
    cache_generator_onnx: str | None = None  # ... and the cross-attention cache generator's
    quantize: str | None = None  # None, "int8" or "int4": weight quantization of the ONNX graph (CPU)
    block_size: int | None = None  # MatMulNBits block size of quantized weights (None: the kind's default)
    int8_method: str | None = None  # int8's "matmul_nbits" or "dynamic" (None: the CPU's; int4 ignores it)
    io_binding: bool = True  # ONNX Runtime: bind inputs and outputs instead of converting through numpy
    decoder_engine: str | None = None  # TensorRT: run this serialized engine instead of building one
    encoder_engine: str | None = None  # TensorRT, encoder-decoder models: the encoder's engine
    cache_generator_engine: str | None = None  # ... and the cross-attention cache generator's
    cuda_graph: bool = False  # frameworks and TensorRT on CUDA: replay CUDA graphs for decode steps
    kv_layout: str = "shared"  # ONNX Runtime: "shared" buffers written in place, or "growing" past/present tensors

    @property
    def int8_kernel(self) -> str | None:
        """`int8_method` where the weights are int8 (fp32 and int4 weights take none)."""
        return self.int8_method if self.quantize == "int8" else None

    def __post_init__(self) -> None:
        if self.quantize not in (None, *QUANTIZATIONS):
            raise UsageError(f"unknown quantization '{self.quantize}'; allowed: {', '.join(QUANTIZATIONS)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise UsageError(f"unknown --kv-layout '{self.kv_layout}'; allowed: {', '.join(KV_LAYOUTS)}")
        if self.int8_method is not None:
            from nndf.export.quantize import METHODS

            if self.int8_method not in METHODS:
                raise UsageError(f"unknown --int8-method '{self.int8_method.replace('_', '-')}'; allowed: "
                                 f"{', '.join(m.replace('_', '-') for m in METHODS)}")
        if self.block_size is not None:
            from nndf.export.quantize import block_size_problem

            problem = block_size_problem(self.block_size)
            if problem:
                raise UsageError(f"--block-size {problem}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {self.threads}")
        if self.threads is not None and self.threads > usable_cores():
            raise UsageError(f"--threads {self.threads} is more than the {usable_cores()} CPU cores this process may "
                             f"use; give at most {usable_cores()} (threads beyond the cores only wait for each other)")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as `taskset` or a container's cpuset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Session(Protocol):
    """One executable decoder graph. Inputs it does not list in `input_names` must not be fed."""

    name: str
    device: torch.device
    dtype: torch.dtype
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def split_backend(name: str) -> tuple[str, str | None]:
    """A backend name as given on the command line -> (backend, quantization): `onnxrt-int8` is onnxrt with int8
    weights, so that fp32 and quantized graphs run side by side in one table (`frameworks onnxrt onnxrt-int8`)."""
    base, _, suffix = name.rpartition("-")
    if base in RUNS_ONNX_FILES and suffix in QUANTIZATIONS:
        return base, suffix
    if base in BACKENDS:
        allowed = ", ".join(f"{b}-{q}" for b in RUNS_ONNX_FILES for q in QUANTIZATIONS)
        raise UsageError(f"unknown backend '{name}'; a quantized backend is one of: {allowed}")
    backend_module(name)  # an unknown name: the error lists the backends
    return name, None


def backend_names() -> list[str]:
    """Every name a backend can be given on the command line."""
    return [*BACKENDS, *(f"{b}-{q}" for b in RUNS_ONNX_FILES for q in QUANTIZATIONS)]


def backend_module(name: str):
    """The module of backend `name`, or a UsageError listing the known backends."""
    if name not in BACKENDS:
        quantized = [b for b in backend_names() if b not in BACKENDS]
        raise UsageError(f"unknown backend '{name}'; allowed: {', '.join(BACKENDS)}, and with quantized weights "
                         f"{', '.join(quantized)}")
    return importlib.import_module(BACKENDS[name])
