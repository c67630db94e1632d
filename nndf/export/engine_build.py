"""ONNX -> TensorRT engine through Polygraphy, and the equivalent `trtexec` command.

The build (`build_engine`) imports Polygraphy and TensorRT only when it runs, which the trt backend does only
after it has seen a CUDA device; a failed build is one `HarnessError`. The engine and the grown timing cache are
written to temporary files and renamed into place. Which engine to build, and whether one on disk can be reused
instead, is `nndf.export.engine_cache`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Mapping

from nndf.errors import HarnessError
from nndf.export.engine_request import EngineRequest
from nndf.workspace import write_artifact
from nndf.progress import say

INSTALL_HINT = "pip install -e '.[tensorrt]' (or pip install tensorrt polygraphy) on a machine with an NVIDIA GPU"
PINNED_LAYERS_KEY = "fp32_layers_marked"  # an engine's metadata: the layers its build pinned to fp32


def trtexec_command(request: EngineRequest, engine: str | Path, timing_cache: str | Path | None = None,
                    preview_feature_available: bool = False, fp32_layers: tuple[str, ...] | None = None) -> str:
    """The `trtexec` command that builds the same engine, from the same profiles (hence the same ShapeSpec).

    With several profiles, each set of --minShapes/--optShapes/--maxShapes follows its `--profile=N`, as in
    NVIDIA's demo. TF32 is trtexec's default (`--noTF32` turns it off); the faster-dynamic-shapes preview feature
    is named only for TensorRT versions that have it (8.5 to 9.x). Layers kept in fp32 in an fp16 build
    (`--layerPrecisions`, `--layerOutputTypes`, obeyed with `--precisionConstraints=obey`) are `fp32_layers`, the
    layers a build marked (`PINNED_LAYERS_KEY` of its metadata), else the request's ONNX node names: before a build
    the parser's helper layers of those nodes (`<node>_<n>`, see `keep_layers_fp32`) are not known, and trtexec
    matches layer names exactly.
    """
    parts = ["trtexec", f"--onnx={shlex.quote(str(request.onnx_path))}", f"--saveEngine={shlex.quote(str(engine))}"]
    several = len(request.profiles) > 1
    for index, profile in enumerate(request.profiles):
        if several:
            parts.append(f"--profile={index}")
        for which, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
            spec = ",".join(f"{name}:{'x'.join(str(d) for d in dims[which])}" for name, dims in profile.items())
            parts.append(f"{flag}={spec}")
    if not request.tf32:
        parts.append("--noTF32")
    if request.fp16:
        parts.append("--fp16")
        layers = request.fp32_layers if fp32_layers is None else fp32_layers
        if layers:
            spec = shlex.quote(",".join(f"{name}:fp32" for name in layers))
            parts += ["--precisionConstraints=obey", f"--layerPrecisions={spec}", f"--layerOutputTypes={spec}"]
    if request.int8:
        parts.append("--int8")
    if request.workspace_mib is not None:
        parts.append(f"--memPoolSize=workspace:{request.workspace_mib}M")
    if preview_feature_available:
        parts.append(f"--preview={'+' if request.preview_dynamic_shapes else '-'}fasterDynamicShapes0805")
    if timing_cache is not None:
        parts.append(f"--timingCacheFile={shlex.quote(str(timing_cache))}")
    return " ".join(parts)


def describe_profiles(profiles: list[dict]) -> str:
    """One line per profile for progress messages: the ranges of input_ids and the first past tensor (of the first
    input for graphs that have neither, as a cross-attention cache generator)."""
    names = ("context", "generation") if len(profiles) == 2 else tuple(f"profile {i}" for i in range(len(profiles)))
    lines = []
    for label, profile in zip(names, profiles):
        bits = []
        shown = [n for n in profile if n == "input_ids" or n.endswith(".0.key")] or list(profile)[:1]
        for name in shown:
            lo, _, hi = profile[name]
            bits.append(f"{name} {'x'.join(map(str, lo))}..{'x'.join(map(str, hi))}")
        lines.append(f"{label}: {', '.join(bits)}")
    return "; ".join(lines)


# --- the build --------------------------------------------------------------------------------------------------

def faster_dynamic_shapes_feature(trt):
    """`trt.PreviewFeature.FASTER_DYNAMIC_SHAPES_0805` where this TensorRT has it (8.5 to 9.x), else None.

    TensorRT 10 made the faster dynamic shapes path the only one and removed the flag.
    """
    return getattr(getattr(trt, "PreviewFeature", None), "FASTER_DYNAMIC_SHAPES_0805", None)


def progress_monitor(trt, report: Callable[[str], None] = say):
    """A `trt.IProgressMonitor` (TensorRT 10+) that reports the builder's top-level phases and their times.

    Returns None on TensorRT versions without progress monitors.
    """
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class _Monitor(base):
        def __init__(self) -> None:
            base.__init__(self)
            self._started: dict[str, tuple[float, bool]] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            top = parent_phase is None
            self._started[phase_name] = (time.perf_counter(), top)
            if top:
                report(f"  {phase_name} ...")

        def step_complete(self, phase_name, step):
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            started, top = self._started.pop(phase_name, (None, False))
            if top and started is not None:
                report(f"  {phase_name}: {time.perf_counter() - started:.1f} s")

    return _Monitor()


def keep_layers_fp32(network, node_names, trt) -> list[str]:
    """Pin the layers of the named ONNX nodes to fp32 (precision and float outputs); returns the layers marked.

    The ONNX parser names a node's layer after the node, and further layers it needs for that node after the node
    with a numeric suffix (`node_linear_7`, `node_linear_7_12`): both are marked. Only layers with a floating
    output are touched (a shape computation stays as it is). The builder obeys the marks only with
    `OBEY_PRECISION_CONSTRAINTS` set (Polygraphy: `CreateConfig(precision_constraints="obey")`).
    """
    if not node_names:
        return []
    floats = [getattr(trt, name) for name in ("float32", "float16", "bfloat16") if hasattr(trt, name)]
    pattern = re.compile(f"(?:{'|'.join(re.escape(n) for n in node_names)})(?:_[0-9]+)?")
    marked = []
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if not pattern.fullmatch(layer.name):
            continue
        outputs = [i for i in range(layer.num_outputs) if any(layer.get_output(i).dtype == f for f in floats)]
        if not outputs:
            continue
        with warnings.catch_warnings():  # TensorRT 10.12+ deprecates both for strong typing; 10.x still obeys them
            warnings.simplefilter("ignore", DeprecationWarning)
            layer.precision = trt.float32
            for i in outputs:
                layer.set_output_type(i, trt.float32)
        marked.append(layer.name)
    return marked


def _write_buffer(path: Path, buffer) -> None:
    """Write bytes or a buffer-protocol object (TensorRT's IHostMemory) without another copy in memory."""
    with open(path, "wb") as f:
        f.write(buffer)


def build_engine(request: EngineRequest, path: Path, timing_cache: Path, metadata: Mapping[str, object],
                 report: Callable[[str], None] = say) -> float:
    """Build the engine with Polygraphy and publish it (and the grown timing cache) atomically; returns seconds.

    Polygraphy's `CreateConfig` gets the profiles, TF32 (on unless asked otherwise), fp16, and when the request has
    them int8 (a Q/DQ graph) and the workspace limit; the faster-dynamic-shapes preview feature is set on the config,
    alone, where TensorRT has it (Polygraphy's own `preview_features` list would switch every other preview feature
    off), and a progress monitor reports the phases. The timing cache is read from the working dir and the grown one
    replaces it only after a successful build. In an fp16 build the request's `fp32_layers` are pinned to fp32
    (`keep_layers_fp32`) and the builder obeys it.
    """
    try:
        import tensorrt as trt
        from polygraphy.backend.trt import CreateConfig, NetworkFromOnnxPath, Profile, engine_bytes_from_network
    except ImportError as exc:
        raise HarnessError(f"building TensorRT engines needs TensorRT and Polygraphy ({exc.name} is missing); "
                           f"{INSTALL_HINT}") from None

    if request.fp16 and not hasattr(getattr(trt, "BuilderFlag", None), "FP16"):
        raise HarnessError(f"--fp16 needs TensorRT 10: TensorRT {trt.__version__} builds strongly typed networks only "
                           "and has no fp16 builder flag; pip install 'tensorrt>=10,<11', or drop --fp16")
    profiles = []
    for shapes in request.profiles:
        profile = Profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.add(name, min=tuple(lo), opt=tuple(opt), max=tuple(hi))
        profiles.append(profile)
    timing_cache = Path(timing_cache)
    fp32_layers = request.fp32_layers if request.fp16 else ()
    optional = {}
    if fp32_layers:
        optional["precision_constraints"] = "obey"
    if request.int8 and hasattr(trt.BuilderFlag, "INT8"):  # TensorRT 11 runs Q/DQ graphs strongly typed, no flag
        optional["int8"] = True  # a Q/DQ graph needs no calibrator (Polygraphy's CreateConfig)
    if request.workspace_mib is not None:
        optional["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: request.workspace_mib << 20}
    create = CreateConfig(tf32=request.tf32, fp16=request.fp16, profiles=profiles,
                          load_timing_cache=str(timing_cache) if timing_cache.is_file() else None, **optional)
    feature = faster_dynamic_shapes_feature(trt)
    monitor = progress_monitor(trt, report)

    pinned: list[str] = []

    def config(builder, network):
        if fp32_layers:
            pinned[:] = keep_layers_fp32(network, fp32_layers, trt)
            report(f"  {len(pinned)} layers of {len(fp32_layers)} ONNX nodes kept in fp32")
        built = create(builder, network)
        if feature is not None:
            built.set_preview_feature(feature, bool(request.preview_dynamic_shapes))
        if monitor is not None:
            built.progress_monitor = monitor
        return built

    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{timing_cache.name}.", suffix=".tmp", dir=timing_cache.parent)
    os.close(fd)
    new_cache = Path(tmp_name)
    started = time.perf_counter()
    try:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # Polygraphy's log lines are progress, not results
                engine_bytes = engine_bytes_from_network(NetworkFromOnnxPath(str(request.onnx_path)), config=config,
                                                         save_timing_cache=str(new_cache))
        except Exception as exc:  # Polygraphy raises PolygraphyException; TensorRT raises RuntimeError and more
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise HarnessError(f"building the TensorRT engine from {request.onnx_path} failed: "
                               f"{type(exc).__name__}: {first} (the TensorRT log above says more)") from exc
        if not engine_bytes:
            raise HarnessError(f"TensorRT built no engine from {request.onnx_path} (the log above says why)")
        seconds = time.perf_counter() - started
        recorded = dict(metadata, build_seconds=round(seconds, 1), **({PINNED_LAYERS_KEY: pinned} if pinned else {}))
        write_artifact(path, lambda tmp: _write_buffer(tmp, engine_bytes), recorded)
        if new_cache.stat().st_size > 0:
            os.replace(new_cache, timing_cache)
    finally:
        for leftover in (new_cache, Path(f"{new_cache}.lock")):
            if leftover.exists():
                leftover.unlink()
    return seconds
