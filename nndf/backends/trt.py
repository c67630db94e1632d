"""The `trt` backend: the exported decoder graph built into a TensorRT engine and run with named tensors.

Only an NVIDIA GPU runs it. The module itself imports neither TensorRT nor any CUDA library: `check_available`
looks for a CUDA device through PyTorch first (creating a `trt.Runtime` without a GPU can crash the process) and
only then is `tensorrt` imported, inside the functions that need it.

The GPU-only part is thin: `TrtSession` deserializes the engine, creates one execution context and, per step,
picks the optimization profile, sets input shapes and tensor addresses, and calls `execute_async_v3` on a torch
CUDA stream. Everything around it is plain data and torch and is tested without a GPU:

- `EngineIO`: the engine's tensor names, dtypes and profile ranges, read once through the TensorRT 10 API
  (`num_io_tensors`, `get_tensor_name`, `get_tensor_mode`, `get_tensor_dtype`, `get_tensor_profile_shape`);
  `check_engine_io` compares them with the decoder's names and the profiles `ShapeSpec` asks for.
- `choose_profile`: the context profile while the cache is empty, the generation profile afterwards (in general
  the first profile whose ranges hold every input shape).
- `Staging`: inputs are copied into preallocated buffers, cast to the dtype the engine declares (int64 ids become
  int32 for an engine that wants int32); buffers only grow, so their addresses stay put (CUDA graphs need that).
- `PingPongCache`: the KV cache as two preallocated max-length buffers per tensor, used alternately. The engine
  writes each layer's present (rows, heads, L+T, head dim) contiguously into the buffer we bind; the next step
  reads that same memory as its past (shape L+T) while its present goes to the other buffer. No copy, no
  allocation per step; beam reorder is an `index_select` into the other buffer.

`--cuda-graph` captures each decode step's `execute_async_v3` once per set of shapes and addresses and replays it
afterwards (the context is run once normally first, as TensorRT requires after a shape change); repeated
generations of the same lengths, as in benchmarks, then replay every decode step.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from nndf.backends import BackendOptions
from nndf.errors import HarnessError, UsageError
from nndf.kvcache import KINDS, past_name, present_name
from nndf.loading import LoadedModel
from nndf.spec import BuildSettings, ShapeSpec

DESCRIPTION = "TensorRT engines built from the exported ONNX graph (NVIDIA GPU only; TF32 by default, --fp16)"

INSTALL_HINT = "pip install -e '.[tensorrt]' (or pip install tensorrt polygraphy)"

FP16_LOGIT_BOUND = 0.01
"""The largest logit difference an fp16 engine may show against fp32 PyTorch, relative to the logits' scale.

