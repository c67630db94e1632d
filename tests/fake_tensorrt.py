"""A fake `tensorrt` (and Polygraphy) for the trt backend's tests on machines without a GPU or TensorRT.

The fake engine executes the exported ONNX graph with ONNX Runtime, reading and writing the very buffers the runner
binds by address, and checks what real TensorRT checks: input shapes within the active profile, every input's
shape set, output shapes from input shapes (from the graph's own symbolic dimensions, so a decoder, an encoder and
a cross-attention cache generator all work). `fake_gpu` is the fixture that routes the backend through it: import
it into a test module (`from fake_tensorrt import fake_gpu`). `fake_polygraphy` and `FakeNetwork` stand in for the
build: Polygraphy's loaders and config, and a parsed network's layers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from nndf.backends import trt as trt_backend
from nndf.export import engine_cache
from nndf.export.engine_cache import DeviceInfo
from nndf.workspace import write_artifact

DEVICE = DeviceInfo("10.0.1", "Fake GPU 24GB", "8.6")


class DType:
    """A `trt.DataType` member as the runner sees it: a name."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"DataType.{self.name}"


def fake_tensorrt(version="10.0.1", preview=False, progress=True):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT", NONE="NONE")
    # TensorRT 11 builds strongly typed networks only: its BuilderFlag has TF32 but no FP16 or INT8 (NvInfer.h)
    trt.BuilderFlag = types.SimpleNamespace(TF32="tf32", **({} if version.startswith("11.") else
                                                            {"FP16": "fp16", "INT8": "int8"}))
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.PreviewFeature = types.SimpleNamespace(**({"FASTER_DYNAMIC_SHAPES_0805": "fds"} if preview else
                                                  {"PROFILE_SHARING_0806": "ps"}))
    trt.float32, trt.float16, trt.bfloat16, trt.int32, trt.int64 = "float32", "float16", "bfloat16", "int32", "int64"
    if progress:
        class IProgressMonitor:
            def __init__(self):
                pass
        trt.IProgressMonitor = IProgressMonitor

    class Logger:
        WARNING = 2

        def __init__(self, severity=None):
            self.severity = severity

    trt.Logger = Logger
    trt.Runtime = FakeRuntime
    return trt


# --- the build: Polygraphy's loaders and config, a parsed network ---------------------------------------------------

class FakeBuilderConfig:
    def __init__(self, create):
        self.create = create
        self.preview = {}
        self.progress_monitor = None

    def set_preview_feature(self, feature, enabled):
        self.preview[feature] = enabled


# Polygraphy 0.49-0.53's `CreateConfig` keyword arguments (backend/trt/config.py: CreateConfig and the common base)
CREATE_CONFIG_PARAMETERS = {
    "tf32", "fp16", "int8", "fp8", "bf16", "calibrator", "use_dla", "allow_gpu_fallback", "profiles",
    "precision_constraints", "load_timing_cache", "algorithm_selector", "sparse_weights", "tactic_sources",
    "restricted", "profiling_verbosity", "memory_pool_limits", "refittable", "strip_plan", "preview_features",
    "engine_capability", "direct_io", "builder_optimization_level", "hardware_compatibility_level",
    "max_aux_streams", "version_compatible", "exclude_lean_runtime", "quantization_flags",
    "error_on_timing_cache_miss", "disable_compilation_cache", "progress_monitor", "weight_streaming",
    "runtime_platform", "tiling_optimization_level",
}


