"""The onnxrt backend: the same tokens as Hugging Face generate(), logits within 1e-4 of PyTorch, and exports
that are reused only when they match the request."""

from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

import pytest
import torch

import nndf
from conftest import copy_artifact, damage_in_place, export_by_copy
from nndf.errors import UsageError
from nndf.workspace import metadata_path, read_metadata, stale_reason
from test_generation_parity import PROMPT_LENGTHS, _batch


@pytest.fixture(scope="module", params=[True, False], ids=["cache", "no-cache"])
def pair(request, tiny_gpt2_dir, onnx_work_dir):
    """(onnxrt model, frameworks model) on the same tiny weights."""
    kwargs = dict(torch_dir=str(tiny_gpt2_dir), use_cache=request.param, working_dir=str(onnx_work_dir), device="cpu")
    return nndf.load("GPT2", backend="onnxrt", **kwargs), nndf.load("GPT2", backend="frameworks", **kwargs)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("num_beams", [1, 2, 4])
def test_onnxrt_tokens_equal_hf_generate(pair, batch, num_beams):
    onnx_model, torch_model = pair
    ids, mask = _batch(PROMPT_LENGTHS[batch])
    ours = onnx_model.generate(ids, mask, max_new_tokens=10, num_beams=num_beams)
    reference = torch_model.hf_generate(ids, mask, max_new_tokens=10, num_beams=num_beams)
    assert torch.equal(ours, reference)


def test_onnxrt_logits_within_1e4_of_pytorch(pair):
    onnx_model, torch_model = pair
    ids, _ = _batch([17], seed=5)
    with torch.no_grad():
        expected = torch_model.loaded.model(ids).logits
    got = onnx_model.logits(ids)
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) < 1e-4


def test_plain_run_and_io_binding_agree(tiny_gpt2_dir, onnx_work_dir):
    ids, mask = _batch([5, 9, 3])
    outputs = []
    for io_binding in (True, False):
        m = nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                      device="cpu")
        m.decoder.session.io_binding = io_binding
        outputs.append(m.generate(ids, mask, max_new_tokens=6, num_beams=2))
    assert torch.equal(outputs[0], outputs[1])


def _shared_export(tiny_gpt2_dir, onnx_work_dir) -> Path:
    """The folder of the tiny GPT-2's default export (with cache) in the session's shared working dir."""
    m = nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                  device="cpu")
    return Path(m.artifacts[0]).parent


def test_export_is_reused_then_rebuilt_when_stale_or_truncated(tiny_gpt2_dir, onnx_work_dir, tmp_path, capsys):
    # damaged in a working dir of its own (other tests read the shared one): a copy of the shared export
    folder = copy_artifact(_shared_export(tiny_gpt2_dir, onnx_work_dir), tmp_path)
    capsys.readouterr()
    load = lambda: nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(tmp_path),
                             device="cpu")
    graph = folder / "decoder.onnx"
    stamp = graph.stat().st_mtime_ns
    load()
    assert "exporting" not in capsys.readouterr().err and graph.stat().st_mtime_ns == stamp

    # A truncated data file makes the export stale (a load rebuilds it with this reason: end to end in
    # test_quantize.py and test_seq2seq.py, through the same `stale_reason`); one rebuild below covers both cases.
    data = next(p for p in folder.iterdir() if p.name != "decoder.onnx")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    assert stale_reason(folder, read_metadata(folder)) == f"{data.name} is missing or truncated"

    meta_file = metadata_path(folder)
    meta = json.loads(meta_file.read_text())
    meta["versions"]["torch"] = "0.0.1"  # foreign: built by another torch
    meta_file.write_text(json.dumps(meta))
    load()
    err = capsys.readouterr().err
    assert "rebuilding" in err and "it was built with a different versions" in err
    assert json.loads(meta_file.read_text())["versions"]["torch"] == torch.__version__
    assert stale_reason(folder, read_metadata(folder)) is None
    m = load()
    assert "exporting" not in capsys.readouterr().err
    assert m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2).shape == (1, 5)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "no temporary folder left behind"


