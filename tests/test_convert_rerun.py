"""convert_model run again into the same -o (issue 12): -o holds what the last run wrote, and nothing of an earlier
run's that a Triton server would go on serving; the user's own files stay."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fake_tensorrt import DEVICE, fake_gpu  # noqa: F401  (fake_gpu: a fixture)
from test_convert import _tiny_classifier

from nndf.convert.cli import main as convert_model

FAST = ["--nb-measures", "3", "--warmup", "1"]


def _listing(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


def test_a_rerun_leaves_only_what_it_wrote(fake_gpu, minilm_dir, tmp_path, capsys):  # noqa: F811
    """An ONNX run after a TensorRT one left transformer_tensorrt_* in -o, which Triton loads and serves: the old
    plan, under the old names; its engine and timing cache stayed too. A run without -q after one with it left
    model-int8.onnx beside the new graphs. A --backend pytorch run writes nothing and leaves -o alone."""
    from nndf.convert.cli import run
    from nndf.convert.options import parse
    from nndf.export.engine_cache import timing_cache_path

    model = _tiny_classifier(tmp_path / "bert")
    out = tmp_path / "out"
    argv = ["-m", str(model), "-t", str(minilm_dir), "-o", str(out), "-d", "cpu", "-s", "2", "8", "24",
            "--atol", "1e-4", *FAST]
    run(dataclasses.replace(parse(argv), backends=("onnx", "tensorrt")))  # parse() wants a real GPU for tensorrt
    timing_cache_path(out, DEVICE).write_bytes(b"cache")  # as TensorRT's builder leaves it (the fake does not)
    engines = sorted(p.name for p in out.glob("transformer-fp16-*.engine*"))
    assert len(engines) == 2  # the plan and its metadata
    # the user's files, another model served from the same repository, and an engine of another name
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "data.csv").write_text("1,2")
    (out / "other_onnx_model" / "1").mkdir(parents=True)
    (out / "other_onnx_model" / "config.pbtxt").write_text('name: "other_onnx_model"')
    (out / "transformer-x-fp16-0123456789ab.engine").write_text("another model's engine")
    users = {"notes.txt", "mine", "other_onnx_model", "transformer-x-fp16-0123456789ab.engine"}

    assert convert_model([*argv, "-q", "--atol", "0.3"]) == 0
    served = {f"transformer_onnx_{role}" for role in ("tokenize", "model", "inference")}
    graphs = {"model-original.onnx", "model.onnx"}
    assert _listing(out) == graphs | {"model-int8.onnx"} | served | users
    assert "transformer_tensorrt_model" in capsys.readouterr().err  # said, with the rest that went

    assert convert_model(argv) == 0
    assert _listing(out) == graphs | served | users
    assert (out / "transformer_onnx_model" / "1" / "model.onnx").read_bytes() == (out / "model.onnx").read_bytes()

    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert convert_model([*argv, "--backend", "pytorch"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_what_counts_as_convert_s_own(tmp_path):
    """Only what convert writes for this -n goes: the graphs, this name's engines with their metadata, timing
    caches, and this name's Triton model folders where they are models (a folder of other files is the user's, as
    `check_model_folders` has it); never another name's, nor anything else."""
    from nndf.convert.outputs import remove_stale, written_by_convert

    out = tmp_path / "out"
    ours = ["model-original.onnx", "model-qdq.onnx", "timing-cache-trt10-GPU-sm86.cache",
            "transformer-int8-0123456789ab.engine", "transformer-int8-0123456789ab.engine.meta.json"]
    theirs = ["model.onnx.bak", "transformer-x-fp16-0123456789ab.engine", "transformer-fp16-notahash.engine",
              "other-fp16-0123456789ab.engine", "transformer_onnx_model.txt"]
    for name in ours + theirs:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    for folder, marker in (("transformer_tensorrt_model", "config.pbtxt"), ("transformer_onnx_tokenize", None),
                           ("transformer_tensorrt_inference", "notes.md"), ("other_tensorrt_model", "config.pbtxt")):
        (out / folder).mkdir()
        if marker:
            (out / folder / marker).write_text("x")
    expected = set(ours) | {"transformer_tensorrt_model", "transformer_onnx_tokenize"}  # a model, an empty folder
    assert {p.name for p in written_by_convert(out, "transformer")} == expected
    kept = [out / "model-original.onnx", out / "transformer-int8-0123456789ab.engine"]  # its metadata stays too
    assert {p.name for p in remove_stale(out, "transformer", kept)} == expected - {
        "model-original.onnx", "transformer-int8-0123456789ab.engine", "transformer-int8-0123456789ab.engine.meta.json"}
    assert _listing(out) == set(theirs) | {"model-original.onnx", "transformer-int8-0123456789ab.engine",
                                           "transformer-int8-0123456789ab.engine.meta.json",
                                           "transformer_tensorrt_inference", "other_tensorrt_model"}


def test_a_run_into_an_output_folder_another_run_is_writing_waits_for_it(minilm_dir, tmp_path, capsys, monkeypatch):
    """The graph files have fixed names whatever -n says: two runs into one -o at once interleaved their writes (one
    run's Triton model could serve the other's graph). A run now waits, says so, and writes its set whole once the
    other has finished."""
    import threading

    import nndf.convert.cli
    from nndf.convert.cli import output_lock

    model = _tiny_classifier(tmp_path / "bert")
    out = tmp_path / "out"
    holding, told, released = threading.Event(), threading.Event(), []

    def other_run():
        with output_lock(out):
            holding.set()
            told.wait(timeout=120)
            (out / "model.onnx").write_text("the other run's graph")  # its last write before it lets go
            released.append(True)

    said = nndf.convert.cli.say
    monkeypatch.setattr(nndf.convert.cli, "say", lambda line: (line.startswith("waiting for another convert_model")
                                                                and told.set(), said(line)))
    other = threading.Thread(target=other_run)
    other.start()
    assert holding.wait(timeout=30)
    try:
        assert convert_model(["-m", str(model), "-t", str(minilm_dir), "-o", str(out), "-d", "cpu", "-s", "2", "8",
                              "24", "--atol", "1e-4", *FAST]) == 0
    finally:
        told.set()
        other.join()
    assert f"waiting for another convert_model run writing in {out} ..." in capsys.readouterr().err
    assert released and (out / "model.onnx").read_bytes()[:20] != b"the other run's grap"  # this run's, whole
    assert (out / "transformer_onnx_model" / "1" / "model.onnx").read_bytes() == (out / "model.onnx").read_bytes()
    assert not list(out.glob(".*.lock"))
