"""The trt backend.

No machine of ours has a GPU or TensorRT, so most of these tests run the backend against a fake `tensorrt` module
whose engines execute the exported ONNX graph with ONNX Runtime, reading and writing the very buffers the runner
binds by address (the fake checks what real TensorRT checks: input shapes within the active profile, every
input's shape set, output shapes from input shapes). That exercises everything but TensorRT itself: engine
naming, metadata and rebuilds, profiles, the given-engine checks, dtype casts, the ping-pong KV cache, profile
switching, and the shared generation loop with parity against Hugging Face `generate()`.

Tests marked `gpu` build real engines with TensorRT and Polygraphy; they skip without CUDA (conftest) or without
TensorRT, and run with `python -m pytest -m gpu` on a GPU machine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import nndf
from conftest import REPO, decoder_only_families
from nndf.backends import BackendOptions
from nndf.backends import trt as trt_backend
from nndf.backends.trt import availability
from nndf.backends.trt import (
    FP16_LOGIT_BOUND, EngineIO, Fidelity, PingPongCache, Staging, check_engine_io, choose_profile, fp16_warning,
    fp32_cpu_copy, logit_fidelity, torch_dtype, unavailable_reason,
)
from nndf.errors import HarnessError, UsageError
from nndf.export import engine_build, engine_cache
from nndf.export.engine_cache import DeviceInfo, EngineRequest
from nndf.kvcache import KVCache, past_names, present_name
from nndf.registry import FAMILIES
from nndf.spec import BuildSettings, ShapeSpec
from nndf.workspace import metadata_path, read_metadata, write_artifact
from test_generation_parity import PROMPT_LENGTHS, _batch

FAMILY_NAMES = decoder_only_families()  # encoder-decoder families: tests/test_seq2seq_trt.py

DEVICE = DeviceInfo("10.0.1", "Fake GPU 24GB", "8.6")


# --- shapes, names, metadata ----------------------------------------------------------------------------------------

def _gpt2_spec():
    from nndf.registry import get_spec

    return get_spec("GPT2")


def _tiny_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=50257)


def _shapes(**settings) -> ShapeSpec:
    return ShapeSpec.derive(BuildSettings(**settings), _gpt2_spec(), _tiny_config())


NAMES = ("input_ids", "attention_mask", "position_ids", "logits_to_keep", *past_names(2))
OUTPUTS = ("logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value")


def _request(tmp_path=Path("/w"), **overrides) -> EngineRequest:
    shape_settings = overrides.pop("shape_settings", {"input_seq_len": 8, "output_seq_len": 4})
    names = overrides.get("input_names", NAMES)
    fields = dict(stem="GPT2-gpt2-decoder", onnx_path=tmp_path / "export" / "decoder.onnx",
                  onnx_id="GPT2-gpt2-decoder-0123456789ab", input_names=names, output_names=OUTPUTS,
                  profiles=_shapes(**shape_settings).profiles(names))
    fields.update(overrides)
    return EngineRequest(**fields)


def test_profiles_from_flags_context_and_generation():
    shapes = _shapes(batch_size=2, num_beams=2, input_seq_len=8, output_seq_len=4)
    context, generation = shapes.profiles(NAMES)
    assert context["input_ids"] == ((4, 1), (4, 8), (4, 8))
    assert context["past_key_values.0.key"] == ((4, 2, 0, 16),) * 3
    assert generation["input_ids"] == ((4, 1),) * 3
    assert generation["attention_mask"] == ((4, 2), (4, 12), (4, 12))
    assert generation["past_key_values.1.value"] == ((4, 2, 1, 16), (4, 2, 11, 16), (4, 2, 11, 16))
    dynamic = _shapes(batch_size=2, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=6)
    ctx, gen = dynamic.profiles(NAMES)
    assert [d[0] for d in ctx["input_ids"]] == [1, 2, 6] and [d[0] for d in gen["past_key_values.0.key"]] == [1, 2, 6]
    assert ctx["input_ids"][2][1] == 128  # no --input-seq-len: the model's positions
    (whole,) = _shapes(use_cache=False, input_seq_len=8, output_seq_len=4).profiles(NAMES[:4])
    assert whole["input_ids"] == ((1, 1), (1, 12), (1, 12))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dynamic_batch=True, min_dynamic_batch=4, max_dynamic_batch=2), "--min-dynamic-batch (4) must not exceed"),
    (dict(batch_size=8, dynamic_batch=True, max_dynamic_batch=4), "--batch-size 8 must lie within"),
    (dict(num_beams=0), "--num-beams must be at least 1"),
])
def test_build_flags_are_validated(kwargs, message):
    with pytest.raises(UsageError) as error:
        BuildSettings(**kwargs)
    assert str(error.value).startswith(message)


def test_sequence_flags_are_checked_against_positions():
    with pytest.raises(UsageError, match="more than the 128 positions"):
        _shapes(input_seq_len=100, output_seq_len=100)


def test_engine_name_carries_precision_hash_and_postfix():
    request = _request(postfix="-mine")
    path = engine_cache.engine_path("/w", request, DEVICE)
    assert path.parent == Path("/w") and path.name.startswith("GPT2-gpt2-decoder-tf32-") and path.name.endswith("-mine.engine")
    assert engine_cache.engine_path("/w", _request(fp16=True), DEVICE).name.startswith("GPT2-gpt2-decoder-fp16-")
    settings = engine_cache.engine_settings(request, DEVICE)
    assert settings["tensorrt_version"] == "10.0.1" and settings["gpu_name"] == "Fake GPU 24GB"
    assert settings["compute_capability"] == "8.6" and settings["profiles"] == json.loads(json.dumps(request.profiles))
    others = {
        engine_cache.engine_path("/w", request, dataclasses.replace(DEVICE, tensorrt_version="10.3.0")),
        engine_cache.engine_path("/w", request, dataclasses.replace(DEVICE, gpu_name="NVIDIA L4")),
        engine_cache.engine_path("/w", request, dataclasses.replace(DEVICE, compute_capability="8.9")),
        engine_cache.engine_path("/w", _request(preview_dynamic_shapes=False, postfix="-mine"), DEVICE),
        engine_cache.engine_path(
            "/w", _request(shape_settings={"input_seq_len": 8, "output_seq_len": 5}, postfix="-mine"), DEVICE),
    }
    assert len(others) == 5 and path not in others


def test_engine_postfix_is_checked():
    with pytest.raises(UsageError, match="--engine-postfix 'a/b' may contain only"):
        engine_cache.engine_path("/w", _request(postfix="a/b"), DEVICE)


def _fake_engine_file(path: Path, request: EngineRequest, device: DeviceInfo, content: str = "engine") -> Path:
    write_artifact(path, lambda tmp: tmp.write_text(content), engine_cache.engine_settings(request, device))
    return path


def test_engine_stale_reasons(tmp_path):
    request = _request(tmp_path)
    expected = engine_cache.engine_settings(request, DEVICE)
    path = engine_cache.engine_path(tmp_path, request, DEVICE)
    assert engine_cache.engine_stale_reason(path, expected) == "it does not exist yet"
    _fake_engine_file(path, request, DEVICE)
    assert engine_cache.engine_stale_reason(path, expected) is None
    meta = read_metadata(path)
    metadata_path(path).write_text(json.dumps(dict(meta, tensorrt_version="8.6.1")))
    assert engine_cache.engine_stale_reason(path, expected) == \
        "it was built for TensorRT version 8.6.1, this machine has 10.0.1"
    metadata_path(path).write_text(json.dumps(dict(meta, fp16=True)))
    assert engine_cache.engine_stale_reason(path, expected) == "it was built with a different precision"
    metadata_path(path).write_text(json.dumps(meta))
    path.write_text("eng")
    assert engine_cache.engine_stale_reason(path, expected) == "its file is truncated or was changed after the build"
    metadata_path(path).unlink()
    assert engine_cache.engine_stale_reason(path, expected) == "its metadata file is missing or unreadable"


def _recording_build(calls, content="engine"):
    def build(request, path, timing_cache, metadata, report):
        calls.append((request, path, timing_cache))
        write_artifact(path, lambda tmp: tmp.write_text(content), metadata)
        return 0.0
    return build


def test_obtain_engine_builds_then_reuses_then_rebuilds_with_a_message(tmp_path):
    request, calls, messages = _request(tmp_path), [], []
    obtain = lambda device=DEVICE, **kw: engine_cache.obtain_engine(
        request, device, tmp_path, num_params=1000, free_gpu=10**9, free_host=10**9, report=messages.append,
        build=_recording_build(calls), **kw)
    path, built = obtain()
    assert built and path.is_file() and len(calls) == 1
    assert calls[0][2] == tmp_path / "timing-cache-trt10.0.1-Fake-GPU-24GB-sm86.cache"
    assert any(m.startswith("building a TensorRT engine (tf32; context: input_ids 1x1..1x8") for m in messages)
    assert any(m.startswith("engine built in") for m in messages)
    messages.clear()
    assert obtain() == (path, False) and len(calls) == 1 and messages == []
    meta = read_metadata(path)
    metadata_path(path).write_text(json.dumps(dict(meta, onnx="another export")))
    assert obtain() == (path, True) and len(calls) == 2
    assert messages[0] == f"rebuilding {path}: it was built with a different ONNX export"
    messages.clear()
    newer = dataclasses.replace(DEVICE, tensorrt_version="10.3.0")
    new_path, built = obtain(newer)
    assert built and new_path != path and len(calls) == 3
    assert messages[0] == (f"building a new engine: {path.name} has these settings but was built with TensorRT 10.0.1 "
                           "on Fake GPU 24GB (compute capability 8.6), and this machine has TensorRT 10.3.0 on "
                           "Fake GPU 24GB (compute capability 8.6)")


def test_memory_estimate_and_check():
    fp16 = engine_cache.estimate_build_memory(124_000_000, fp16=True)
    fp32 = engine_cache.estimate_build_memory(124_000_000, fp16=False)
    assert fp16.gpu_bytes == 496_000_000 and fp32.gpu_bytes == 992_000_000 and fp32.host_bytes == 1_488_000_000
    engine_cache.check_build_memory(fp32, free_gpu=2 * 1024**3, free_host=2 * 1024**3)
    engine_cache.check_build_memory(fp32, free_gpu=None, free_host=None)  # unknown: not checked
    with pytest.raises(HarnessError) as gpu:
        engine_cache.check_build_memory(engine_cache.estimate_build_memory(1_557_611_200, False), 4 * 1024**3, 10**12,
                                   "NVIDIA T4")
    assert str(gpu.value) == ("building this engine needs about 11.6 GiB of GPU memory (8 bytes per parameter) but "
                              "NVIDIA T4 has 4.0 GiB free; free GPU memory, add --fp16 (half the need) or choose a "
                              "smaller --variant")
    with pytest.raises(HarnessError, match=r"about 17.4 GiB of host memory \(12 bytes per parameter\) but only "
                                           r"8.0 GiB is available"):
        engine_cache.check_build_memory(engine_cache.estimate_build_memory(1_557_611_200, True), 10**12, 8 * 1024**3)
    assert engine_cache.available_host_memory() > 0


def test_memory_check_stops_before_the_build(tmp_path):
    calls = []
    with pytest.raises(HarnessError, match="of GPU memory"):
        engine_cache.obtain_engine(_request(tmp_path), DEVICE, tmp_path, num_params=10**9, free_gpu=10**9,
                              free_host=10**12, report=lambda m: None, build=_recording_build(calls))
    assert calls == [] and not list(tmp_path.glob("*.engine"))


def test_trtexec_command_from_the_same_profiles():
    request = _request(Path("/w"), shape_settings={"input_seq_len": 8, "output_seq_len": 4})
    command = engine_build.trtexec_command(request, "/w/e.engine", "/w/t.cache")
    kv = lambda n: ",".join(f"past_key_values.{i}.{k}:1x2x{n}x16" for i in range(2) for k in ("key", "value"))
    assert command == (
        "trtexec --onnx=/w/export/decoder.onnx --saveEngine=/w/e.engine "
        f"--profile=0 --minShapes=input_ids:1x1,attention_mask:1x1,position_ids:1x1,logits_to_keep:1,{kv(0)} "
        f"--optShapes=input_ids:1x8,attention_mask:1x8,position_ids:1x8,logits_to_keep:1,{kv(0)} "
        f"--maxShapes=input_ids:1x8,attention_mask:1x8,position_ids:1x8,logits_to_keep:8,{kv(0)} "
        f"--profile=1 --minShapes=input_ids:1x1,attention_mask:1x2,position_ids:1x1,logits_to_keep:1,{kv(1)} "
        f"--optShapes=input_ids:1x1,attention_mask:1x12,position_ids:1x1,logits_to_keep:1,{kv(11)} "
        f"--maxShapes=input_ids:1x1,attention_mask:1x12,position_ids:1x1,logits_to_keep:1,{kv(11)} "
        "--timingCacheFile=/w/t.cache"
    )
    fp16 = engine_build.trtexec_command(_request(fp16=True, tf32=False, preview_dynamic_shapes=False), "e")
    assert fp16.endswith(" --noTF32 --fp16") and "--timingCacheFile" not in fp16
    assert engine_build.trtexec_command(_request(), "e", preview_feature_available=True).endswith(
        " --preview=+fasterDynamicShapes0805")
    (whole,) = _request(shape_settings={"use_cache": False}, input_names=NAMES[:4]).profiles
    single = engine_build.trtexec_command(_request(profiles=[whole], input_names=NAMES[:4]), "e")
    assert "--profile" not in single and "--minShapes=input_ids:1x1," in single


# --- the build through Polygraphy (faked: no TensorRT here) ----------------------------------------------------------

class _FakeBuilderConfig:
    def __init__(self, create):
        self.create = create
        self.preview = {}
        self.progress_monitor = None

    def set_preview_feature(self, feature, enabled):
        self.preview[feature] = enabled


def _fake_polygraphy(result, seen):
    module = types.ModuleType("polygraphy.backend.trt")

    class Profile(dict):
        def add(self, name, min, opt, max):
            self[name] = (min, opt, max)
            return self

    class CreateConfig:
        def __init__(self, **kwargs):
            seen["create"] = kwargs

        def __call__(self, builder, network):
            return _FakeBuilderConfig(self)

    def NetworkFromOnnxPath(path):
        seen["onnx"] = path
        return lambda: ("builder", "network", "parser")

    def engine_bytes_from_network(network, config, save_timing_cache):
        seen["config"] = config("builder", "network")
        if isinstance(result, Exception):
            raise result
        Path(save_timing_cache).write_bytes(b"grown cache")
        Path(save_timing_cache + ".lock").write_bytes(b"")
        return result

    module.Profile, module.CreateConfig = Profile, CreateConfig
    module.NetworkFromOnnxPath, module.engine_bytes_from_network = NetworkFromOnnxPath, engine_bytes_from_network
    return module


def _fake_tensorrt(version="10.0.1", preview=False, progress=True):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT", NONE="NONE")
    # TensorRT 11 builds strongly typed networks only: its BuilderFlag has TF32 but no FP16 (read off its bindings)
    trt.BuilderFlag = types.SimpleNamespace(TF32="tf32", **({} if version.startswith("11.") else {"FP16": "fp16"}))
    trt.PreviewFeature = types.SimpleNamespace(**({"FASTER_DYNAMIC_SHAPES_0805": "fds"} if preview else
                                                  {"PROFILE_SHARING_0806": "ps"}))
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


@pytest.mark.parametrize("preview", [False, True], ids=["trt10", "trt8.6"])
def test_build_engine_through_polygraphy(tmp_path, monkeypatch, preview):
    seen, messages = {}, []
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt("8.6.1" if preview else "10.0.1", preview=preview,
                                                                 progress=not preview))
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", _fake_polygraphy(b"ENGINE-BYTES", seen))
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old cache")
    request = _request(tmp_path, fp16=True, preview_dynamic_shapes=False)
    path = tmp_path / "e.engine"
    engine_build.build_engine(request, path, cache, {"kind": "x"}, messages.append)
    assert path.read_bytes() == b"ENGINE-BYTES" and read_metadata(path)["kind"] == "x"
    assert read_metadata(path)["size"] == len(b"ENGINE-BYTES")
    assert cache.read_bytes() == b"grown cache"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.engine", "e.engine.meta.json", "timing.cache"]
    create = seen["create"]
    assert create["tf32"] is True and create["fp16"] is True and create["load_timing_cache"] == str(cache)
    assert [dict(p) for p in create["profiles"]] == [{k: tuple(map(tuple, v)) for k, v in prof.items()}
                                                     for prof in request.profiles]
    assert "preview_features" not in create  # TensorRT's defaults stay as they are
    assert seen["config"].preview == ({"fds": False} if preview else {})
    assert (seen["config"].progress_monitor is not None) == (not preview)
    assert seen["onnx"] == str(request.onnx_path)


@pytest.mark.parametrize("result", [None, RuntimeError("Invalid Engine. Please ensure the engine was built")],
                         ids=["returns-none", "raises"])
def test_failed_build_is_one_clear_error(tmp_path, monkeypatch, result):
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt())
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", _fake_polygraphy(result, {}))
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old cache")
    with pytest.raises(HarnessError) as error:
        engine_build.build_engine(_request(tmp_path), tmp_path / "e.engine", cache, {}, lambda m: None)
    text = str(error.value)
    assert text.startswith("TensorRT built no engine from" if result is None else
                           "building the TensorRT engine from") and "\n" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.cache"] and cache.read_bytes() == b"old cache"


def test_fp16_on_tensorrt_11_is_one_clear_error(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt("11.4.0"))
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", _fake_polygraphy(b"ENGINE-BYTES", seen))
    with pytest.raises(HarnessError, match=r"^--fp16 needs TensorRT 10: TensorRT 11.4.0 builds strongly typed"):
        engine_build.build_engine(_request(tmp_path, fp16=True), tmp_path / "e.engine", tmp_path / "c", {},
                                  lambda m: None)
    assert not seen and list(tmp_path.iterdir()) == []
    engine_build.build_engine(_request(tmp_path), tmp_path / "e.engine", tmp_path / "c", {},
                              lambda m: None)  # fp32 builds
    assert (tmp_path / "e.engine").read_bytes() == b"ENGINE-BYTES"


def test_build_without_polygraphy_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # an import of it raises ImportError
    with pytest.raises(HarnessError, match=r"needs TensorRT and Polygraphy \(tensorrt is missing\); pip install"):
        engine_build.build_engine(_request(tmp_path), tmp_path / "e.engine", tmp_path / "c", {}, lambda m: None)


def test_given_engine_must_exist_and_match_this_gpu(tmp_path):
    with pytest.raises(UsageError, match="--decoder-engine .*missing.engine does not exist"):
        engine_cache.check_given_engine(tmp_path / "missing.engine", DEVICE)
    request = _request(tmp_path)
    path = _fake_engine_file(tmp_path / "given.engine", request, dataclasses.replace(DEVICE, gpu_name="NVIDIA A100"))
    with pytest.raises(UsageError, match=r"was built with TensorRT 10.0.1 on NVIDIA A100 \(compute capability 8.6\) "
                                         r"and this machine has TensorRT 10.0.1 on Fake GPU 24GB"):
        engine_cache.check_given_engine(path, DEVICE)
    plain = tmp_path / "plain.engine"
    plain.write_bytes(b"x")  # no metadata (built elsewhere): TensorRT itself will judge it
    assert engine_cache.check_given_engine(plain, DEVICE) == plain


# --- no GPU -------------------------------------------------------------------------------------------------------

def test_no_gpu_and_no_tensorrt_messages_are_one_sentence():
    no_gpu = unavailable_reason(cuda_available=False, tensorrt_installed=False)
    assert no_gpu.startswith("the trt backend needs an NVIDIA GPU with CUDA, and none is visible to PyTorch here;")
    assert "pip install -e '.[tensorrt]'" in no_gpu
    no_trt = unavailable_reason(cuda_available=True, tensorrt_installed=False)
    assert no_trt == ("the trt backend needs TensorRT and Polygraphy, which are not installed here; on this CUDA "
                      "machine run pip install -e '.[tensorrt]' (or pip install tensorrt polygraphy)")
    for text in (no_gpu, no_trt):
        assert ". " not in text and "\n" not in text and not text.endswith(".")
    assert unavailable_reason(True, True) is None


def test_check_available_looks_for_a_device_before_tensorrt(monkeypatch):
    looked = []
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: looked.append(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(HarnessError, match="needs an NVIDIA GPU"):
        availability.check_available()
    assert looked == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(HarnessError, match="which are not installed here"):
        availability.check_available()
    assert looked == ["tensorrt"]


def test_nothing_imports_tensorrt_and_open_session_stops_without_a_device():
    code = (
        "import sys, torch\n"
        "torch.cuda.is_available = lambda: False\n"
        "import nndf, nndf.cli, nndf.model, nndf.backends.trt, nndf.export.engine_cache, nndf.export.engine_build\n"
        "import nndf.backends.trt.availability, nndf.backends.trt.engine_io, nndf.backends.trt.buffers\n"
        "import nndf.backends.trt.runner, nndf.backends.trt.fp16\n"
        "from nndf.backends import trt\n"
        "try:\n"
        "    trt.open_session(None, None, None)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'polygraphy', 'cuda', 'pycuda')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("HarnessError the trt backend needs an NVIDIA GPU"), proc.stderr
    assert lines[1] == "[]"


def _spec_with_trt(monkeypatch):
    import nndf.models.gpt2 as gpt2

    if "trt" not in gpt2.SPEC.backends:
        monkeypatch.setattr(gpt2, "SPEC", dataclasses.replace(gpt2.SPEC, backends=(*gpt2.SPEC.backends, "trt")))


def test_cli_without_gpu_prints_one_sentence(capsys, monkeypatch, tiny_gpt2_dir, tmp_path):
    from nndf.cli import main

    _spec_with_trt(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["benchmark", "GPT2", "trt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(tmp_path),
                 "--input-seq-len", "4", "--output-seq-len", "2", "--iterations", "1", "--warmup", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("error: the trt backend needs an NVIDIA GPU with CUDA, and none is visible")
    assert not any(p.suffix == ".engine" for p in tmp_path.rglob("*"))


# --- pure parts of the runner ----------------------------------------------------------------------------------------

class _DType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"DataType.{self.name}"


def test_torch_dtypes_of_engine_tensors():
    assert torch_dtype(_DType("INT32")) is torch.int32 and torch_dtype(_DType("INT64")) is torch.int64
    assert torch_dtype(_DType("HALF")) is torch.float16 and torch_dtype("DataType.FLOAT") is torch.float32
    with pytest.raises(HarnessError, match="tensor type \\(FP8\\)"):
        torch_dtype(_DType("FP8"))


def _engine_spec(shapes: ShapeSpec, names=NAMES, outputs=OUTPUTS, int32=False, onnx=""):
    ints = "INT32" if int32 else "INT64"
    return {
        "onnx": str(onnx),
        "inputs": {n: ("FLOAT" if n.startswith("past_key_values.") else ints) for n in names},
        "outputs": {n: "FLOAT" for n in outputs},
        "profiles": json.loads(json.dumps(shapes.profiles(tuple(names)))),
    }


def test_engine_io_read_and_checked_against_the_settings():
    shapes = _shapes(batch_size=2, input_seq_len=8, output_seq_len=4)
    io = EngineIO.read(FakeEngine(_engine_spec(shapes, int32=True)), _fake_tensorrt())
    assert io.inputs["input_ids"] is torch.int32 and io.inputs["past_key_values.1.key"] is torch.float32
    assert list(io.outputs) == list(OUTPUTS) and len(io.profiles) == 2
    assert io.profiles[1]["past_key_values.0.key"] == ((2, 2, 1, 16), (2, 2, 11, 16), (2, 2, 11, 16))
    required = shapes.profiles(NAMES)
    check_engine_io(io, NAMES, OUTPUTS, required, "e.engine")
    check_engine_io(io, NAMES, OUTPUTS, _shapes(batch_size=2, input_seq_len=4, output_seq_len=2).profiles(NAMES),
                    "e.engine")  # shorter sequences fit in the same engine
    with pytest.raises(UsageError, match=r"e.engine has no optimization profile for the context step of these "
                                         r"settings: input_ids needs 4x1..4x8 and the engine's profiles allow "
                                         r"2x1..2x8, 2x1..2x1"):
        check_engine_io(io, NAMES, OUTPUTS, _shapes(batch_size=4, input_seq_len=8, output_seq_len=4).profiles(NAMES),
                        "e.engine")
    with pytest.raises(UsageError, match="generation step of these settings: attention_mask needs 2x2..2x20 and "
                                         "the engine's profiles allow 2x1..2x8, 2x2..2x12"):
        check_engine_io(io, NAMES, OUTPUTS, _shapes(batch_size=2, input_seq_len=8, output_seq_len=12).profiles(NAMES),
                        "e.engine")
    with pytest.raises(UsageError, match="does not have the decoder's inputs and outputs"):
        check_engine_io(io, NAMES[:4], OUTPUTS[:1], required, "e.engine")


def test_choose_profile_context_then_generation():
    shapes = _shapes(batch_size=2, input_seq_len=8, output_seq_len=4)
    profiles = tuple({k: tuple(map(tuple, v)) for k, v in p.items()} for p in shapes.profiles(NAMES))
    kv = lambda n: {name: (2, 2, n, 16) for name in past_names(2)}
    context = {"input_ids": (2, 5), "attention_mask": (2, 5), "position_ids": (2, 5), "logits_to_keep": (1,), **kv(0)}
    step = {"input_ids": (2, 1), "attention_mask": (2, 6), "position_ids": (2, 1), "logits_to_keep": (1,), **kv(5)}
    assert choose_profile(profiles, context) == 0
    assert choose_profile(profiles, step, current=0) == 1
    assert choose_profile(profiles, step, current=1) == 1
    assert choose_profile(profiles, context, current=1) == 0
    with pytest.raises(HarnessError, match=r"no optimization profile of the engine accepts this step's shapes "
                                           r"\(input_ids \(3, 1\), past_key_values.0.key \(2, 2, 5, 16\)\)"):
        choose_profile(profiles, dict(step, input_ids=(3, 1)))


def test_staging_casts_and_keeps_addresses():
    staging = Staging(torch.device("cpu"))
    ids = torch.arange(6).view(2, 3)[:, 1:]  # int64, not contiguous
    staged = staging.stage("input_ids", ids, torch.int32)
    assert staged.dtype is torch.int32 and staged.is_contiguous() and torch.equal(staged.long(), ids)
    base = staged.data_ptr()
    for width in (1, 2, 3, 4):  # the mask grows by one per step: the buffer grows geometrically, rarely
        staging.stage("attention_mask", torch.ones(2, width, dtype=torch.long), torch.int64)
    ptrs = {staging.stage("attention_mask", torch.ones(2, w, dtype=torch.long), torch.int64).data_ptr()
            for w in (1, 2, 3, 4)}
    assert len(ptrs) == 1 and staging.stage("input_ids", ids[:1], torch.int32).data_ptr() == base
    empty = staging.view("past", (2, 2, 0, 16), torch.float32)
    fallback = torch.zeros(1)
    assert empty.shape == (2, 2, 0, 16) and trt_backend.tensor_address(empty, fallback) == fallback.data_ptr()
    assert trt_backend.tensor_address(staged, fallback) == staged.data_ptr()


def _fake_step(past: dict, new: dict, targets: dict | None):
    """What the engine does with the cache: present = concat(past, new), written into `targets` when given."""
    outputs = {}
    for i, name in enumerate(past_names(len(past) // 2)):
        layer, kind = name.split(".")[1:]
        present = torch.cat([past[name], new[name]], dim=2)
        key = present_name(int(layer), kind)
        if targets is not None:
            targets[key].copy_(present)
            outputs[key] = targets[key]
        else:
            outputs[key] = present
    return outputs


def test_ping_pong_cache_matches_kvcache_without_copies_or_allocation():
    torch.manual_seed(0)
    layers, rows, heads, dim, max_len = 2, 3, 2, 4, 10
    ours = PingPongCache(layers, rows, heads, dim, max_len)
    reference = KVCache(layers, rows, heads, dim, max_len)
    storage = ours.storage
    bases = set()
    for step, new_tokens in enumerate([4, 1, 1, 1, 1, 1]):
        pasts = ours.past_feeds()
        assert all(t.shape == (rows, heads, ours.length, dim) and t.is_contiguous() for t in pasts.values())
        bases.add(pasts["past_key_values.0.key"].storage_offset())
        new = {n: torch.randn(rows, heads, new_tokens, dim) for n in past_names(layers)}
        targets = ours.present_targets(ours.length + new_tokens)
        outputs = _fake_step(pasts, new, targets)
        assert all(outputs[n].data_ptr() == targets[n].data_ptr() for n in outputs)
        ours.store(outputs)
        reference.store(_fake_step(reference.past_feeds(), new, None))
        if step == 3:
            order = torch.tensor([2, 0, 0])
            ours.reorder(order)
            reference.reorder(order)
        assert ours.length == reference.length
        for name, value in reference.past_feeds().items():
            assert torch.equal(ours.past_feeds()[name], value)
    assert ours.storage is storage and len(bases) == 2  # two buffers, used alternately
    assert ours.owns(ours.past_feeds()) and not ours.owns(reference.past_feeds())
    with pytest.raises(HarnessError, match="the KV cache holds 10 positions and a step needs 11"):
        ours.present_targets(11)


def test_ping_pong_cache_copies_presents_from_elsewhere_and_reuses_storage():
    cache = PingPongCache(1, 2, 1, 2, 5)
    present = {"present.0.key": torch.ones(2, 1, 3, 2), "present.0.value": torch.full((2, 1, 3, 2), 2.0)}
    cache.store(present)
    assert cache.length == 3 and torch.equal(cache.past_feeds()["past_key_values.0.value"], present["present.0.value"])
    again = PingPongCache(1, 2, 1, 2, 4, storage=cache.storage)
    assert again.storage is cache.storage and again.length == 0
    bigger = PingPongCache(1, 2, 1, 2, 8, storage=cache.storage)
    assert bigger.storage is not cache.storage


def test_fidelity_and_fp16_warning():
    expected = torch.tensor([[[10.0, -2.0, 3.0], [0.0, 1.0, -20.0]]])
    close = logit_fidelity([(expected + 0.05, expected)])
    assert close.max_abs_diff == pytest.approx(0.05, abs=1e-6) and close.scale == 20.0 and close.top1_agreement == 1.0
    assert close.relative == pytest.approx(0.0025, abs=1e-7) and fp16_warning(close) is None
    far = logit_fidelity([(expected * torch.tensor([1.0, 1.0, 4.0]), expected)])
    assert far.top1_agreement == 0.5 and far.relative > FP16_LOGIT_BOUND
    assert fp16_warning(far) == (
        "warning: the fp16 engine's logits differ from fp32 PyTorch by up to 60 (300.00% of the logits' scale 20, "
        "bound 1%); top-1 agreement 50.0% over 2 positions: prefer the fp32 engine for accuracy")
    assert Fidelity(**{k: v for k, v in far.as_dict().items() if k in ("max_abs_diff", "scale", "top1_agreement",
                                                                        "positions")}) == far


def test_fp32_cpu_copy_keeps_tied_weights(tiny_gpt2_dir):
    from transformers import AutoModelForCausalLM

    half = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float16)
    copy32 = fp32_cpu_copy(half)
    assert next(copy32.parameters()).dtype is torch.float32 and next(half.parameters()).dtype is torch.float16
    assert copy32.lm_head.weight is copy32.transformer.wte.weight
    assert torch.equal(copy32.transformer.wte.weight, half.transformer.wte.weight.float())


# --- a fake TensorRT that runs the engine's ONNX graph with ONNX Runtime ---------------------------------------------

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
        return _DType({**self.spec["inputs"], **self.spec["outputs"]}[name])

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
        self.shapes, self.addresses, self.calls = {}, {}, []
        path = engine.spec["onnx"]
        if path not in _ORT_SESSIONS:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            _ORT_SESSIONS[path] = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.ort = _ORT_SESSIONS[path]
        self.vocab = int(self.ort.get_outputs()[0].shape[-1])

    def set_optimization_profile_async(self, index, stream):
        self.profile = index
        self.shapes.clear()  # as in TensorRT: shapes must be set again after a switch
        self.calls.append(("profile", index))
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.spec["profiles"][self.profile][name]
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        if name in self.engine.spec["inputs"]:
            return self.shapes[name]
        rows, new = self.shapes["input_ids"]
        if name == "logits":
            return (rows, self.shapes["logits_to_keep"][0], self.vocab)
        layer, kind = name.split(".")[1:]
        past = self.shapes[f"past_key_values.{layer}.{kind}"]
        return (past[0], past[1], past[2] + new, past[3])

    def set_tensor_address(self, name, address):
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
        return True


def _fake_build(int32=False):
    def build(request, path, timing_cache, metadata, report):
        spec = {
            "onnx": str(request.onnx_path),
            "inputs": {n: ("FLOAT" if n.startswith("past_key_values.") else "INT32" if int32 else "INT64")
                       for n in request.input_names},
            "outputs": {n: "FLOAT" for n in request.output_names},
            "profiles": json.loads(json.dumps(request.profiles)),
        }
        write_artifact(path, lambda tmp: tmp.write_text(json.dumps(spec)), metadata)
        return 0.0
    return build


class _Builds(list):
    """The engine requests built during a test (and, in `state`, how the fake builds them)."""


@pytest.fixture
def fake_gpu(monkeypatch):
    """The trt backend on this CPU with the fake TensorRT; returns the list of engine builds."""
    _spec_with_trt(monkeypatch)
    builds = _Builds()
    state = {"int32": False}

    def build(request, *args):
        builds.append(request)
        return _fake_build(state["int32"])(request, *args)

    monkeypatch.setattr(trt_backend, "check_available", lambda: None)
    monkeypatch.setattr(trt_backend, "_tensorrt", lambda: _fake_tensorrt())
    monkeypatch.setattr(trt_backend, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(trt_backend, "_device_info", lambda trt, device: DEVICE)
    monkeypatch.setattr(trt_backend, "_free_gpu_memory", lambda device: 24 * 1024**3)
    monkeypatch.setattr(engine_cache, "build_engine", build)
    builds.state = state
    return builds


def _load(tiny_gpt2_dir, work, **settings):
    settings.setdefault("use_mask", True)
    return nndf.load("GPT2", backend="trt", torch_dir=str(tiny_gpt2_dir), working_dir=str(work), device="cpu",
                     settings=BuildSettings(**settings))


@pytest.fixture(scope="module")
def reference_model(tiny_gpt2_dir):
    return nndf.load("GPT2", backend="frameworks", torch_dir=str(tiny_gpt2_dir), device="cpu")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("num_beams", [1, 2])
def test_fake_engine_tokens_equal_hf_generate(fake_gpu, tiny_gpt2_dir, onnx_work_dir, reference_model, batch,
                                              num_beams):
    model = _load(tiny_gpt2_dir, onnx_work_dir, batch_size=batch, num_beams=num_beams, input_seq_len=9,
                  output_seq_len=10)
    ids, mask = _batch(PROMPT_LENGTHS[batch])
    ours = model.generate(ids, mask, max_new_tokens=10, num_beams=num_beams)
    assert torch.equal(ours, reference_model.hf_generate(ids, mask, max_new_tokens=10, num_beams=num_beams))
    session = model.decoder.session
    assert session.name == "trt" and model.artifacts[0].endswith(".engine")
    calls = session._context.calls
    assert calls[0] == ("profile", 0) and calls[1] == ("execute", 0) and calls[2] == ("profile", 1)
    assert calls.count(("profile", 1)) == 1 and all(c == ("execute", 1) for c in calls[3:])


def _check_family_on_trt(family: str, family_dirs, work, device: str):
    """The family's tiny model on trt (batch 3 with left padding, beams 2, dynamic batch 1..3) against HF generate():
    greedy and beam search must give the same tokens. Returns the trt model."""
    settings = BuildSettings(batch_size=3, num_beams=2, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=3,
                             input_seq_len=9, output_seq_len=8, use_mask=True)
    model = nndf.load(family, backend="trt", torch_dir=str(family_dirs[family]), working_dir=str(work), device=device,
                      settings=settings)
    reference = nndf.load(family, backend="frameworks", loaded=model.loaded)
    ids, mask = _batch(PROMPT_LENGTHS[3], vocab=1000)  # within the family examples' vocabulary of 1000 ...
    ids = ids.masked_fill(mask == 0, 5)  # ... padding ids included
    for num_beams in (1, 2):
        ours = model.generate(ids, mask, max_new_tokens=8, num_beams=num_beams)
        assert torch.equal(ours, reference.hf_generate(ids, mask, max_new_tokens=8, num_beams=num_beams)), num_beams
    return model


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fake_engine_every_family_matches_hf_generate(fake_gpu, family, family_dirs, onnx_work_dir):
    """Each family's graph (BLOOM without position ids, OPT's offset, rotary, local attention) through the runner."""
    model = _check_family_on_trt(family, family_dirs, onnx_work_dir, "cpu")
    assert model.artifacts[0].endswith(".engine") and Path(model.artifacts[0]).name.startswith(family)


def test_fake_engine_dynamic_batch_and_int32_inputs(fake_gpu, tiny_gpt2_dir, tmp_path, reference_model):
    fake_gpu.state["int32"] = True
    model = _load(tiny_gpt2_dir, tmp_path, batch_size=2, dynamic_batch=True, min_dynamic_batch=1,
                  max_dynamic_batch=3, input_seq_len=9, output_seq_len=6)
    session = model.decoder.session
    assert session.io.inputs["input_ids"] is torch.int32 and session.io.inputs["attention_mask"] is torch.int32
    for lengths in ([7], [5, 9, 3], [4, 6]):
        ids, mask = _batch(lengths, seed=len(lengths))
        assert torch.equal(model.generate(ids, mask, max_new_tokens=6),
                           reference_model.hf_generate(ids, mask, max_new_tokens=6))
    with pytest.raises(HarnessError, match="no optimization profile of the engine accepts"):
        model.generate(*_batch([3, 3, 3, 3]), max_new_tokens=2)


def test_fake_engine_without_cache_and_logits(fake_gpu, tiny_gpt2_dir, tmp_path, reference_model):
    model = _load(tiny_gpt2_dir, tmp_path, use_cache=False, input_seq_len=9, output_seq_len=5)
    assert len(model.decoder.session.io.profiles) == 1
    ids, _ = _batch([9])
    assert torch.equal(model.generate(ids, max_new_tokens=5), reference_model.hf_generate(ids, max_new_tokens=5))
    with torch.no_grad():
        expected = reference_model.loaded.model(ids).logits
    assert float((model.logits(ids) - expected).abs().max()) < 1e-4


def test_fake_engine_reused_rebuilt_and_given(fake_gpu, tiny_gpt2_dir, tmp_path, capsys):
    model = _load(tiny_gpt2_dir, tmp_path, input_seq_len=8, output_seq_len=4)
    path = Path(model.artifacts[0])
    assert len(fake_gpu) == 1 and "building a TensorRT engine" in capsys.readouterr().err
    again = _load(tiny_gpt2_dir, tmp_path, input_seq_len=8, output_seq_len=4)
    assert again.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=4).shape == (1, 7)
    assert again.loaded._model is None, "the PyTorch weights were loaded although the engine was reusable"
    err = capsys.readouterr().err
    assert len(fake_gpu) == 1 and "building" not in err and "loading" not in err
    meta = read_metadata(path)
    metadata_path(path).write_text(json.dumps(dict(meta, preview_dynamic_shapes=False)))
    _load(tiny_gpt2_dir, tmp_path, input_seq_len=8, output_seq_len=4)
    assert len(fake_gpu) == 2
    assert f"rebuilding {path}: it was built with a different preview-dynamic-shapes setting" in capsys.readouterr().err
    notes = model.decoder.session.info_notes
    assert notes[0] == f"TensorRT engine: {path}" and notes[1].startswith("equivalent trtexec command: trtexec --onnx=")

    loaded = model.loaded
    given = lambda settings: nndf.model.Model(loaded, "trt", settings, BackendOptions(
        working_dir=str(tmp_path), decoder_engine=str(path)))
    ok = given(BuildSettings(input_seq_len=6, output_seq_len=4, use_mask=True))
    ids, mask = _batch([6])
    assert ok.artifacts == [str(path)] and ok.generate(ids, mask, max_new_tokens=4).shape == (1, 10)
    with pytest.raises(UsageError, match=r"--decoder-engine .* has no optimization profile for the generation step"):
        given(BuildSettings(input_seq_len=8, output_seq_len=8))
    with pytest.raises(UsageError, match="does not have the decoder's inputs and outputs"):
        given(BuildSettings(use_cache=False))
    broken = tmp_path / "broken.engine"
    broken.write_bytes(b"\x00\x01")
    with pytest.raises(HarnessError, match="TensorRT could not load --decoder-engine .*broken.engine: it was built "
                                           "by another TensorRT version"):
        nndf.model.Model(loaded, "trt", BuildSettings(), BackendOptions(decoder_engine=str(broken)))


def test_fake_fp16_engine_is_checked_against_fp32(fake_gpu, tiny_gpt2_dir, tmp_path, capsys):
    model = _load(tiny_gpt2_dir, tmp_path, fp16=True, input_seq_len=16, output_seq_len=4)
    path = Path(model.artifacts[0])
    assert "-fp16-" in path.name and fake_gpu[0].fp16
    err = capsys.readouterr().err
    assert "checking the fp16 engine's logits against fp32 PyTorch" in err and "warning" not in err
    check = read_metadata(path)["fp16_check"]
    assert check["relative"] < FP16_LOGIT_BOUND and check["positions"] == 8 + 16 and check["bound"] == 0.01
    assert engine_cache.engine_stale_reason(path, engine_cache.engine_settings(fake_gpu[0], DEVICE)) is None
    meta = read_metadata(path)
    meta["fp16_check"]["max_abs_diff"] = meta["fp16_check"]["scale"]  # as if the engine had gone wrong
    metadata_path(path).write_text(json.dumps(meta))
    _load(tiny_gpt2_dir, tmp_path, fp16=True, input_seq_len=16, output_seq_len=4)
    err = capsys.readouterr().err
    assert "checking" not in err and "warning: the fp16 engine's logits differ from fp32 PyTorch by up to" in err


def _fake_graphs(monkeypatch, session, fail=False):
    """Stand-ins for CUDA graphs: a replay runs the context with the bindings it had at capture (the graph key
    guarantees they are the current ones), so a wrong key would show as wrong tokens."""
    captured, replays = [], []

    class Graph:
        def __init__(self, bindings):
            self.bindings = bindings

        def replay(self):
            assert dict(session._context.addresses) == self.bindings
            replays.append(1)
            session._execute()

    def capture():
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(1)
        return Graph(dict(session._context.addresses))

    monkeypatch.setattr(session, "_capture", capture)
    session.stream = types.SimpleNamespace(synchronize=lambda: None, cuda_stream=0)
    session.cuda_graph = True
    return captured, replays


def test_fake_cuda_graphs_replay_the_decode_steps(fake_gpu, tiny_gpt2_dir, tmp_path, reference_model, monkeypatch):
    model = _load(tiny_gpt2_dir, tmp_path, batch_size=3, num_beams=2, dynamic_batch=True, min_dynamic_batch=1,
                  max_dynamic_batch=3, input_seq_len=9, output_seq_len=6)
    captured, replays = _fake_graphs(monkeypatch, model.decoder.session)
    ids, mask = _batch([5, 9, 3])
    for num_beams in (1, 2):
        reference = reference_model.hf_generate(ids, mask, max_new_tokens=6, num_beams=num_beams)
        assert torch.equal(model.generate(ids, mask, max_new_tokens=6, num_beams=num_beams), reference)
        captured_before, replays_before = len(captured), len(replays)
        assert torch.equal(model.generate(ids, mask, max_new_tokens=6, num_beams=num_beams), reference)
        assert len(captured) == captured_before  # the second generation only replays ...
        assert len(replays) - replays_before == 5  # ... its five decode steps
    assert len(captured) == 10


def test_fake_cuda_graph_capture_failure_falls_back(fake_gpu, tiny_gpt2_dir, tmp_path, reference_model, monkeypatch,
                                                   capsys):
    model = _load(tiny_gpt2_dir, tmp_path, input_seq_len=9, output_seq_len=6)
    _fake_graphs(monkeypatch, model.decoder.session, fail=True)
    ids, mask = _batch([7])
    assert torch.equal(model.generate(ids, mask, max_new_tokens=6),
                       reference_model.hf_generate(ids, mask, max_new_tokens=6))
    assert model.decoder.session.cuda_graph is False
    assert "warning: CUDA graph capture failed (RuntimeError: operation not permitted" in capsys.readouterr().err


# --- real TensorRT on a GPU: `python -m pytest -m gpu` ---------------------------------------------------------------

def _needs_tensorrt():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install -e '.[tensorrt]')")
    pytest.importorskip("polygraphy", reason="Polygraphy is not installed (pip install -e '.[tensorrt]')")


@pytest.fixture(scope="module")
def gpu_work(tmp_path_factory):
    return tmp_path_factory.mktemp("trt-gpu")


def _gpu_pair(tiny_gpt2_dir, work, options=None, **settings):
    """(trt model, frameworks model on the same GPU) for the tiny GPT-2."""
    _needs_tensorrt()
    from nndf.loading import load_model
    from nndf.registry import get_spec

    spec = get_spec("GPT2")
    if "trt" not in spec.backends:
        spec = dataclasses.replace(spec, backends=(*spec.backends, "trt"))
    build = BuildSettings(use_mask=True, **settings)
    loaded = load_model(spec, spec.default_variant, torch_dir=str(tiny_gpt2_dir),
                        dtype=torch.float16 if build.fp16 else torch.float32, device=torch.device("cuda"))
    options = options or BackendOptions(working_dir=str(work))
    return nndf.model.Model(loaded, "trt", build, options), nndf.model.Model(loaded, "frameworks", build)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, num_beams", [(1, 1), (3, 1), (1, 2), (3, 2)])
def test_gpu_fp32_engine_tokens_equal_hf_generate(tiny_gpt2_dir, gpu_work, batch, num_beams, monkeypatch):
    monkeypatch.setattr(trt_backend, "USE_TF32", False)  # bit-level parity needs true fp32 matrix products
    trt_model, torch_model = _gpu_pair(tiny_gpt2_dir, gpu_work, batch_size=batch, num_beams=num_beams,
                                       input_seq_len=9, output_seq_len=10)
    ids, mask = _batch(PROMPT_LENGTHS[batch])
    ours = trt_model.generate(ids, mask, max_new_tokens=10, num_beams=num_beams)
    assert torch.equal(ours, torch_model.hf_generate(ids, mask, max_new_tokens=10, num_beams=num_beams))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gpu_every_family_fp32_engine_tokens_equal_hf_generate(family, family_dirs, gpu_work, monkeypatch):
    _needs_tensorrt()
    monkeypatch.setattr(trt_backend, "USE_TF32", False)  # bit-level parity needs true fp32 matrix products
    _check_family_on_trt(family, family_dirs, gpu_work, "cuda")


@pytest.mark.gpu
def test_gpu_dynamic_batch_and_cuda_graphs(tiny_gpt2_dir, gpu_work, monkeypatch):
    monkeypatch.setattr(trt_backend, "USE_TF32", False)
    settings = dict(batch_size=2, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=3, input_seq_len=9,
                    output_seq_len=8)
    trt_model, torch_model = _gpu_pair(tiny_gpt2_dir, gpu_work, **settings)
    graphs, _ = _gpu_pair(tiny_gpt2_dir, gpu_work, BackendOptions(working_dir=str(gpu_work), cuda_graph=True),
                          **settings)
    for lengths in ([7], [5, 9, 3], [4, 6]):
        ids, mask = _batch(lengths, seed=len(lengths))
        reference = torch_model.hf_generate(ids, mask, max_new_tokens=8)
        assert torch.equal(trt_model.generate(ids, mask, max_new_tokens=8), reference)
        for _ in range(2):  # the second generation replays the graphs captured by the first
            assert torch.equal(graphs.generate(ids, mask, max_new_tokens=8), reference)
    assert graphs.decoder.session._graphs


@pytest.mark.gpu
def test_gpu_fp16_engine_logits_within_bound(tiny_gpt2_dir, gpu_work):
    trt_model, _ = _gpu_pair(tiny_gpt2_dir, gpu_work, fp16=True, input_seq_len=32, output_seq_len=8)
    session = trt_model.decoder.session
    fidelity = trt_backend.fp16_check(session, trt_model.shapes, trt_model.spec.hooks, trt_model.loaded.model)
    assert fidelity.relative <= FP16_LOGIT_BOUND, fidelity
    assert read_metadata(trt_model.artifacts[0])["fp16_check"]["relative"] <= FP16_LOGIT_BOUND


@pytest.mark.gpu
def test_gpu_engine_reused_and_given(tiny_gpt2_dir, gpu_work, capsys):
    first, _ = _gpu_pair(tiny_gpt2_dir, gpu_work, input_seq_len=8, output_seq_len=4)
    capsys.readouterr()
    again, _ = _gpu_pair(tiny_gpt2_dir, gpu_work, input_seq_len=8, output_seq_len=4)
    assert again.artifacts == first.artifacts and "building" not in capsys.readouterr().err
    given, torch_model = _gpu_pair(tiny_gpt2_dir, gpu_work, BackendOptions(decoder_engine=first.artifacts[0]),
                                   input_seq_len=8, output_seq_len=4)
    ids, mask = _batch([8])
    assert torch.equal(given.generate(ids, mask, max_new_tokens=4), first.generate(ids, mask, max_new_tokens=4))
