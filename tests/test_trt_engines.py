"""The trt backend's engines, without a GPU: the shapes and profiles they are built for, their names and metadata,
reuse and rebuilds, the memory check, the build through Polygraphy (faked: no TensorRT here), the trtexec command
and the checks of a given engine file. The runner is tests/test_trt_runner.py (its pure parts) and tests/test_trt.py
(whole generations against the fake TensorRT of tests/fake_tensorrt.py).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest

from fake_tensorrt import DEVICE, fake_polygraphy, fake_tensorrt
from nndf.errors import HarnessError, UsageError
from nndf.export import engine_build, engine_cache
from nndf.export.engine_cache import DeviceInfo
from nndf.export.engine_request import EngineRequest
from nndf.kvcache import past_names
from nndf.measure import available_host_memory
from nndf.spec import BuildSettings, ShapeSpec
from nndf.workspace import artifact_lock, metadata_path, read_metadata, write_artifact


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
    (dict(dynamic_batch=True, min_dynamic_batch=4, max_dynamic_batch=2), "min_dynamic_batch (4) must not exceed"),
    (dict(batch_size=8, dynamic_batch=True, max_dynamic_batch=4), "batch_size=8 must lie within"),
    (dict(num_beams=0), "num_beams must be at least 1"),
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
        engine_cache.engine_path("/w", _request(fp32_layers=("node_linear_7",), postfix="-mine"), DEVICE),
        engine_cache.engine_path(
            "/w", _request(shape_settings={"input_seq_len": 8, "output_seq_len": 5}, postfix="-mine"), DEVICE),
    }
    assert len(others) == 6 and path not in others


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
    assert engine_cache.engine_stale_reason(path, expected) == "its file is truncated or was changed after it was built"
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


def test_obtain_engine_waits_for_another_build_of_the_same_engine(tmp_path):
    """While another process (here a thread with its own lock file handle: flock tells them apart the same way)
    builds the engine, obtain_engine waits, says so, and then reuses that engine instead of building it again."""
    request, calls, messages = _request(tmp_path), [], []
    path = engine_cache.engine_path(tmp_path, request, DEVICE)
    holding = threading.Event()

    def other_builder():
        with artifact_lock(path):
            holding.set()
            time.sleep(1.5)
            _fake_engine_file(path, request, DEVICE, "built by the other")

    other = threading.Thread(target=other_builder)
    other.start()
    assert holding.wait(30)
    got = engine_cache.obtain_engine(request, DEVICE, tmp_path, num_params=1000, free_gpu=10**9, free_host=10**9,
                                     report=messages.append, build=_recording_build(calls))
    other.join()
    assert got == (path, False) and calls == [] and path.read_text() == "built by the other"
    assert messages == [f"waiting for another process that is building {path} ..."]


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
    assert available_host_memory() > 0


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
    pinned = engine_build.trtexec_command(_request(fp16=True, fp32_layers=("node_a", "node_b")), "e")
    assert pinned.endswith(" --fp16 --precisionConstraints=obey --layerPrecisions=node_a:fp32,node_b:fp32 "
                           "--layerOutputTypes=node_a:fp32,node_b:fp32")
    assert "--layerPrecisions" not in engine_build.trtexec_command(_request(fp32_layers=("node_a",)), "e")
    assert engine_build.trtexec_command(_request(), "e", preview_feature_available=True).endswith(
        " --preview=+fasterDynamicShapes0805")
    quantized = engine_build.trtexec_command(_request(int8=True, workspace_mib=2048), "e")
    assert quantized.endswith(" --int8 --memPoolSize=workspace:2048M") and "--fp16" not in quantized
    (whole,) = _request(shape_settings={"use_cache": False}, input_names=NAMES[:4]).profiles
    single = engine_build.trtexec_command(_request(profiles=[whole], input_names=NAMES[:4]), "e")
    assert "--profile" not in single and "--minShapes=input_ids:1x1," in single


# --- the build through Polygraphy (faked: no TensorRT here) ----------------------------------------------------------

@pytest.mark.parametrize("preview", [False, True], ids=["trt10", "trt8.6"])
def test_build_engine_through_polygraphy(tmp_path, monkeypatch, preview):
    seen, messages = {}, []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("8.6.1" if preview else "10.0.1", preview=preview,
                                                                 progress=not preview))
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", fake_polygraphy(b"ENGINE-BYTES", seen))
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


@pytest.mark.parametrize("version", ["10.0.1", "11.1.0"])
def test_int8_and_the_workspace_reach_polygraphy(tmp_path, monkeypatch, version):
    """convert's -q (a Q/DQ graph) sets TensorRT 10's INT8 flag (TensorRT 11 has none: strongly typed), and -w
    the workspace pool; both name the engine (a request without them keeps its name)."""
    seen = {}
    trt = fake_tensorrt(version)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", fake_polygraphy(b"ENGINE-BYTES", seen))
    request = _request(tmp_path, int8=True, workspace_mib=512)
    engine_build.build_engine(request, tmp_path / "e.engine", tmp_path / "c", {}, lambda m: None)
    create = seen["create"]
    assert create.get("int8") is (True if version.startswith("10.") else None) and create["fp16"] is False
    assert create["memory_pool_limits"] == {trt.MemoryPoolType.WORKSPACE: 512 << 20}
    plain = engine_cache.engine_path(tmp_path, _request(tmp_path), DEVICE).name
    assert "-int8-" in engine_cache.engine_path(tmp_path, request, DEVICE).name and "-tf32-" in plain
    assert engine_cache.engine_path(tmp_path, _request(tmp_path, workspace_mib=512), DEVICE).name != plain
    assert "int8" not in engine_cache.engine_settings(_request(tmp_path), DEVICE)


@pytest.mark.parametrize("result", [None, RuntimeError("Invalid Engine. Please ensure the engine was built")],
                         ids=["returns-none", "raises"])
def test_failed_build_is_one_clear_error(tmp_path, monkeypatch, result):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", fake_polygraphy(result, {}))
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
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("11.4.0"))
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", fake_polygraphy(b"ENGINE-BYTES", seen))
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


def test_info_without_a_gpu_shows_every_engine_before_refusing(capsys, tiny_gpt2_dir, onnx_work_dir, monkeypatch,
                                                                tmp_path):
    """On a machine without a GPU, `--info` on trt prints the settings, each graph's profiles and trtexec command,
    then refuses in one sentence (exit 1); no weights are loaded, and the ONNX file named is the one that the
    export command it prints writes (with the growing KV layout: TensorRT has no ONNX Runtime contrib ops, so trt
    builds from that graph whatever onnxrt's default layout is)."""
    import torch

    import nndf.actions.export as export_action
    from nndf.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is present
    model = ["--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(onnx_work_dir)]
    code = main(["benchmark", "GPT2", "trt", *model, "--input-seq-len", "8", "--output-seq-len", "4", "--info"])
    out, err = capsys.readouterr()
    assert code == 1 and err.startswith("error: the trt backend needs an NVIDIA GPU") and "loading" not in err
    assert "settings: batch_size=1" in out and "context: input_ids 1x1..1x8" in out
    command = next(line for line in out.splitlines() if line.startswith("decoder: trtexec --onnx="))
    assert "--profile=1" in command and "--maxShapes=input_ids:1x8" in command
    onnx_path = command.split("--onnx=")[1].split()[0]
    # the export command printed is one that export accepts (not "the same flags": it refuses the length flags
    # given here), and it writes the very file the trtexec command reads
    hint = " ".join(out.split()).split("The ONNX files they read are written on any machine by: ")[1]
    export = shlex.split(hint)
    assert export[:3] == ["python", "run.py", "export"] and "--input-seq-len" not in export
    assert main(export[2:]) == 0
    assert onnx_path in capsys.readouterr().out
    # with the flags export refuses or that conflict with its layout, the command still runs as printed
    main(["benchmark", "GPT2", "trt", *model, "--no-use-cache", "--num-beams", "2", "--fp16", "--dynamic-batch",
          "--engine-postfix", "x", "--info"])
    out = capsys.readouterr().out
    export = shlex.split(" ".join(out.split()).split("written on any machine by: ")[1])
    assert export[2:] == ["export", "GPT2", "onnxrt", *model, "--no-use-cache"]

    class Loading(Exception):
        """Every check of the command line and of the action passed: the model would load now."""

    monkeypatch.setattr(export_action, "open_models", lambda args, **_: (_ for _ in ()).throw(Loading()))
    with pytest.raises(Loading):
        main(export[2:])
    # T5 in fp16 (its feed-forward outputs stay fp32: named from the graph once it is exported, said until then)
    for family, variant, first, extra in (("T5", "t5-small", "encoder: trtexec --onnx=", ["--fp16"]),
                                          ("BLIP", "blip-image-captioning-base", "encoder: trtexec --onnx=", [])):
        code = main(["benchmark", family, "trt", "--variant", variant, "--random-weights", "--info", *extra,
                     "--working-dir", str(tmp_path)])
        out, err = capsys.readouterr()
        assert code == 1 and "needs an NVIDIA GPU" in err, err
        assert first in out and "\ncross: trtexec" in out and "\ndecoder: trtexec" in out
        if family == "T5":
            encoder = next(line for line in out.splitlines() if line.startswith(first))
            assert encoder.endswith(" --fp16 (any layers of DenseReluDense.wo in this graph stay fp32 in the build; "
                                    "their names join the command once the graph is exported)")
    assert "pixel_values 1x3x384x384..1x3x384x384" in out  # BLIP's fixed image size
