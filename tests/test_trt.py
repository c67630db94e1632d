"""The trt backend: whole generations.

No machine of ours has a GPU or TensorRT, so these tests run the backend against the fake `tensorrt` of
tests/fake_tensorrt.py, whose engines execute the exported ONNX graph with ONNX Runtime, reading and writing the
very buffers the runner binds by address (the fake checks what real TensorRT checks: input shapes within the
active profile, every input's shape set, output shapes from input shapes). That exercises everything but TensorRT
itself: engine reuse and rebuilds, the given-engine checks, dtype casts, the ping-pong KV cache, profile switching,
CUDA-graph bookkeeping, the fp16 check, and the shared generation loop with parity against Hugging Face
`generate()`. The engine cache and build are tests/test_trt_engines.py, the runner's pure parts
tests/test_trt_runner.py, encoder-decoder models tests/test_seq2seq_trt.py, every decoder family's tiny graph
tests/test_family_parity.py (beside its onnxrt parity, whose export it shares).

Tests marked `gpu` build real engines with TensorRT and Polygraphy; they skip without CUDA (conftest) or without
TensorRT, and run with `python -m pytest -m gpu` on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import nndf
from conftest import REPO, copy_artifact, damage_in_place, decoder_only_families, export_by_copy
from fake_tensorrt import DEVICE, fake_gpu, spec_with_trt  # noqa: F401  (fake_gpu: a fixture)
from nndf.backends import BackendOptions
from nndf.backends import trt as trt_backend
from nndf.backends.trt import FP16_LOGIT_BOUND, availability, unavailable_reason
from nndf.errors import HarnessError, UsageError
from nndf.reference import seeded_prompts
from nndf.export import engine_cache
from nndf.spec import BuildSettings
from nndf.workspace import metadata_path, read_metadata
from test_family_parity import check_family_on_trt
from test_generation_parity import PROMPT_LENGTHS, _batch

FAMILY_NAMES = decoder_only_families()  # encoder-decoder families: tests/test_seq2seq_trt.py


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
        "import nndf.backends.trt.runner, nndf.backends.trt.fp16, nndf.export.precision\n"
        "from nndf.backends import trt\n"
        "for opener in (trt.open_session, trt.open_seq2seq):\n"
        "    try:\n"
        "        opener(None, None, None)\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__, exc)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'polygraphy', 'cuda', 'pycuda')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = proc.stdout.splitlines()
    assert all(line.startswith("TrtUnavailable the trt backend needs an NVIDIA GPU") for line in lines[:2]), \
        proc.stdout + proc.stderr  # a HarnessError (exit 1) that export rewords (TrtUnavailable.instead)
    assert lines[2] == "[]"


def test_cli_without_gpu_prints_one_sentence(capsys, monkeypatch, tiny_gpt2_dir, tmp_path):
    from nndf.cli import main

    spec_with_trt(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["benchmark", "GPT2", "trt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(tmp_path),
                 "--input-seq-len", "4", "--output-seq-len", "2", "--iterations", "1", "--warmup", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("error: the trt backend needs an NVIDIA GPU with CUDA, and none is visible")
    assert not any(p.suffix == ".engine" for p in tmp_path.rglob("*"))


def _load(tiny_gpt2_dir, work, **settings):
    settings.setdefault("use_mask", True)
    return nndf.load("GPT2", backend="trt", torch_dir=str(tiny_gpt2_dir), working_dir=str(work), device="cpu",
                     settings=BuildSettings(**settings))


@pytest.fixture(scope="module")
def reference_model(tiny_gpt2_dir):
    return nndf.load("GPT2", backend="frameworks", torch_dir=str(tiny_gpt2_dir), device="cpu")


@pytest.fixture
def work(tmp_path, reference_model, onnx_work_dir) -> Path:
    """The test's own working dir (its engines are built fresh, some damaged on purpose), holding a copy of the tiny
    model's decoder export, which the shared working dir holds once per run."""
    from nndf.export.onnx import export_decoder

    copy_artifact(export_decoder(reference_model.loaded, True, onnx_work_dir).folder, tmp_path)
    return tmp_path


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