def fake_polygraphy(result, seen, network="network"):
    """`polygraphy.backend.trt` whose build returns `result` (or raises it) and records what it got in `seen`;
    the config callback gets `network`."""
    module = types.ModuleType("polygraphy.backend.trt")

    class Profile(dict):
        def add(self, name, min, opt, max):
            """As TensorRT's `set_shape`: equal ranks, 0 <= min <= opt <= max in every dimension (ValueError)."""
            if not len(min) == len(opt) == len(max) or not all(0 <= a <= b <= c for a, b, c in zip(min, opt, max)):
                raise ValueError(f"invalid profile for {name}: min {min}, opt {opt}, max {max}")
            self[name] = (min, opt, max)
            return self

    class CreateConfig:
        def __init__(self, **kwargs):
            unknown = set(kwargs) - CREATE_CONFIG_PARAMETERS
            if unknown:  # Python's own error for a keyword the real signature does not have
                raise TypeError(f"CreateConfig.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
            seen["create"] = kwargs

        def __call__(self, builder, network):
            return FakeBuilderConfig(self)

    def NetworkFromOnnxPath(path):
        seen["onnx"] = path
        return lambda: ("builder", network, "parser")

    def engine_bytes_from_network(loader, config, save_timing_cache):
        seen["config"] = config("builder", network)
        if isinstance(result, Exception):
            raise result
        Path(save_timing_cache).write_bytes(b"grown cache")
        Path(save_timing_cache + ".lock").write_bytes(b"")
        return result

    module.Profile, module.CreateConfig = Profile, CreateConfig
    module.NetworkFromOnnxPath, module.engine_bytes_from_network = NetworkFromOnnxPath, engine_bytes_from_network
    return module


class FakeLayer:
    """An `ILayer`: a name, a settable precision, outputs with dtypes and `set_output_type`."""

    def __init__(self, name, *output_dtypes):
        self.name = name
        self.precision = None
        self.outputs = [types.SimpleNamespace(dtype=dtype) for dtype in output_dtypes]
        self.output_types = {}

    @property
    def num_outputs(self):
        return len(self.outputs)

    def get_output(self, index):
        return self.outputs[index]

    def set_output_type(self, index, dtype):
        self.output_types[index] = dtype


class FakeNetwork:
    """An `INetworkDefinition` as far as layers go: `num_layers` and `get_layer(i)`."""

    def __init__(self, layers):
        self.layers = list(layers)

    @property
    def num_layers(self):
        return len(self.layers)

    def get_layer(self, index):
        return self.layers[index]


# --- engines that run the ONNX graph with ONNX Runtime --------------------------------------------------------------

_NP = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64}
_ORT_SESSIONS: dict[str, object] = {}


def _array_at(address: int, shape, np_dtype) -> np.ndarray:
    count = math.prod(shape)
    if count == 0:
        return np.zeros(shape, np_dtype)
    raw = (ctypes.c_char * (count * np.dtype(np_dtype).itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=np_dtype, count=count).reshape(shape)


class FakeRuntime:
    def __init__(self, logger):
        self.logger = logger

    def deserialize_cuda_engine(self, data):
        try:
            return FakeEngine(json.loads(bytes(data).decode()))
        except (ValueError, UnicodeDecodeError):
            return None


class FakeEngine:
    """The TensorRT 10 engine API over a JSON description: names, dtypes, profiles."""

    def __init__(self, spec):
        self.spec = spec
        self.names = list(spec["inputs"]) + list(spec["outputs"])
        self.contexts = []

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_mode(self, name):
        return "INPUT" if name in self.spec["inputs"] else "OUTPUT"

    def get_tensor_dtype(self, name):
        return DType({**self.spec["inputs"], **self.spec["outputs"]}[name])

    @property
    def num_optimization_profiles(self):
        return len(self.spec["profiles"])

    def get_tensor_profile_shape(self, name, profile):
        return [tuple(d) for d in self.spec["profiles"][profile][name]]

    def is_shape_inference_io(self, name):
        return False

    def create_execution_context(self):
        context = FakeContext(self)
        self.contexts.append(context)
        return context


class FakeContext:
    """Checks shapes against the active profile like TensorRT, and runs the ONNX graph on the bound memory."""

    def __init__(self, engine):
        self.engine = engine
        self.profile = 0
        self.resources_pending = False
        self.shapes, self.addresses, self.calls = {}, {}, []
        path = engine.spec["onnx"]
        if path not in _ORT_SESSIONS:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            _ORT_SESSIONS[path] = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.ort = _ORT_SESSIONS[path]
        self.declared = {arg.name: arg.shape for arg in (*self.ort.get_inputs(), *self.ort.get_outputs())}

    def set_optimization_profile_async(self, index, stream):
        """As TensorRT 10's binding: a RuntimeError for a profile the engine does not have, and the context's
        resources for the new profile are updated by the next `execute_async_v3` (`resources_pending` until then:
        a CUDA graph replayed meanwhile would run on the old profile's)."""
        if not 0 <= index < len(self.engine.spec["profiles"]):
            raise RuntimeError("Error in set optimization profile async.")
        self.profile = index
        self.shapes.clear()  # as in TensorRT: shapes must be set again after a switch
        self.resources_pending = True
        self.calls.append(("profile", index))
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.spec["profiles"][self.profile][name]
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        """An input's shape as set; an output's from the graph's symbolic dimensions ("batch", "past_sequence +
        sequence") bound to the input shapes set, as TensorRT infers them."""
        if name in self.engine.spec["inputs"]:
            return self.shapes[name]
        dims = {declared: size for arg in self.engine.spec["inputs"]
                for declared, size in zip(self.declared[arg], self.shapes[arg])
                if isinstance(declared, str) and declared.isidentifier()}
        scope = {"__builtins__": {}, "Min": min, "Max": max}
        return tuple(d if isinstance(d, int) else int(eval(d, scope, dims)) for d in self.declared[name])

    def set_tensor_address(self, name, address):
        """False for a name that is not one of the engine's inputs or outputs, as TensorRT's."""
        if name not in self.engine.names:
            return False
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream):
        spec = self.engine.spec
        if set(self.shapes) != set(spec["inputs"]) or set(self.addresses) != set(self.engine.names):
            return False
        feeds = {}
        for name, dtype in spec["inputs"].items():
            array = _array_at(self.addresses[name], self.shapes[name], _NP[dtype])
            feeds[name] = array.astype(np.float32 if dtype in ("FLOAT", "HALF") else np.int64)
        results = self.ort.run(list(spec["outputs"]), feeds)
        for (name, dtype), value in zip(spec["outputs"].items(), results):
            assert tuple(value.shape) == tuple(self.get_tensor_shape(name)), name
            _array_at(self.addresses[name], value.shape, _NP[dtype])[...] = value
        self.calls.append(("execute", self.profile))
        self.resources_pending = False
        return True


