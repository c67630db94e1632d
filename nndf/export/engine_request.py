"""What one TensorRT engine is built from: the exported graph, its names, profiles and precision.

Both the engine cache (`engine_cache`, which names, reuses and checks engines) and the build (`engine_build`, which
runs TensorRT or shows the trtexec command) read a request, so it lives below both of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping


@dataclass(frozen=True)
class EngineRequest:
    """One engine to build: the exported graph it comes from and how (profiles come from the ShapeSpec).

    A decoder-only model has one (`graph` "decoder"); an encoder-decoder model three, one per graph ("encoder",
    "cross", "decoder"), each with its own stem, names and profiles. `fp32_layers` are the ONNX nodes whose layers
    stay fp32 in an fp16 build (`nndf.export.precision.module_nodes` of the family's `fp32_modules`).
    """

    stem: str  # e.g. "GPT2-gpt2-decoder", "T5-t5-small-encoder"
    onnx_path: Path
    onnx_id: str  # the export's artifact name: it already hashes the weights, exporter versions and use_cache
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    profiles: list[dict[str, tuple[tuple[int, ...], ...]]]
    fp16: bool = False
    tf32: bool = True
    preview_dynamic_shapes: bool = True
    postfix: str = ""
    extra: Mapping[str, object] = field(default_factory=dict)  # anything else that shaped the engine
    graph: str = "decoder"
    fp32_layers: tuple[str, ...] = ()
    int8: bool = False  # a graph with Q/DQ nodes (convert's -q): TensorRT 10's INT8 builder flag
    workspace_mib: int | None = None  # the builder's workspace pool limit (convert's -w); None: TensorRT's default

    @property
    def precision(self) -> str:
        return "int8" if self.int8 else "fp16" if self.fp16 else ("tf32" if self.tf32 else "fp32")