def test_a_graph_damaged_at_its_recorded_size_is_rebuilt_once_then_one_sentence(tiny_gpt2_dir, onnx_work_dir,
                                                                               tmp_path, capsys, monkeypatch):
    """Reuse checks sizes and settings, not bytes: a decoder.onnx overwritten in place (same size) passes them, and
    ONNX Runtime's load is what finds it. The export is rebuilt once, with the reason; when a rebuilt graph cannot
    be loaded either, one sentence, not ONNX Runtime's traceback."""
    from nndf.backends import onnxrt
    from nndf.errors import HarnessError

    clean = _shared_export(tiny_gpt2_dir, onnx_work_dir)
    folder = copy_artifact(clean, tmp_path)
    graph = folder / "decoder.onnx"
    damage_in_place(graph)
    assert stale_reason(folder, read_metadata(folder)) is None
    exported = export_by_copy(monkeypatch, clean)  # the rebuild, without tracing the model again
    capsys.readouterr()
    load = lambda: nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(tmp_path),
                             device="cpu")
    m = load()
    err = capsys.readouterr().err
    assert f"rebuilding {folder}: ONNX Runtime could not load it (" in err and "exporting" in err
    assert len(exported) == 1
    assert m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2).shape == (1, 5)

    def never_loads(graph, *args, **kwargs):
        raise onnxrt.GraphLoadError(Path(graph), RuntimeError("Load model failed:Protobuf parsing failed."))

    rebuilt = []
    monkeypatch.setattr(onnxrt, "_open_exported", lambda *args: rebuilt.append(1) or never_loads(graph))
    with pytest.raises(HarnessError) as caught:
        load()
    assert len(rebuilt) == 2 and not folder.exists()
    assert str(caught.value) == (f"ONNX Runtime could not load {graph}, exported anew just now (Protobuf parsing "
                                 "failed): check the disk of the working dir, and that this onnxruntime runs what "
                                 "this torch exports")


def test_changed_weights_get_their_own_export(tiny_gpt2_dir, onnx_work_dir, tmp_path, capsys, monkeypatch):
    """A checkpoint whose weights changed in place is exported anew, never served the export of the weights it had:
    the export's name changes with the files, and the trace is intercepted (the export itself is tested above), so
    only which weights reach it is checked."""
    from safetensors.torch import load_file, save_file

    import nndf.export.onnx as onnx_export

    changed = tmp_path / "changed"
    shutil.copytree(tiny_gpt2_dir, changed)
    location = lambda: onnx_export.decoder_export_location(
        nndf.load("GPT2", torch_dir=str(changed), device="cpu").loaded, True, tmp_path).folder
    before = location()
    weights = load_file(changed / "model.safetensors")
    weights = {name: tensor + 0.01 if name.endswith("ln_f.weight") else tensor for name, tensor in weights.items()}
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    assert location() != before
    work = tmp_path / "work"
    work.mkdir()
    shared = _shared_export(tiny_gpt2_dir, onnx_work_dir)
    copy_artifact(shared, work)  # the original's, as if exported here
    capsys.readouterr()
    traced = []

    class Traced(Exception):
        """Raised by the stand-in trace below: the weights it saw are all the test needs, not an export."""

    def trace(wrapper, *args, **kwargs):
        traced.append(float(wrapper.model.transformer.ln_f.weight[0].detach()))
        raise Traced

    monkeypatch.setattr(onnx_export, "trace_to_onnx", trace)
    nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(work), device="cpu")
    assert traced == [] and "to ONNX (" not in capsys.readouterr().err  # the original's export is reused
    with pytest.raises(Traced):
        nndf.load("GPT2", backend="onnxrt", torch_dir=str(changed), working_dir=str(work), device="cpu")
    assert traced == [pytest.approx(float(weights["transformer.ln_f.weight"][0]))]  # the changed weights are traced
    assert sorted(p.name for p in work.iterdir()) == [shared.name, metadata_path(shared).name], \
        "the failed export leaves nothing behind"