def fake_build(int32=False):
    """An `engine_cache.build_engine` that writes the engine as JSON: the graph, its tensors' dtypes (float where
    the ONNX graph declares float, int64 or, with `int32`, int32 otherwise) and the profiles."""
    def build(request, path, timing_cache, metadata, report):
        import onnx

        graph = onnx.load(str(request.onnx_path), load_external_data=False).graph
        floats = {v.name for v in graph.input if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
        spec = {
            "onnx": str(request.onnx_path),
            "inputs": {n: ("FLOAT" if n in floats else "INT32" if int32 else "INT64") for n in request.input_names},
            "outputs": {n: "FLOAT" for n in request.output_names},
            "profiles": json.loads(json.dumps(request.profiles)),
        }
        write_artifact(path, lambda tmp: tmp.write_text(json.dumps(spec)), metadata)
        return 0.0
    return build


def spec_with_trt(monkeypatch):
    import nndf.models.gpt2 as gpt2

    if "trt" not in gpt2.SPEC.backends:
        monkeypatch.setattr(gpt2, "SPEC", dataclasses.replace(gpt2.SPEC, backends=(*gpt2.SPEC.backends, "trt")))


class Builds(list):
    """The engine requests built during a test (and, in `state`, how the fake builds them)."""


@pytest.fixture
def fake_gpu(monkeypatch):
    """The trt backend on this CPU with the fake TensorRT; returns the list of engine builds."""
    spec_with_trt(monkeypatch)
    builds = Builds()
    state = {"int32": False}

    def build(request, *args):
        builds.append(request)
        return fake_build(state["int32"])(request, *args)

    monkeypatch.setattr(trt_backend, "check_available", lambda: None)
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: fake_tensorrt())
    monkeypatch.setattr(trt_backend, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(trt_backend, "_device_info", lambda trt, device: DEVICE)
    monkeypatch.setattr(trt_backend, "_free_gpu_memory", lambda device: 24 * 1024**3)
    monkeypatch.setattr(engine_cache, "build_engine", build)
    builds.state = state
    return builds
