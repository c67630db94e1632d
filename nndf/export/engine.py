"""ONNX -> TensorRT engine through Polygraphy, and everything about engines that can be decided without a GPU.

What an engine is tied to is data here: the settings that shaped it (the ONNX export it came from, the
optimization profiles derived from the one `ShapeSpec`, precision, the preview feature), plus the TensorRT version,
the GPU's name and its compute capability, passed in as a `DeviceInfo`. All of it goes into the engine's metadata
and its hash into the file name, so an engine is reused only on the setup that built it; anything else rebuilds
with a message that says what changed. Engines and the timing cache are written to temporary files and renamed
into place. The build itself (`build_engine`) imports Polygraphy and TensorRT only when it runs, which the trt
backend does only after it has seen a CUDA device; a failed build is one `HarnessError`.

Also here, because they need no GPU: the equivalent `trtexec` command, and the memory check before a build.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from nndf.errors import HarnessError, UsageError
from nndf.workspace import artifact_name, as_json, first_mismatch, read_metadata, write_artifact

# Bump when a change here changes the engines produced, so that old engines are rebuilt rather than reused.
ENGINE_BUILDER_REVISION = 1

# Bytes of memory a build needs per model parameter (rough, measured on NVIDIA's demo models): the builder holds
# the weights in the network, a copy in the chosen precision and tactic workspace; on the host the parsed ONNX
# weights, the network and the serialized engine.
GPU_BYTES_PER_PARAM_FP16 = 4
GPU_BYTES_PER_PARAM_FP32 = 8
HOST_BYTES_PER_PARAM = 12

# The metadata keys that tie an engine to one machine setup.
DEVICE_KEYS = ("tensorrt_version", "gpu_name", "compute_capability")

INSTALL_HINT = "pip install -e '.[tensorrt]' (or pip install tensorrt polygraphy) on a machine with an NVIDIA GPU"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class DeviceInfo:
    """What an engine is bound to: TensorRT refuses engines from another version, and tactics are per GPU."""

    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # "8.6"

    def as_dict(self) -> dict[str, str]:
        return {"tensorrt_version": self.tensorrt_version, "gpu_name": self.gpu_name,
                "compute_capability": self.compute_capability}

    def describe(self) -> str:
        return f"TensorRT {self.tensorrt_version} on {self.gpu_name} (compute capability {self.compute_capability})"

    @property
    def slug(self) -> str:
        """A file-name-safe tag: trt10.3.0-NVIDIA-A100-SXM4-40GB-sm80."""
        gpu = re.sub(r"[^A-Za-z0-9.]+", "-", self.gpu_name).strip("-") or "gpu"
        return f"trt{self.tensorrt_version}-{gpu}-sm{self.compute_capability.replace('.', '')}"


@dataclass(frozen=True)
class EngineRequest:
    """One decoder engine to build: the ONNX graph it comes from and how (profiles come from `ShapeSpec.profiles`)."""

    stem: str  # e.g. "GPT2-gpt2-decoder"
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

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16 else ("tf32" if self.tf32 else "fp32")


def validate_postfix(postfix: str) -> None:
    """--engine-postfix ends up in a file name: keep it to characters that are safe everywhere."""
    if postfix and not re.fullmatch(r"[A-Za-z0-9._+-]+", postfix):
        raise UsageError(f"--engine-postfix '{postfix}' may contain only letters, digits and . _ + -")


def engine_settings(request: EngineRequest, device: DeviceInfo) -> dict:
    """Everything that shaped an engine and where it can run: its metadata, and (hashed) its name."""
    return {
        "kind": "trt-decoder-engine",
        "onnx": request.onnx_id,
        "input_names": list(request.input_names),
        "output_names": list(request.output_names),
        "profiles": as_json(request.profiles),
        "fp16": request.fp16,
        "tf32": request.tf32,
        "preview_dynamic_shapes": request.preview_dynamic_shapes,
        "builder_revision": ENGINE_BUILDER_REVISION,
        **as_json(dict(request.extra)),
        **device.as_dict(),
    }


def engine_path(working_dir: str | Path, request: EngineRequest, device: DeviceInfo) -> Path:
    """`<stem>-<precision>-<hash of settings><postfix>.engine` in the working dir."""
    validate_postfix(request.postfix)
    name = artifact_name(f"{request.stem}-{request.precision}", engine_settings(request, device),
                         f"{request.postfix}.engine")
    return Path(working_dir) / name


def timing_cache_path(working_dir: str | Path, device: DeviceInfo) -> Path:
    """One timing cache per TensorRT version and GPU: TensorRT rejects a cache from another device."""
    return Path(working_dir) / f"timing-cache-{device.slug}.cache"


_LABELS = {
    "tensorrt_version": "TensorRT version", "gpu_name": "GPU", "compute_capability": "compute capability",
    "onnx": "ONNX export", "profiles": "set of optimization profiles", "fp16": "precision", "tf32": "TF32 setting",
    "preview_dynamic_shapes": "preview-dynamic-shapes setting", "builder_revision": "builder revision",
}


def engine_stale_reason(path: Path, expected: Mapping[str, object]) -> str | None:
    """Why the engine at `path` cannot be reused for `expected` metadata, or None when it can."""
    path = Path(path)
    if not path.is_file():
        return "it does not exist yet"
    meta = read_metadata(path)
    if meta is None:
        return "its metadata file is missing or unreadable"
    key = first_mismatch(meta, expected)
    if key is not None:
        label = _LABELS.get(key, key)
        if key in DEVICE_KEYS:
            return f"it was built for {label} {meta.get(key)}, this machine has {expected[key]}"
        return f"it was built with a different {label}"
    if meta.get("size") != path.stat().st_size:
        return "its file is truncated or was changed after the build"
    return None


def other_device_note(path: Path, expected: Mapping[str, object], prefix: str) -> str | None:
    """A note when the working dir holds an engine of the same settings built by another TensorRT or for another GPU.

    Such an engine has another name (the device is part of the hash), so it is never picked up by mistake; the
    note tells the user why a new build starts although "the engine is there".
    """
    path = Path(path)
    if not path.parent.is_dir():
        return None
    wanted = {k: v for k, v in as_json(dict(expected)).items() if k not in DEVICE_KEYS}
    for other in sorted(path.parent.glob(f"{glob_escape(prefix)}-*.engine")):
        if other == path:
            continue
        meta = read_metadata(other)
        if not meta or any(meta.get(k) != v for k, v in wanted.items()):
            continue
        before = DeviceInfo(*(str(meta.get(k)) for k in DEVICE_KEYS))
        now = DeviceInfo(*(str(expected.get(k)) for k in DEVICE_KEYS))
        return (f"building a new engine: {other.name} has these settings but was built with {before.describe()}, "
                f"and this machine has {now.describe()}")
    return None


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def check_given_engine(path: str | Path, device: DeviceInfo) -> Path:
    """`--decoder-engine PATH`: the file must exist, and its metadata (when it has ours) must name this setup."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--decoder-engine {path} does not exist")
    meta = read_metadata(path)
    if meta:
        mine = device.as_dict()
        differs = [k for k in DEVICE_KEYS if meta.get(k) is not None and str(meta.get(k)) != mine[k]]
        if differs:
            built = DeviceInfo(*(str(meta.get(k, "?")) for k in DEVICE_KEYS))
            raise UsageError(f"--decoder-engine {path} was built with {built.describe()} and this machine has "
                             f"{device.describe()}; rebuild it here, or drop --decoder-engine to build one")
    return path


