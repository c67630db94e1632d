"""The `trt` backend: the exported graphs built into TensorRT engines and run with named tensors.

Only an NVIDIA GPU runs it, and nothing here imports TensorRT or a CUDA library at import time: `open_session`
and `open_seq2seq` check for a CUDA device before `tensorrt` is imported or any TensorRT object exists. One job
per module:

- `availability`: whether the backend can run here, the lazy `tensorrt` import, the CUDA device;
- `engine_io`: what an engine declares (names, dtypes, profiles) and whether it fits its graph and settings;
- `buffers`: staging buffers and the ping-pong KV cache, at addresses that stay put;
- `runner`: `TrtSession`, one engine and one execution context, run step by step (CUDA graphs optional);
- `fp16`: the check of an fp16 engine's logits against fp32 PyTorch.

This module opens the sessions: one engine for a decoder-only model (`open_session`), three for an encoder-decoder
model (`open_seq2seq`: encoder, cross-attention cache generator, decoder). Every engine goes through the same
path (`_open_engine`): built (or reused) through `nndf.export.engine_cache` from its exported graph (a graph
damaged in place is exported once more: `nndf.export.graph_reads`), with its own stem, profiles, layers kept in
fp32 and trtexec command, or given (`--decoder-engine`, `--encoder-engine`,
`--cache-generator-engine`) and checked by tensor names and profile ranges. Everything but the engine run itself is
plain data and torch, tested without a GPU against a fake `tensorrt` module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nndf.backends import BackendOptions
from nndf.backends.trt.availability import (
    INSTALL_HINT, _device, _device_info, _free_gpu_memory, _tensorrt, check_available, unavailable_reason,
)
from nndf.backends.trt.buffers import PingPongCache, Staging, tensor_address
from nndf.backends.trt.engine_io import EngineIO, Ranges, check_engine_io, choose_profile, profile_accepts, torch_dtype
from nndf.backends.trt.fp16 import (
    FP16_LOGIT_BOUND, Fidelity, fp16_check, fp16_warning, fp32_cpu_copy, logit_fidelity,
)
from nndf.backends.trt.runner import TrtSession
from nndf.export.graph_reads import rebuilt_once
from nndf.measure import available_host_memory
from nndf.progress import say
from nndf.loading import LoadedModel
from nndf.spec import BuildSettings, ShapeSpec
from nndf.workspace import read_metadata

__all__ = [
    "DESCRIPTION", "FP16_LOGIT_BOUND", "INSTALL_HINT", "USE_TF32", "EngineIO", "Fidelity", "PingPongCache", "Ranges",
    "Staging", "TrtSession", "check_available", "check_engine_io", "choose_profile", "fp16_check", "fp16_warning",
    "fp32_cpu_copy", "logit_fidelity", "open_seq2seq", "open_session", "profile_accepts",
    "tensor_address", "torch_dtype", "unavailable_reason",
]

DESCRIPTION = "TensorRT engines built from the exported ONNX graph (NVIDIA GPU only; TF32 by default, --fp16)"

USE_TF32 = True
"""Engines are built with TF32 matrix products (TensorRT's and trtexec's default: fp32 range, 10-bit mantissa).
The GPU parity tests switch it off to compare true fp32 engines with fp32 PyTorch token for token."""


@dataclass(frozen=True)
class Gpu:
    """What every engine is opened with: the `tensorrt` module, the CUDA device and what it is (`DeviceInfo`)."""

    trt: object
    device: torch.device
    info: object


def _gpu() -> Gpu:
    """Order matters: the CUDA device is checked before TensorRT is imported or any TensorRT object exists."""
    check_available()
    trt = _tensorrt()
    device = _device()
    return Gpu(trt, device, _device_info(trt, device))


@dataclass(frozen=True)
class GraphEngine:
    """One exported graph of a model to run as an engine: built from the export, or given with `flag` PATH."""

    graph: str  # "decoder"; an encoder-decoder model's "encoder", "cross" and "decoder"
    role: str  # how messages name it
    flag: str  # the option that gives an engine for it
    given: str | None
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    profiles: list[Ranges]  # the ranges the settings need, from the ShapeSpec


def _num_params(export) -> int:
    """Parameters behind one exported graph, for the memory estimate, without loading the weights: its fp32
    files (the graph and its external data; 4 bytes a parameter, tied weights stored once)."""
    return sum(f.stat().st_size for f in Path(export.folder).iterdir()
               if f.is_file() and f.name.startswith(export.graph_file)) // 4


def fp32_layer_nodes(loaded: LoadedModel, settings: BuildSettings, onnx_path: Path) -> tuple[str, ...]:
    """The ONNX nodes of the family's fp32 modules (T5's feed-forward output), pinned to fp32 in fp16 builds."""
    modules = loaded.spec.hooks.fp32_modules()
    if not (settings.fp16 and modules):
        return ()
    from nndf.export.graph_reads import read_graph
    from nndf.export.precision import module_nodes

    read_graph(onnx_path)  # a damaged graph is a GraphLoadError (rebuilt once), not protobuf's traceback
    return module_nodes(onnx_path, modules)


def _build_read_graph(request, *args) -> float:
    """`engine_cache.build_engine`, once the graph it builds from is read (its protobuf: milliseconds, no weights).

    Why: an export damaged at its recorded size passes reuse, and TensorRT's parser would fail on it deep inside
    the build; read first, it is a GraphLoadError, on which `rebuilt_once` rebuilds the export once, as the onnxrt
    backend does when ONNX Runtime cannot load it. A reused engine reads no graph."""
    from nndf.export import engine_cache
    from nndf.export.graph_reads import read_graph

    read_graph(request.onnx_path)
    return engine_cache.build_engine(request, *args)


def _open_engine(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions, gpu: Gpu,
                 graph: GraphEngine, given: Path | None, export) -> tuple[TrtSession, bool]:
    """The session of one graph, and whether its engine was built now: the given engine (its file already
    checked), else the engine cache's (reused when its metadata matches, else built after the memory check)."""
    from nndf.export import engine_build, engine_cache
    from nndf.export.engine_request import EngineRequest

    common = dict(trt=gpu.trt, device=gpu.device, role=graph.role, flag=graph.flag, cuda_graph=options.cuda_graph)
    if given is not None:
        return TrtSession(given, graph.input_names, graph.output_names, graph.profiles,
                          source=f"{graph.flag} {given}", **common), False
    request = EngineRequest(
        stem=f"{loaded.spec.family}-{loaded.name}-{graph.graph}",
        graph=graph.graph,
        onnx_path=export.graph,
        onnx_id=export.folder.name,
        input_names=export.input_names,
        output_names=export.output_names,
        profiles=graph.profiles,
        fp16=settings.fp16,
        tf32=USE_TF32,
        preview_dynamic_shapes=settings.preview_dynamic_shapes,
        postfix=settings.engine_postfix,
        fp32_layers=fp32_layer_nodes(loaded, settings, export.graph),
    )
    path, built = engine_cache.obtain_engine(
        request, gpu.info, options.working_dir, _num_params(export),
        free_gpu=_free_gpu_memory(gpu.device), free_host=available_host_memory(), report=say, build=_build_read_graph,
    )
    pinned = (read_metadata(path) or {}).get(engine_build.PINNED_LAYERS_KEY)  # the layers its build pinned
    trtexec = engine_build.trtexec_command(request, path, engine_cache.timing_cache_path(options.working_dir, gpu.info),
                                           engine_build.faster_dynamic_shapes_feature(gpu.trt) is not None,
                                           tuple(pinned) if pinned else None)
    return TrtSession(path, export.input_names, export.output_names, graph.profiles, trtexec=trtexec, **common), built


