"""`TrtSession`: one deserialized engine with one execution context, run step by step on named torch tensors.

The GPU-only part of the backend is this thin: the session deserializes the engine, creates one execution context
and, per step, picks the optimization profile, sets input shapes and tensor addresses, and calls
`execute_async_v3` on a torch CUDA stream. What it decides with is plain data (`engine_io`) and the memory it binds
is preallocated (`buffers`). It takes the `tensorrt` module as an argument and never imports it.

One class serves every graph: a decoder (with its ping-pong KV cache) and an encoder-decoder model's encoder and
cross-attention cache generator (no cache; their outputs are new torch tensors that the loop reads). Inputs a
decoder gets unchanged at every step (an encoder's mask, cross-attention keys and values) are handed over once
through `as_feed` and then bound where they are, not copied per step.

`--cuda-graph` captures each decode step's `execute_async_v3` once per set of shapes and addresses and replays it
afterwards (the context is run once normally first, as TensorRT requires after a shape change). A step right
after a profile switch always runs normally: TensorRT updates the context's resources for the new profile in the
next `enqueueV3` (NvInferRuntime.h, `setOptimizationProfileAsync`), which a replay is not. Repeated generations of
the same lengths, as in benchmarks, then replay every decode step but the first after the prompt's profile.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Mapping

import torch

from nndf.backends.trt.buffers import PingPongCache, Staging, tensor_address
from nndf.backends.trt.engine_io import EngineIO, Ranges, check_engine_io, choose_profile
from nndf.errors import HarnessError
from nndf.kvcache import present_name
from nndf.spec import ShapeSpec
from nndf.progress import say


class TrtSession:
    """A deserialized engine with one execution context: named torch tensors in, named torch tensors out.

    `profiles` are the ranges the settings need (from the ShapeSpec), checked against the engine's own profiles;
    `role` ("decoder", "encoder", ...) and `flag` (the option that gave the engine) name it in those checks.
    """

    def __init__(self, engine_path: str | Path, input_names, output_names, profiles: list[Ranges], *, trt,
                 device: torch.device, role: str = "decoder", flag: str = "--decoder-engine",
                 cuda_graph: bool = False, source: str | None = None, trtexec: str | None = None) -> None:
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
        check_engine_io(self.io, self.input_names, self.output_names, profiles, source, role, flag)
        context = engine.create_execution_context()
        if context is None:
            raise HarnessError(f"TensorRT could not create an execution context for {source} (out of GPU memory?)")
        self._context = context
        self.name = "trt"
        self.device = torch.device(device)
        pasts = [self.io.inputs[n] for n in self.input_names if n.startswith("past_key_values.")]
        floats = [self.io.outputs[n] for n in self.output_names if self.io.outputs[n].is_floating_point]
        self.dtype = (pasts or floats or [torch.float32])[0]  # the KV cache's, else the first float output's
        self.artifacts = [engine_path]
        self.info_notes = [f"TensorRT engine: {engine_path}"] + ([f"equivalent trtexec command: {trtexec}"]
                                                                   if trtexec else [])
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.cuda_graph = bool(cuda_graph) and self.stream is not None
        self._graphs: dict[tuple, object] = {}
        self._profile: int | None = None
        self._switched = False  # a profile switch not yet followed by a real enqueue (no replay until one)
        self._shapes_set: dict[str, tuple[int, ...]] = {}
        self._addresses_set: dict[str, int] = {}
        self._staging = Staging(self.device)
        self._outputs = Staging(self.device)
        self._fallback = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._cache_storage: torch.Tensor | None = None
        self._cache_ref = None
        self._fixed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    # The engine must go before the runtime that made it, and the context before the engine.
    def __del__(self) -> None:
        for attr in ("_graphs", "_context", "_engine", "_runtime"):
            if hasattr(self, attr):
                delattr(self, attr)

    def new_cache(self, shapes: ShapeSpec, rows: int, max_len: int, reads_candidates: bool = False) -> PingPongCache:
        """A cache for one generation. Its storage is the session's, reused by the next cache when it is large
        enough, so repeated generations bind the same addresses (and CUDA graphs replay). (`reads_candidates`: an
        engine has no screened head, nothing to read.)"""
        cache = PingPongCache(shapes.num_layers, rows, shapes.kv_heads, shapes.head_dim, max_len, self.dtype,
                              self.device, storage=self._cache_storage)
        self._cache_storage = cache.storage
        self._cache_ref = weakref.ref(cache)
        return cache

    def as_feed(self, tensor: torch.Tensor) -> torch.Tensor:
        """An input fed unchanged at every step (an encoder's mask, cross-attention keys and values), made
        contiguous on the device once; `run` binds it as it is whenever the engine takes its dtype."""
        tensor = tensor.to(self.device).contiguous()
        self._fixed[id(tensor)] = tensor
        return tensor

    def _bound_as_is(self, name: str, value: torch.Tensor, dtype: torch.dtype, cache: PingPongCache | None) -> bool:
        """Whether an input is bound where it is: the cache's own contiguous pasts and the fixed inputs of
        `as_feed`, when the engine takes their dtype. Everything else is copied into staging buffers, whose
        addresses stay put from step to step (CUDA graphs replay only on the same addresses)."""
        if value.dtype != dtype:
            return False
        if cache is not None and name.startswith("past_key_values."):
            return True
        return self._fixed.get(id(value)) is value

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
        try:  # TensorRT's binding raises RuntimeError where the C++ call returns false; older ones return False
            switched = self._context.set_optimization_profile_async(index, self._stream_handle)
        except RuntimeError as exc:
            raise HarnessError(f"TensorRT refused to switch to optimization profile {index}: {exc}") from exc
        if switched is False:
            raise HarnessError(f"TensorRT refused to switch to optimization profile {index}")
        self._profile = index
        self._switched = True
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
        self._switched = False

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
                if self._bound_as_is(name, value, dtype, cache):
                    bound[name] = value
                else:
                    bound[name] = self._staging.stage(name, value, dtype)  # cast to what the engine declares
            addresses = tuple(self._set_address(n, t) for n, t in (*bound.items(), *outputs.items()))
            if self.cuda_graph and cache is not None and cache.length > 0 and not self._switched:  # decode steps
                self._execute_with_graph((profile, tuple(shapes.values()), addresses))
            else:
                self._execute()
        return outputs