After each fp16 build, a few seeded prompts are scored by the engine and by an fp32 copy of the PyTorch model on
the CPU; the measure is max |fp16 - fp32| over every position and vocabulary entry, divided by max |fp32|. fp16
keeps about 3 significant decimal digits, so rounding alone accounts for ~0.05% of the scale; above 1% the engine
has lost real accuracy (an overflow in a layer norm or in attention, say) and its tokens can differ from
PyTorch's. The check warns with the measured value (and the top-1 agreement) when the bound is exceeded.
"""


USE_TF32 = True
"""Engines are built with TF32 matrix products (TensorRT's and trtexec's default: fp32 range, 10-bit mantissa).
The GPU parity tests switch it off to compare true fp32 engines with fp32 PyTorch token for token."""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- availability ----------------------------------------------------------------------------------------------

def unavailable_reason(cuda_available: bool, tensorrt_installed: bool) -> str | None:
    """One sentence on why the trt backend cannot run here, or None when it can."""
    if not cuda_available:
        return ("the trt backend needs an NVIDIA GPU with CUDA, and none is visible to PyTorch here; run it on a "
                "GPU machine with a CUDA build of torch and " + INSTALL_HINT + ", or choose the frameworks or "
                "onnxrt backend")
    if not tensorrt_installed:
        return ("the trt backend needs TensorRT and Polygraphy, which are not installed here; on this CUDA "
                "machine run " + INSTALL_HINT)
    return None


def check_available() -> None:
    """Raise a one-sentence HarnessError unless a CUDA device is visible and TensorRT is installed.

    The device is checked first and TensorRT is only looked up (`find_spec` imports nothing), never imported here.
    """
    cuda = torch.cuda.is_available()
    installed = cuda and importlib.util.find_spec("tensorrt") is not None
    reason = unavailable_reason(cuda, installed)
    if reason is not None:
        raise HarnessError(reason)


def _tensorrt():
    """The tensorrt module; call only after `check_available`."""
    import tensorrt

    return tensorrt


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _device_info(trt, device: torch.device):
    from nndf.export.engine import DeviceInfo

    major, minor = torch.cuda.get_device_capability(device)
    return DeviceInfo(str(trt.__version__), torch.cuda.get_device_name(device), f"{major}.{minor}")


def _free_gpu_memory(device: torch.device) -> int | None:
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


# --- what an engine declares -------------------------------------------------------------------------------------

_TORCH_DTYPES = {
    "FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
    "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool,
}


def torch_dtype(trt_dtype) -> torch.dtype:
    """The torch dtype of a `trt.DataType` (matched by its member name, so no TensorRT import is needed)."""
    name = getattr(trt_dtype, "name", None) or str(trt_dtype).rsplit(".", 1)[-1]
    try:
        return _TORCH_DTYPES[str(name).upper()]
    except KeyError:
        raise HarnessError(f"the engine uses a tensor type ({name}) this runner does not handle") from None


Ranges = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class EngineIO:
    """An engine's named inputs and outputs with their dtypes, and each optimization profile's input ranges."""

    inputs: dict[str, torch.dtype]
    outputs: dict[str, torch.dtype]
    profiles: tuple[Ranges, ...]
    shape_inputs: tuple[str, ...] = ()

    @classmethod
    def read(cls, engine, trt) -> "EngineIO":
        """Read them through the TensorRT 10 name-based API (no binding indices)."""
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        modes = {name: engine.get_tensor_mode(name) for name in names}
        inputs = {n: torch_dtype(engine.get_tensor_dtype(n)) for n in names if modes[n] == trt.TensorIOMode.INPUT}
        outputs = {n: torch_dtype(engine.get_tensor_dtype(n)) for n in names if modes[n] == trt.TensorIOMode.OUTPUT}
        profiles = tuple(
            {name: tuple(tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, index))
             for name in inputs}
            for index in range(engine.num_optimization_profiles)
        )
        shape_inputs = tuple(n for n in inputs if engine.is_shape_inference_io(n))
        return cls(inputs, outputs, profiles, shape_inputs)


def profile_accepts(profile: Ranges, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether every shape lies within the profile's [min, max] range, dimension by dimension."""
    for name, shape in shapes.items():
        lo, _opt, hi = profile[name]
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            return False
    return True


def choose_profile(profiles: tuple[Ranges, ...], shapes: Mapping[str, tuple[int, ...]], current: int | None = None) -> int:
    """The profile for a step: the current one if it still fits, else the first that does.

    With the two profiles of a KV-cache build this is the context profile while the past is empty and the
    generation profile once it is not (their past ranges are 0..0 and 1..max).
    """
    if current is not None and profile_accepts(profiles[current], shapes):
        return current
    for index, profile in enumerate(profiles):
        if profile_accepts(profile, shapes):
            return index
    shown = {n: s for n, s in shapes.items() if n == "input_ids" or n.endswith(".0.key")}
    raise HarnessError(
        f"no optimization profile of the engine accepts this step's shapes ({', '.join(f'{n} {s}' for n, s in shown.items())}); "
        "it was built for other batch sizes or sequence lengths: rebuild it with flags that cover them"
    )


def _range_text(ranges) -> str:
    lo, _, hi = ranges
    return f"{'x'.join(map(str, lo))}..{'x'.join(map(str, hi))}"


def check_engine_io(io: EngineIO, input_names, output_names, required: list[Ranges], source: str) -> None:
    """A given engine must have the decoder's tensor names and profiles covering every range the settings need.

    `required` is `ShapeSpec.profiles(...)`: each must fit inside one profile of the engine (min >= engine min,
    max <= engine max for every input).
    """
    if set(io.inputs) != set(input_names) or set(io.outputs) != set(output_names):
        raise UsageError(
            f"{source} does not have the decoder's inputs and outputs: expected inputs {list(input_names)} and "
            f"outputs {list(output_names)}, found {list(io.inputs)} and {list(io.outputs)}"
        )
    if io.shape_inputs:
        raise UsageError(f"{source} takes shape tensors ({', '.join(io.shape_inputs)}), which the decoder never feeds")
    labels = ("context", "generation") if len(required) == 2 else ("whole-sequence",) * len(required)
    for label, need in zip(labels, required):
        if any(all(_covers(profile[n], r) for n, r in need.items()) for profile in io.profiles):
            continue
        lacking = [n for n, r in need.items() if not any(_covers(p[n], r) for p in io.profiles)]
        name = lacking[0] if lacking else "input_ids"
        have = ", ".join(_range_text(p[name]) for p in io.profiles) or "none"
        raise UsageError(
            f"{source} has no optimization profile for the {label} step of these settings: {name} needs "
            f"{_range_text(need[name])} and the engine's profiles allow {have}; match --batch-size, --num-beams, "
            "--input-seq-len and --output-seq-len to the engine, or drop --decoder-engine to build one"
        )