def _open_engines(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions, gpu: Gpu,
                  graphs: list[GraphEngine], export: Callable[[], dict]) -> tuple[dict[str, TrtSession], bool]:
    """Every graph's session, and whether any engine was built now. Given engine files are checked first (they
    must exist and suit this GPU); `export()` gives each graph's export (all of them at once) and runs only when
    some graph has no given engine."""
    from nndf.export.engine_cache import check_given_engine, validate_postfix

    validate_postfix(settings.engine_postfix)
    given = {graph.graph: check_given_engine(graph.given, gpu.info, graph.flag) for graph in graphs
             if graph.given is not None}
    exports = export() if len(given) < len(graphs) else {}
    sessions, built = {}, False
    for graph in graphs:
        sessions[graph.graph], new = _open_engine(loaded, settings, options, gpu, graph, given.get(graph.graph),
                                                  exports.get(graph.graph))
        built = built or new
    return sessions, built


def _check_fp16(session: TrtSession, built: bool, decoder, loaded: LoadedModel, batches, reference) -> None:
    """The fp16 check of freshly built engines (or of engines whose metadata lacks it), through `decoder.logits`
    and `reference(model, *batch)`; stored in the decoder engine's metadata, and its warning repeated whenever the
    engines are reused."""
    from nndf.workspace import atomic_write_json, metadata_path

    path = session.artifacts[0]
    meta = read_metadata(path) or {}
    if built or "fp16_check" not in meta:
        say("checking the fp16 engine's logits against fp32 PyTorch ...")
        fidelity = fp16_check(decoder, loaded.model, batches, reference)
        meta["fp16_check"] = fidelity.as_dict()
        atomic_write_json(metadata_path(path), meta)
    else:
        fidelity = Fidelity(**{k: meta["fp16_check"][k] for k in ("max_abs_diff", "scale", "top1_agreement",
                                                                   "positions")})
    warning = fp16_warning(fidelity)
    if warning:
        say(warning)