def test_decoder_onnx_runs_a_given_file_after_checking_names(tiny_gpt2_dir, onnx_work_dir, tmp_path):
    given = _shared_export(tiny_gpt2_dir, onnx_work_dir) / "decoder.onnx"  # built here when run alone
    m = nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), decoder_onnx=str(given), device="cpu",
                  working_dir=str(tmp_path))
    assert m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3).shape == (1, 6)
    assert list(tmp_path.iterdir()) == [], "a given file is run as it is, nothing is exported"
    with pytest.raises(UsageError, match=r"does not have the decoder's inputs and outputs: \d+ tensors expected, "
                                         r"\d+ found; not expected past_key_values.0.key, .* and \d+ more$"):
        nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), decoder_onnx=str(given), use_cache=False,
                  device="cpu")
    with pytest.raises(UsageError, match="does not exist"):
        nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), decoder_onnx=str(tmp_path / "x.onnx"),
                  device="cpu")
    with pytest.raises(UsageError, match=r"is a folder; it takes the .onnx file itself \(this folder holds "
                                         r"decoder.onnx\)$"):
        nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), decoder_onnx=str(given.parent),
                  device="cpu")


def test_a_given_graph_of_another_models_sizes_is_refused_before_it_runs(tiny_gpt2_dir, tmp_path):
    """Same tensor names, other sizes (another model of the family): one sentence at the load, where ONNX Runtime
    failed in the middle of the first run with "Got invalid dimensions for input"."""
    import onnx
    from onnx import TensorProto, helper

    past = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch", 4, "cache", 24])
    present = helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", 4, "cache", 24])
    graph = helper.make_graph([helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"])], "other",
                              [past], [present])
    onnx.save(helper.make_model(graph, ir_version=10), tmp_path / "other.onnx")
    with pytest.raises(UsageError, match=r"decoder_onnx=.*other.onnx. is another model's graph: its "
                                         r"past_key_values.0.key has KV heads of 4 where tiny-gpt2 has 2$"):
        nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), decoder_onnx=str(tmp_path / "other.onnx"),
                  device="cpu")


def test_onnxrt_fp16_needs_the_cuda_provider(tiny_gpt2_dir, tmp_path):
    """fp16 graphs are for ONNX Runtime's CUDA provider (tests/test_seq2seq.py checks the conversion on the CPU)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the fp16 path runs there")
    with pytest.raises(UsageError, match="fp16=True on the onnxrt backend needs ONNX Runtime's CUDA provider"):
        nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), fp16=True, device="cpu",
                  working_dir=str(tmp_path))


def test_a_built_export_runs_without_loading_the_pytorch_weights(tiny_gpt2_dir, onnx_work_dir, capsys):
    nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir), device="cpu")
    capsys.readouterr()
    m = nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                  device="cpu")
    out = m.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=4)
    assert out.shape == (1, 7)
    assert m.loaded._model is None, "the PyTorch weights were loaded although the export was reusable"
    assert "loading" not in capsys.readouterr().err


@pytest.mark.parametrize("omp, given, expected", [("1", None, 1), ("3", 2, 2), ("", None, 0), ("all", None, 0)])
def test_sessions_take_omp_num_threads_as_pytorch_does(tiny_gpt2_dir, onnx_work_dir, monkeypatch, omp, given,
                                                      expected):
    """Without --threads, ONNX Runtime gets OMP_NUM_THREADS where it is a count, as PyTorch does, so that a run's
    two runtimes get the same threads; --threads wins; otherwise ONNX Runtime's own default (0: one per core)."""
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    model = nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                      device="cpu", threads=given)
    assert model.decoder.session.session.get_session_options().intra_op_num_threads == expected


def test_sessions_leave_the_cores_idle_once_a_generation_returns(tiny_gpt2_dir, onnx_work_dir):
    """ONNX Runtime's worker threads spin for about 100 ms after each run by default, slowing whatever runs next
    (another session, PyTorch, another process: nndf.backends.ort_runtime). Ours stop when a run returns: the
    process uses no CPU while it sleeps right after a generation (with ONNX Runtime's default: 30-40 ms in 0.3 s)."""
    model = nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                      device="cpu", threads=2)
    prompt = torch.tensor([[10, 20, 30] * 10])

    def cpu_seconds() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    used = []
    for _ in range(3):
        model.generate(prompt, max_new_tokens=4)
        before = cpu_seconds()
        time.sleep(0.3)
        used.append(cpu_seconds() - before)
    assert min(used) < 0.01, f"the process used {used} s of CPU while idle after a generation"
