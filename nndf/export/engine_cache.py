"""The engine cache: which engine a request needs, whether the one on disk can be reused, and when to build one.

What an engine is tied to is data here: the settings that shaped it (the ONNX export it came from, the
optimization profiles derived from the one `ShapeSpec`, precision, the preview feature), plus the TensorRT version,
the GPU's name and its compute capability, passed in as a `DeviceInfo`. All of it goes into the engine's metadata
and its hash into the file name, so an engine is reused only on the setup that built it; anything else rebuilds
with a message that says what changed. Engines and the timing cache are written to temporary files and renamed
into place. The request is `nndf.export.engine_request`, the build itself `nndf.export.engine_build`; nothing here needs a GPU, including the memory check
before a build.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from nndf.errors import HarnessError, UsageError
from nndf.export.engine_build import build_engine, describe_profiles
from nndf.export.engine_request import EngineRequest
from nndf.option_checks import check_engine_postfix as validate_postfix
from nndf.progress import say
from nndf.workspace import artifact_lock, artifact_name, as_json, file_stale_reason, read_metadata

# Bump when a change to the build (`engine_build`) changes the engines produced, so that old engines are rebuilt
# rather than reused.
ENGINE_BUILDER_REVISION = 1

# Bytes of memory a build needs per model parameter (rough, measured on NVIDIA's demo models): the builder holds
# the weights in the network, a copy in the chosen precision and tactic workspace; on the host the parsed ONNX
# weights, the network and the serialized engine.
GPU_BYTES_PER_PARAM_FP16 = 4
GPU_BYTES_PER_PARAM_FP32 = 8
HOST_BYTES_PER_PARAM = 12

# The metadata keys that tie an engine to one machine setup.
DEVICE_KEYS = ("tensorrt_version", "gpu_name", "compute_capability")


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


def engine_settings(request: EngineRequest, device: DeviceInfo) -> dict:
    """Everything that shaped an engine and where it can run: its metadata, and (hashed) its name.

    Layers kept in fp32, int8 and a workspace limit are named only when set, so engines without them keep the names
    they had.
    """
    return {
        "kind": f"trt-{request.graph}-engine",
        "onnx": request.onnx_id,
        "input_names": list(request.input_names),
        "output_names": list(request.output_names),
        "profiles": as_json(request.profiles),
        "fp16": request.fp16,
        "tf32": request.tf32,
        "preview_dynamic_shapes": request.preview_dynamic_shapes,
        "builder_revision": ENGINE_BUILDER_REVISION,
        **({"fp32_layers": list(request.fp32_layers)} if request.fp32_layers else {}),
        **({"int8": True} if request.int8 else {}),
        **({"workspace_mib": request.workspace_mib} if request.workspace_mib is not None else {}),
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
    "fp32_layers": "set of layers kept in fp32", "int8": "int8 setting", "workspace_mib": "workspace size",
}


def engine_stale_reason(path: Path, expected: Mapping[str, object]) -> str | None:
    """Why the engine at `path` cannot be reused for `expected` metadata, or None when it can."""
    def describe(key: str, recorded: object) -> str:
        label = _LABELS.get(key, key)
        if key in DEVICE_KEYS:
            return f"it was built for {label} {recorded}, this machine has {expected[key]}"
        return f"it was built with a different {label}"

    return file_stale_reason(path, expected, describe)


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


def check_given_engine(path: str | Path, device: DeviceInfo, flag: str = "--decoder-engine") -> Path:
    """`--decoder-engine PATH` (or `flag`, e.g. --encoder-engine): the file must exist, and its metadata (when it
    has ours) must name this setup."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path} does not exist")
    meta = read_metadata(path)
    if meta:
        mine = device.as_dict()
        differs = [k for k in DEVICE_KEYS if meta.get(k) is not None and str(meta.get(k)) != mine[k]]
        if differs:
            built = DeviceInfo(*(str(meta.get(k, "?")) for k in DEVICE_KEYS))
            raise UsageError(f"{flag} {path} was built with {built.describe()} and this machine has "
                             f"{device.describe()}; rebuild it here, or drop {flag} to build one")
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


def obtain_engine(request: EngineRequest, device: DeviceInfo, working_dir: str | Path, num_params: int,
                  free_gpu: int | None, free_host: int | None, report: Callable[[str], None] = say,
                  build: Callable | None = None) -> tuple[Path, bool]:
    """The engine for `request` on this device: reused when its metadata matches, else built (after the memory
    check) with a message that says why; a process that finds another one building it waits and reuses it.
    Returns (path, whether it was built now)."""
    settings = engine_settings(request, device)
    path = engine_path(working_dir, request, device)
    with artifact_lock(path, report):  # another process may be building it: wait, then reuse it
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