def _covers(engine_range, needed) -> bool:
    """Whether an engine profile's [min, max] for one input contains the needed [min, max]."""
    (lo, _, hi), (need_lo, _, need_hi) = engine_range, needed
    return len(lo) == len(need_lo) and all(a <= b for a, b in zip(lo, need_lo)) and \
        all(a >= b for a, b in zip(hi, need_hi))


# --- buffers -----------------------------------------------------------------------------------------------------

class Staging:
    """One growing flat buffer per tensor name; `view` gives a tensor of the requested shape at its start.

    Buffers grow geometrically and are never shrunk, so after the first steps of a generation their addresses no
    longer change (CUDA graph replays depend on that) and no step allocates.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < max(count, 1):
            size = max(count, 1, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            with torch.inference_mode(False):  # a normal tensor: written in and outside inference mode alike
                buf = torch.empty(size, dtype=dtype, device=self.device)
            self.buffers[name] = buf
        return buf[:count].view(shape)

    def stage(self, name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Copy `value` in, cast to `dtype` (int64 ids to an int32 engine input, say)."""
        target = self.view(name, tuple(value.shape), dtype)
        target.copy_(value)
        return target


class PingPongCache:
    """KV cache for engines: two max-length buffers per past tensor, read and written alternately.

    Same interface as `nndf.kvcache.KVCache` (`length`, `past_feeds`, `store`, `reorder`) plus `present_targets`,
    the views the engine writes its presents into. A present (rows, heads, L+T, head dim) is written contiguously
    at the start of the spare buffer, which is exactly the layout of the next step's past of length L+T: `store`
    then only flips which buffer is current.
    """

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 storage: torch.Tensor | None = None) -> None:
        self.num_layers = num_layers
        self.names = [past_name(layer, kind) for layer in range(num_layers) for kind in KINDS]
        self.present_names = [present_name(layer, kind) for layer in range(num_layers) for kind in KINDS]
        self._dims = (rows, kv_heads, head_dim)
        self.max_len = max_len
        needed = rows * kv_heads * max_len * head_dim
        device = torch.device(device)
        if (storage is None or storage.dtype != dtype or storage.device != device
                or storage.shape[1] != len(self.names) or storage.shape[2] < max(needed, 1)):
            with torch.inference_mode(False):  # a normal tensor: written in and outside inference mode alike
                storage = torch.zeros((2, len(self.names), max(needed, 1)), dtype=dtype, device=device)
        self.storage = storage
        self.current = 0
        self.length = 0

    @property
    def rows(self) -> int:
        return self._dims[0]

    def _view(self, side: int, index: int, length: int) -> torch.Tensor:
        rows, heads, head_dim = self._dims
        return self.storage[side, index, : rows * heads * length * head_dim].view(rows, heads, length, head_dim)

    def past_feeds(self) -> dict[str, torch.Tensor]:
        """The filled positions, keyed by past input names (length 0 before the prompt)."""
        return {name: self._view(self.current, i, self.length) for i, name in enumerate(self.names)}

    def owns(self, feeds: Mapping[str, torch.Tensor]) -> bool:
        """Whether `feeds` hold this cache's current pasts (so presents can be written into its spare buffer)."""
        first = feeds.get(self.names[0]) if self.names else None
        # Compared by storage and offset: an empty view (the first step's past) has no data pointer of its own.
        return (first is not None and first.shape[2] == self.length
                and first.untyped_storage().data_ptr() == self.storage.untyped_storage().data_ptr()
                and first.storage_offset() == self.storage[self.current, 0].storage_offset())

    def present_targets(self, new_length: int) -> dict[str, torch.Tensor]:
        """Where a step that ends at `new_length` positions writes its presents: the spare buffer."""
        if new_length > self.max_len:
            raise HarnessError(f"the KV cache holds {self.max_len} positions and a step needs {new_length}")
        spare = 1 - self.current
        return {name: self._view(spare, i, new_length) for i, name in enumerate(self.present_names)}

    def store(self, outputs: Mapping[str, torch.Tensor]) -> None:
        """Make the step's presents the current pasts. When the engine wrote them into `present_targets` (the
        normal case) this only flips buffers; presents from anywhere else are copied in."""
        new_length = int(outputs[self.present_names[0]].shape[2])
        targets = self.present_targets(new_length)
        for name, target in targets.items():
            present = outputs[name]
            if present.data_ptr() != target.data_ptr() or present.shape != target.shape:
                target.copy_(present)
        self.current = 1 - self.current
        self.length = new_length

    def reorder(self, row_index: torch.Tensor) -> None:
        """Row r takes what row `row_index[r]` held (beam search); gathered into the spare buffer, then flipped."""
        index = row_index.to(self.storage.device)
        spare = 1 - self.current
        for i in range(len(self.names)):
            torch.index_select(self._view(self.current, i, self.length), 0, index,
                               out=self._view(spare, i, self.length))
        self.current = spare