# --- memory ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    gpu_bytes: int
    host_bytes: int


def estimate_build_memory(num_params: int, fp16: bool) -> MemoryEstimate:
    """Rough memory an engine build needs: GPU 4 bytes/parameter in fp16, 8 in fp32; host 12 bytes/parameter."""
    per = GPU_BYTES_PER_PARAM_FP16 if fp16 else GPU_BYTES_PER_PARAM_FP32
    return MemoryEstimate(gpu_bytes=int(num_params) * per, host_bytes=int(num_params) * HOST_BYTES_PER_PARAM)


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def check_build_memory(estimate: MemoryEstimate, free_gpu: int | None, free_host: int | None,
                       gpu_name: str = "the GPU", fp16: bool = False) -> None:
    """Stop with one sentence before a build that would run out of memory (None: unknown, not checked)."""
    if free_gpu is not None and estimate.gpu_bytes > free_gpu:
        per = GPU_BYTES_PER_PARAM_FP16 if fp16 else GPU_BYTES_PER_PARAM_FP32
        hint = "free GPU memory or choose a smaller --variant" if fp16 else \
            "free GPU memory, add --fp16 (half the need) or choose a smaller --variant"
        raise HarnessError(f"building this engine needs about {_gib(estimate.gpu_bytes)} of GPU memory "
                           f"({per} bytes per parameter) but {gpu_name} has {_gib(free_gpu)} free; {hint}")
    if free_host is not None and estimate.host_bytes > free_host:
        raise HarnessError(f"building this engine needs about {_gib(estimate.host_bytes)} of host memory "
                           f"({HOST_BYTES_PER_PARAM} bytes per parameter) but only {_gib(free_host)} is available; "
                           "close other programs or choose a smaller --variant")


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (what a new allocation can get without swapping), else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# --- trtexec ----------------------------------------------------------------------------------------------------

