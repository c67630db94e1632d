"""The `trt` backend: the exported decoder graph built into a TensorRT engine and run with named tensors.

Only an NVIDIA GPU runs it, and nothing here imports TensorRT or a CUDA library at import time: `open_session`
checks for a CUDA device before `tensorrt` is imported or any TensorRT object exists. One job per module:

- `availability`: whether the backend can run here, the lazy `tensorrt` import, the CUDA device;
- `engine_io`: what an engine declares (names, dtypes, profiles) and whether it fits the decoder's settings;
- `buffers`: staging buffers and the ping-pong KV cache, at addresses that stay put;
- `runner`: `TrtSession`, one engine and one execution context, run step by step (CUDA graphs optional);
- `fp16`: the check of an fp16 engine's logits against fp32 PyTorch.

This module opens a session for a decoder: it builds (or reuses) the engine through `nndf.export.engine_cache`,
or checks and runs a given one (`--decoder-engine`). Everything but the engine run itself is plain data and torch,
tested without a GPU against a fake `tensorrt` module.
"""

from __future__ import annotations

from pathlib import Path

from nndf.backends import BackendOptions
from nndf.backends.trt.availability import (
    INSTALL_HINT, _device, _device_info, _free_gpu_memory, _tensorrt, check_available, unavailable_reason,
)
from nndf.backends.trt.buffers import PingPongCache, Staging, tensor_address
from nndf.backends.trt.engine_io import EngineIO, Ranges, check_engine_io, choose_profile, profile_accepts, torch_dtype
from nndf.backends.trt.fp16 import (
    FP16_LOGIT_BOUND, Fidelity, fp16_check, fp16_warning, fp32_cpu_copy, logit_fidelity,
)
from nndf.backends.trt.runner import TrtSession, say
from nndf.loading import LoadedModel
from nndf.spec import BuildSettings, ShapeSpec

__all__ = [
    "DESCRIPTION", "FP16_LOGIT_BOUND", "INSTALL_HINT", "USE_TF32", "EngineIO", "Fidelity", "PingPongCache", "Ranges",
    "Staging", "TrtSession", "check_available", "check_engine_io", "choose_profile", "fp16_check", "fp16_warning",
    "fp32_cpu_copy", "logit_fidelity", "open_session", "profile_accepts", "tensor_address", "torch_dtype",
    "unavailable_reason",
]

DESCRIPTION = "TensorRT engines built from the exported ONNX graph (NVIDIA GPU only; TF32 by default, --fp16)"

USE_TF32 = True
"""Engines are built with TF32 matrix products (TensorRT's and trtexec's default: fp32 range, 10-bit mantissa).
The GPU parity tests switch it off to compare true fp32 engines with fp32 PyTorch token for token."""


def _num_params(loaded: LoadedModel, export_folder: Path) -> int:
    """Parameters of the model, for the memory estimate, without loading its weights for it: counted when the
    weights are loaded anyway, else from the fp32 export (4 bytes a parameter, tied weights stored once)."""
    model = getattr(loaded, "_model", None)
    if model is not None:
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return sum(f.stat().st_size for f in Path(export_folder).iterdir() if f.is_file()) // 4


def open_session(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> TrtSession:
    """Build (or reuse) the engine for these settings on this GPU and open it; `--decoder-engine` runs a given one.

    Order matters: the CUDA device is checked before TensorRT is imported or any TensorRT object exists.
    """
    check_available()
    trt = _tensorrt()
    device = _device()
    return _open(loaded, settings, options, trt, device, _device_info(trt, device))


def _open(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions, trt, device, info) -> TrtSession:
    from nndf.export import engine_build, engine_cache
    from nndf.export.onnx import export_decoder, model_io
    from nndf.workspace import atomic_write_json, metadata_path, read_metadata

    spec = loaded.spec
    shapes = ShapeSpec.derive(settings, spec, loaded.config)
    engine_cache.validate_postfix(settings.engine_postfix)
    if options.decoder_engine is not None:
        path = engine_cache.check_given_engine(options.decoder_engine, info)
        inputs, outputs = model_io(loaded, settings.use_cache)
        return TrtSession(path, inputs, outputs, shapes, trt=trt, device=device, cuda_graph=options.cuda_graph,
                          source=f"--decoder-engine {path}")

    export = export_decoder(loaded, settings.use_cache, options.working_dir)
    request = engine_cache.EngineRequest(
        stem=f"{spec.family}-{loaded.variant.name}-decoder",
        onnx_path=export.graph,
        onnx_id=export.folder.name,
        input_names=export.input_names,
        output_names=export.output_names,
        profiles=shapes.profiles(export.input_names),
        fp16=settings.fp16,
        tf32=USE_TF32,
        preview_dynamic_shapes=settings.preview_dynamic_shapes,
        postfix=settings.engine_postfix,
    )
    path, built = engine_cache.obtain_engine(
        request, info, options.working_dir, _num_params(loaded, export.folder),
        free_gpu=_free_gpu_memory(device), free_host=engine_cache.available_host_memory(), report=say,
    )
    trtexec = engine_build.trtexec_command(request, path, engine_cache.timing_cache_path(options.working_dir, info),
                                           engine_build.faster_dynamic_shapes_feature(trt) is not None)
    session = TrtSession(path, export.input_names, export.output_names, shapes, trt=trt, device=device,
                         cuda_graph=options.cuda_graph, trtexec=trtexec)
    if settings.fp16:
        meta = read_metadata(path) or {}
        if built or "fp16_check" not in meta:
            say("checking the fp16 engine's logits against fp32 PyTorch ...")
            fidelity = fp16_check(session, shapes, spec.hooks, loaded.model)
            meta["fp16_check"] = fidelity.as_dict()
            atomic_write_json(metadata_path(path), meta)
        else:
            fidelity = Fidelity(**{k: meta["fp16_check"][k] for k in ("max_abs_diff", "scale", "top1_agreement",
                                                                       "positions")})
        warning = fp16_warning(fidelity)
        if warning:
            say(warning)
    return session