def tensor_address(tensor: torch.Tensor, fallback: torch.Tensor) -> int:
    """A tensor's device address; an empty tensor may have none, and TensorRT wants a valid one even then."""
    address = tensor.data_ptr()
    return address if address or tensor.numel() else fallback.data_ptr()


# --- the session ---------------------------------------------------------------------------------------------------

class TrtSession:
    """A deserialized engine with one execution context: named torch tensors in, named torch tensors out."""

    def __init__(self, engine_path: str | Path, input_names, output_names, shapes: ShapeSpec, *, trt,
                 device: torch.device, cuda_graph: bool = False, source: str | None = None,
                 trtexec: str | None = None) -> None:
        engine_path = Path(engine_path)
        source = source or str(engine_path)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if engine is None:
            raise HarnessError(f"TensorRT could not load {source}: it was built by another TensorRT version or for "
                               "another GPU, or the file is damaged; rebuild it")
        self._engine = engine
        self.io = EngineIO.read(engine, trt)
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        check_engine_io(self.io, self.input_names, self.output_names, shapes.profiles(self.input_names), source)
        context = engine.create_execution_context()
        if context is None:
            raise HarnessError(f"TensorRT could not create an execution context for {source} (out of GPU memory?)")
        self._context = context
        self.name = "trt"
        self.device = torch.device(device)
        pasts = [n for n in self.input_names if n.startswith("past_key_values.")]
        self.dtype = self.io.inputs[pasts[0]] if pasts else self.io.outputs["logits"]
        self.artifacts = [engine_path]
        self.info_notes = [f"TensorRT engine: {engine_path}"] + ([f"equivalent trtexec command: {trtexec}"]
                                                                   if trtexec else [])
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.cuda_graph = bool(cuda_graph) and self.stream is not None
        self._graphs: dict[tuple, object] = {}
        self._profile: int | None = None
        self._shapes_set: dict[str, tuple[int, ...]] = {}
        self._addresses_set: dict[str, int] = {}
        self._staging = Staging(self.device)
        self._outputs = Staging(self.device)
        self._fallback = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._cache_storage: torch.Tensor | None = None
        self._cache_ref = None

    # The engine must go before the runtime that made it, and the context before the engine.
    def __del__(self) -> None:
        for attr in ("_graphs", "_context", "_engine", "_runtime"):
            if hasattr(self, attr):
                delattr(self, attr)

    def new_cache(self, shapes: ShapeSpec, rows: int, max_len: int) -> PingPongCache:
        """A cache for one generation. Its storage is the session's, reused by the next cache when it is large
        enough, so repeated generations bind the same addresses (and CUDA graphs replay)."""
        cache = PingPongCache(shapes.num_layers, rows, shapes.kv_heads, shapes.head_dim, max_len, self.dtype,
                              self.device, storage=self._cache_storage)
        self._cache_storage = cache.storage
        self._cache_ref = weakref.ref(cache)
        return cache

    def _owning_cache(self, feeds) -> PingPongCache | None:
        cache = self._cache_ref() if self._cache_ref is not None else None
        return cache if cache is not None and cache.owns(feeds) else None

    @contextlib.contextmanager
    def _on_stream(self):
        """Run on the session's stream, ordered after the caller's work and before whatever the caller does next."""
        if self.stream is None or self.device.type != "cuda":
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

    @property
    def _stream_handle(self) -> int:
        return getattr(self.stream, "cuda_stream", 0)

    def _set_profile(self, index: int) -> None:
        if not self._context.set_optimization_profile_async(index, self._stream_handle):
            raise HarnessError(f"TensorRT refused to switch to optimization profile {index}")
        self._profile = index
        self._shapes_set.clear()  # a profile switch invalidates the shapes set before it
        self._addresses_set.clear()

    def _set_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if self._shapes_set.get(name) != shape:
            if not self._context.set_input_shape(name, shape):
                raise HarnessError(f"TensorRT rejected shape {shape} for input {name} in profile {self._profile}")
            self._shapes_set[name] = shape

    def _set_address(self, name: str, tensor: torch.Tensor) -> int:
        address = tensor_address(tensor, self._fallback)
        if self._addresses_set.get(name) != address:
            if not self._context.set_tensor_address(name, address):
                raise HarnessError(f"TensorRT rejected the buffer for {name}")
            self._addresses_set[name] = address
        return address

    def _execute(self) -> None:
        if not self._context.execute_async_v3(self._stream_handle):
            raise HarnessError("TensorRT failed to run the engine (execute_async_v3 returned false; see its log)")

    def _capture(self):
        """Record one `execute_async_v3` on the session's stream as a CUDA graph (nothing runs meanwhile)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self._execute()
        return graph

    def _execute_with_graph(self, key: tuple) -> None:
        """Replay the graph captured for these shapes and addresses, or run normally and capture one."""
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        self._execute()  # TensorRT must run once after a shape change before it can be captured
        try:
            self.stream.synchronize()
            graph = self._capture()
        except Exception as exc:  # some engines cannot be captured (data-dependent shapes, host syncs)
            say(f"warning: CUDA graph capture failed ({type(exc).__name__}: {exc}); running without CUDA graphs")
            self.cuda_graph = False
            self._graphs.clear()
            return
        self._graphs[key] = graph

    @torch.inference_mode()
    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step. Shapes and the profile are host calls; copies and the engine run on the session's stream.

        Presents go straight into the cache's spare buffer when the pasts come from this session's cache. The
        logits are a new tensor per step, except with CUDA graphs, where they live in one buffer (at a fixed
        address) that the next step overwrites: the generation loop reads them before it runs the next step.
        """
        shapes = {name: tuple(feeds[name].shape) for name in self.input_names}
        profile = choose_profile(self.io.profiles, shapes, self._profile)
        cache = self._owning_cache(feeds)
        if profile != self._profile:
            self._set_profile(profile)
        for name in self.input_names:
            self._set_shape(name, shapes[name])
        out_shapes = {name: tuple(int(d) for d in self._context.get_tensor_shape(name)) for name in self.output_names}
        if any(d < 0 for shape in out_shapes.values() for d in shape):
            raise HarnessError("the engine's output shapes depend on input values, which this runner does not support")
        targets = cache.present_targets(out_shapes[present_name(0, "key")][2]) if cache is not None else {}
        outputs: dict[str, torch.Tensor] = {}
        for name in self.output_names:
            dtype = self.io.outputs[name]
            target = targets.get(name)
            if target is not None and target.dtype == dtype and tuple(target.shape) == out_shapes[name]:
                outputs[name] = target
            elif name == "logits" and self.cuda_graph:
                outputs[name] = self._outputs.view(name, out_shapes[name], dtype)  # a fixed address for replays
            else:  # allocated on the caller's stream, which is the one that uses (and frees) it
                outputs[name] = torch.empty(out_shapes[name], dtype=dtype, device=self.device)
        with self._on_stream():
            bound = {}
            for name in self.input_names:
                value, dtype = feeds[name], self.io.inputs[name]
                if cache is not None and name.startswith("past_key_values.") and value.dtype == dtype:
                    bound[name] = value  # the cache's own contiguous view, bound as it is
                else:
                    bound[name] = self._staging.stage(name, value, dtype)  # cast to what the engine declares
            addresses = tuple(self._set_address(n, t) for n, t in (*bound.items(), *outputs.items()))
            if self.cuda_graph and cache is not None and cache.length > 0:  # decode steps only
                self._execute_with_graph((profile, tuple(shapes.values()), addresses))
            else:
                self._execute()
        return outputs