def trtexec_command(request: EngineRequest, engine: str | Path, timing_cache: str | Path | None = None,
                    preview_feature_available: bool = False) -> str:
    """The `trtexec` command that builds the same engine, from the same profiles (hence the same ShapeSpec).

    With several profiles, each set of --minShapes/--optShapes/--maxShapes follows its `--profile=N`, as in
    NVIDIA's demo. TF32 is trtexec's default (`--noTF32` turns it off); the faster-dynamic-shapes preview feature
    is named only for TensorRT versions that have it (8.5 to 9.x).
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
    if preview_feature_available:
        parts.append(f"--preview={'+' if request.preview_dynamic_shapes else '-'}fasterDynamicShapes0805")
    if timing_cache is not None:
        parts.append(f"--timingCacheFile={shlex.quote(str(timing_cache))}")
    return " ".join(parts)


def describe_profiles(profiles: list[dict]) -> str:
    """One line per profile for progress messages: the ranges of input_ids and the first past tensor."""
    names = ("context", "generation") if len(profiles) == 2 else tuple(f"profile {i}" for i in range(len(profiles)))
    lines = []
    for label, profile in zip(names, profiles):
        bits = []
        for name, dims in profile.items():
            if name == "input_ids" or name.endswith(".0.key"):
                lo, _, hi = dims
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


def _write_buffer(path: Path, buffer) -> None:
    """Write bytes or a buffer-protocol object (TensorRT's IHostMemory) without another copy in memory."""
    with open(path, "wb") as f:
        f.write(buffer)


def build_engine(request: EngineRequest, path: Path, timing_cache: Path, metadata: Mapping[str, object],
                 report: Callable[[str], None] = say) -> float:
    """Build the engine with Polygraphy and publish it (and the grown timing cache) atomically; returns seconds.

    Polygraphy's `CreateConfig` gets the profiles, TF32 (on unless asked otherwise) and fp16; the faster-dynamic-
    shapes preview feature is set on the config, alone, where TensorRT has it (Polygraphy's own `preview_features`
    list would switch every other preview feature off), and a progress monitor reports the phases. The timing
    cache is read from the working dir and the grown one replaces it only after a successful build.
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
    create = CreateConfig(tf32=request.tf32, fp16=request.fp16, profiles=profiles,
                          load_timing_cache=str(timing_cache) if timing_cache.is_file() else None)
    feature = faster_dynamic_shapes_feature(trt)
    monitor = progress_monitor(trt, report)

    def config(builder, network):
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
        write_artifact(path, lambda tmp: _write_buffer(tmp, engine_bytes),
                       dict(metadata, build_seconds=round(seconds, 1)))
        if new_cache.stat().st_size > 0:
            os.replace(new_cache, timing_cache)
    finally:
        for leftover in (new_cache, Path(f"{new_cache}.lock")):
            if leftover.exists():
                leftover.unlink()
    return seconds


def obtain_engine(request: EngineRequest, device: DeviceInfo, working_dir: str | Path, num_params: int,
                  free_gpu: int | None, free_host: int | None, report: Callable[[str], None] = say,
                  build: Callable | None = None) -> tuple[Path, bool]:
    """The engine for `request` on this device: reused when its metadata matches, else built (after the memory
    check) with a message that says why. Returns (path, whether it was built now)."""
    settings = engine_settings(request, device)
    path = engine_path(working_dir, request, device)
    reason = engine_stale_reason(path, settings)
    if reason is None:
        return path, False
    if path.exists():
        report(f"rebuilding {path}: {reason}")
    else:
        note = other_device_note(path, settings, f"{request.stem}-{request.precision}")
        if note:
            report(note)
    check_build_memory(estimate_build_memory(num_params, request.fp16), free_gpu, free_host, device.gpu_name,
                       request.fp16)
    report(f"building a TensorRT engine ({request.precision}; {describe_profiles(request.profiles)}) from "
           f"{request.onnx_path}; this takes a few minutes ...")
    started = time.perf_counter()
    (build or build_engine)(request, path, timing_cache_path(working_dir, device), settings, report)
    report(f"engine built in {time.perf_counter() - started:.1f} s: {path}")
    return path, True