def test_fake_engine_dynamic_batch_and_int32_inputs(fake_gpu, tiny_gpt2_dir, work, reference_model):
    fake_gpu.state["int32"] = True
    model = _load(tiny_gpt2_dir, work, batch_size=2, dynamic_batch=True, min_dynamic_batch=1,
                  max_dynamic_batch=3, input_seq_len=9, output_seq_len=6)
    session = model.decoder.session
    assert session.io.inputs["input_ids"] is torch.int32 and session.io.inputs["attention_mask"] is torch.int32
    for lengths in ([7], [5, 9, 3], [4, 6]):
        ids, mask = _batch(lengths, seed=len(lengths))
        assert torch.equal(model.generate(ids, mask, max_new_tokens=6),
                           reference_model.hf_generate(ids, mask, max_new_tokens=6))
    with pytest.raises(HarnessError, match="no optimization profile of the engine accepts"):
        model.generate(*_batch([3, 3, 3, 3]), max_new_tokens=2)


def test_a_graph_damaged_at_its_recorded_size_is_rebuilt_once_before_the_build(fake_gpu, tiny_gpt2_dir, work,
                                                                              onnx_work_dir, capsys, monkeypatch):
    """An engine built from a decoder.onnx damaged in place (same size: reuse passes it) reads it first: the export is
    rebuilt once with the reason (by a copy of the intact one, `export_by_copy`), then built into an engine; a graph
    that cannot be read again, exported just now, is one sentence, the same rule as the onnxrt backend's."""
    folder = next(p for p in work.iterdir() if p.is_dir())
    damage_in_place(folder / "decoder.onnx")
    exported = export_by_copy(monkeypatch, onnx_work_dir / folder.name)
    capsys.readouterr()
    model = _load(tiny_gpt2_dir, work, input_seq_len=8, output_seq_len=4)
    err = capsys.readouterr().err
    assert f"rebuilding {folder}: onnx could not read it (DecodeError: Error parsing message" in err
    assert len(exported) == 1 and len(fake_gpu) == 1 and err.index("rebuilding") < err.rindex("building a TensorRT")
    assert model.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=4).shape == (1, 7)

    bad = work / "bad"  # a rebuild that writes a damaged graph again (a failing disk)
    bad.mkdir()
    for file in (onnx_work_dir / folder.name).iterdir():
        shutil.copy(file, bad / file.name)
    damage_in_place(bad / "decoder.onnx")
    damage_in_place(folder / "decoder.onnx")
    exported = export_by_copy(monkeypatch, bad)
    with pytest.raises(HarnessError) as caught:
        _load(tiny_gpt2_dir, work, input_seq_len=9, output_seq_len=4)  # another engine: built from the graph
    assert len(exported) == 1 and len(fake_gpu) == 1
    assert str(caught.value).startswith(f"onnx could not read {folder / 'decoder.onnx'}, exported anew just now "
                                        "(DecodeError: Error parsing message")
    assert str(caught.value).endswith("): check the disk of the working dir, and that this onnx reads what this "
                                      "torch exports")


def test_fake_engine_without_cache_and_logits(fake_gpu, tiny_gpt2_dir, onnx_work_dir, reference_model):
    model = _load(tiny_gpt2_dir, onnx_work_dir, use_cache=False, input_seq_len=9, output_seq_len=5)
    assert len(model.decoder.session.io.profiles) == 1
    ids, _ = _batch([9])
    assert torch.equal(model.generate(ids, max_new_tokens=5), reference_model.hf_generate(ids, max_new_tokens=5))
    with torch.no_grad():
        expected = reference_model.loaded.model(ids).logits
    assert float((model.logits(ids) - expected).abs().max()) < 1e-4