# --- fp16 check ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fidelity:
    """How far a backend's logits are from the fp32 reference over a few prompts."""

    max_abs_diff: float
    scale: float  # max |reference logit|
    top1_agreement: float
    positions: int

    @property
    def relative(self) -> float:
        return self.max_abs_diff / max(self.scale, 1e-12)

    def as_dict(self) -> dict:
        return {"max_abs_diff": self.max_abs_diff, "scale": self.scale, "relative": self.relative,
                "top1_agreement": self.top1_agreement, "positions": self.positions, "bound": FP16_LOGIT_BOUND}


def logit_fidelity(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Fidelity:
    """Max absolute difference, reference scale and top-1 agreement over (got, expected) logit pairs."""
    diff = scale = 0.0
    agree = total = 0
    for got, expected in pairs:
        got, expected = got.float(), expected.float()
        diff = max(diff, float((got - expected).abs().max()))
        scale = max(scale, float(expected.abs().max()))
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += got.shape[0] * got.shape[1]
    return Fidelity(diff, scale, agree / max(total, 1), total)


def fp16_warning(fidelity: Fidelity, bound: float = FP16_LOGIT_BOUND) -> str | None:
    """The warning to print when fp16 logits are further from fp32 than `bound` allows, else None."""
    if fidelity.relative <= bound:
        return None
    return (f"warning: the fp16 engine's logits differ from fp32 PyTorch by up to {fidelity.max_abs_diff:.4g} "
            f"({fidelity.relative:.2%} of the logits' scale {fidelity.scale:.4g}, bound {bound:.0%}); top-1 agreement "
            f"{fidelity.top1_agreement:.1%} over {fidelity.positions} positions: prefer the fp32 engine for accuracy")


def fp32_cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of `model` on the CPU, made tensor by tensor (no second copy on the GPU; ties kept)."""
    memo = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        cpu = tensor.detach().to("cpu", torch.float32 if tensor.is_floating_point() else tensor.dtype)
        memo[id(tensor)] = torch.nn.Parameter(cpu, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) \
            else cpu
    clone = copy.deepcopy(model, memo)
    return clone.eval()


def fp16_check(session, shapes: ShapeSpec, hooks, model: torch.nn.Module, lengths=(8, 16, 32),
               seed: int = 0) -> Fidelity:
    """Score seeded prompts with `session` (through the shared Decoder) and with fp32 PyTorch; compare."""
    from nndf.decoder import Decoder

    decoder = Decoder(session, shapes, hooks)
    reference = fp32_cpu_copy(model)
    generator = torch.Generator().manual_seed(seed)
    rows = shapes.rows.min
    pairs = []
    for length in sorted({min(n, shapes.prompt.max) for n in lengths}):
        ids = torch.randint(0, shapes.vocab_size, (rows, length), generator=generator)
        got = decoder.logits(ids).float().cpu().clone()
        with torch.inference_mode():
            expected = reference(ids).logits.float()
        pairs.append((got, expected))
    return logit_fidelity(pairs)


# --- opening a session ----------------------------------------------------------------------------------------------

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
    from nndf.export import engine as engines
    from nndf.export.onnx import export_decoder, model_io
    from nndf.workspace import atomic_write_json, metadata_path, read_metadata

    spec = loaded.spec
    shapes = ShapeSpec.derive(settings, spec, loaded.config)
    engines.validate_postfix(settings.engine_postfix)
    if options.decoder_engine is not None:
        path = engines.check_given_engine(options.decoder_engine, info)
        inputs, outputs = model_io(loaded, settings.use_cache)
        return TrtSession(path, inputs, outputs, shapes, trt=trt, device=device, cuda_graph=options.cuda_graph,
                          source=f"--decoder-engine {path}")

    export = export_decoder(loaded, settings.use_cache, options.working_dir)
    request = engines.EngineRequest(
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
    path, built = engines.obtain_engine(
        request, info, options.working_dir, _num_params(loaded, export.folder),
        free_gpu=_free_gpu_memory(device), free_host=engines.available_host_memory(), report=say,
    )
    trtexec = engines.trtexec_command(request, path, engines.timing_cache_path(options.working_dir, info),
                                      engines.faster_dynamic_shapes_feature(trt) is not None)
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