def open_session(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> TrtSession:
    """Build (or reuse) the decoder's engine for these settings on this GPU and open it; `--decoder-engine` runs a
    given one."""
    from nndf.architectures import DecoderOnly
    from nndf.decoder import Decoder
    from nndf.export.onnx import export_decoder, model_io
    from nndf.reference import pytorch_logits

    gpu = _gpu()
    shapes = ShapeSpec.derive(settings, loaded.spec, loaded.config)
    inputs, outputs = model_io(loaded, settings.use_cache)
    graph = GraphEngine("decoder", "decoder", "--decoder-engine", options.decoder_engine, inputs, outputs,
                        shapes.profiles(inputs))
    sessions, built = rebuilt_once(lambda: _open_engines(loaded, settings, options, gpu, [graph], lambda: {
        "decoder": export_decoder(loaded, settings.use_cache, options.working_dir)}))
    session = sessions["decoder"]
    if settings.fp16 and graph.given is None:
        _check_fp16(session, built, Decoder(session, shapes, loaded.spec.hooks), loaded,
                    DecoderOnly().check_batches(shapes, loaded), pytorch_logits)
    return session


SEQ2SEQ_ENGINES = {"encoder": "encoder_engine", "cross": "cache_generator_engine", "decoder": "decoder_engine"}


def open_seq2seq(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> dict[str, TrtSession]:
    """An encoder-decoder model's three engines (encoder, cross-attention cache generator, decoder), each built
    (or reused) from the one export of the three graphs, or given with its flag and checked by tensor names and
    profile ranges. The fp16 check scores teacher-forced decoder ids through all three (the strategy's decoder
    and `check_batches`: encoder ids for T5 and BART, images for BLIP)."""
    from nndf.architectures import architecture
    from nndf.seq2seq.export import export_seq2seq, graph_roles, seq2seq_io

    gpu = _gpu()
    strategy = architecture(loaded.spec)
    shapes = strategy.derive_shapes(settings, loaded.spec, loaded.config)
    roles = graph_roles(loaded)
    graphs = [GraphEngine(name, roles[name], "--" + SEQ2SEQ_ENGINES[name].replace("_", "-"),
                          getattr(options, SEQ2SEQ_ENGINES[name]), inputs, outputs, shapes.graph_profiles(name, inputs))
              for name, (inputs, outputs) in seq2seq_io(loaded, settings.use_cache).items()]
    sessions, built = rebuilt_once(lambda: _open_engines(loaded, settings, options, gpu, graphs, lambda: export_seq2seq(
        loaded, settings.use_cache, options.working_dir).graphs))
    if settings.fp16 and all(graph.given is None for graph in graphs):
        _check_fp16(sessions["decoder"], built, strategy.decoder_over(sessions, shapes, loaded), loaded,
                    strategy.check_batches(shapes, loaded), strategy.reference_logits)
    return sessions