def test_fake_engine_reused_rebuilt_and_given(fake_gpu, tiny_gpt2_dir, work, capsys):
    model = _load(tiny_gpt2_dir, work, input_seq_len=8, output_seq_len=4)
    path = Path(model.artifacts[0])
    assert len(fake_gpu) == 1 and "building a TensorRT engine" in capsys.readouterr().err
    again = _load(tiny_gpt2_dir, work, input_seq_len=8, output_seq_len=4)
    assert again.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=4).shape == (1, 7)
    assert again.loaded._model is None, "the PyTorch weights were loaded although the engine was reusable"
    err = capsys.readouterr().err
    assert len(fake_gpu) == 1 and "building" not in err and "loading" not in err
    meta = read_metadata(path)
    metadata_path(path).write_text(json.dumps(dict(meta, preview_dynamic_shapes=False)))
    _load(tiny_gpt2_dir, work, input_seq_len=8, output_seq_len=4)
    assert len(fake_gpu) == 2
    assert f"rebuilding {path}: it was built with a different preview-dynamic-shapes setting" in capsys.readouterr().err
    notes = model.decoder.session.info_notes
    assert notes[0] == f"TensorRT engine: {path}" and notes[1].startswith("equivalent trtexec command: trtexec --onnx=")

    loaded = model.loaded
    given = lambda settings: nndf.model.Model(loaded, "trt", settings, BackendOptions(
        working_dir=str(work), decoder_engine=str(path)))
    ok = given(BuildSettings(input_seq_len=6, output_seq_len=4, use_mask=True))
    ids, mask = _batch([6])
    assert ok.artifacts == [str(path)] and ok.generate(ids, mask, max_new_tokens=4).shape == (1, 10)
    with pytest.raises(UsageError, match=r"--decoder-engine .* has no optimization profile for the generation step"):
        given(BuildSettings(input_seq_len=8, output_seq_len=8))
    with pytest.raises(UsageError, match="does not have the decoder's inputs and outputs"):
        given(BuildSettings(use_cache=False))
    broken = work / "broken.engine"
    broken.write_bytes(b"\x00\x01")
    with pytest.raises(HarnessError, match="TensorRT could not load --decoder-engine .*broken.engine: it was built "
                                           "by another TensorRT version"):
        nndf.model.Model(loaded, "trt", BuildSettings(), BackendOptions(decoder_engine=str(broken)))


def test_fake_fp16_engine_is_checked_against_fp32(fake_gpu, tiny_gpt2_dir, work, capsys):
    model = _load(tiny_gpt2_dir, work, fp16=True, input_seq_len=16, output_seq_len=4)
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
    _load(tiny_gpt2_dir, work, fp16=True, input_seq_len=16, output_seq_len=4)
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
            assert not session._context.resources_pending, "replayed before an enqueue after a profile switch"
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


def test_fake_cuda_graphs_replay_the_decode_steps(fake_gpu, tiny_gpt2_dir, work, reference_model, monkeypatch):
    model = _load(tiny_gpt2_dir, work, batch_size=3, num_beams=2, dynamic_batch=True, min_dynamic_batch=1,
                  max_dynamic_batch=3, input_seq_len=9, output_seq_len=6)
    captured, replays = _fake_graphs(monkeypatch, model.decoder.session)
    ids, mask = _batch([5, 9, 3])
    for num_beams in (1, 2):
        reference = reference_model.hf_generate(ids, mask, max_new_tokens=6, num_beams=num_beams)
        assert torch.equal(model.generate(ids, mask, max_new_tokens=6, num_beams=num_beams), reference)
        captured_before, replays_before = len(captured), len(replays)
        assert torch.equal(model.generate(ids, mask, max_new_tokens=6, num_beams=num_beams), reference)
        assert len(captured) == captured_before  # the second generation only replays ...
        # ... its decode steps after the first, which follows the switch from the prompt's profile and runs normally
        assert len(replays) - replays_before == 4
    assert len(captured) == 8


def test_a_refused_profile_switch_is_one_sentence(fake_gpu, tiny_gpt2_dir, work):
    """TensorRT 10's binding raises RuntimeError where the switch fails (it never returns False)."""
    session = _load(tiny_gpt2_dir, work, input_seq_len=9, output_seq_len=6).decoder.session
    with pytest.raises(HarnessError, match="TensorRT refused to switch to optimization profile 7: Error in set"):
        session._set_profile(7)


def test_fake_cuda_graph_capture_failure_falls_back(fake_gpu, tiny_gpt2_dir, work, reference_model, monkeypatch,
                                                   capsys):
    model = _load(tiny_gpt2_dir, work, input_seq_len=9, output_seq_len=6)
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
    check_family_on_trt(family, family_dirs, gpu_work, "cuda")


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
    shapes = trt_model.shapes
    batches = [(ids,) for ids in seeded_prompts(shapes.rows.min, shapes.prompt.max, shapes.vocab_size)]
    fidelity = trt_backend.fp16_check(trt_model.decoder, trt_model.loaded.model, batches)
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
