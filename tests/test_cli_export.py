"""`export` from the command line: what it reports (built, reused, bytes), what it refuses before the load, and
what an interrupted export leaves (tests/test_cli.py: the rest of the command line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from nndf.cli import main
from test_cli import run_cli


def test_export_says_whether_it_built_or_reused_each_artifact_with_its_bytes(capsys, tiny_gpt2_dir, onnx_work_dir,
                                                                            tmp_path):
    """A status per artifact (table and --json) and the size in bytes beside the human one; an artifact whose
    metadata was written after the command began was built by it."""
    import time

    from nndf.actions.export import _status
    from nndf.workspace import metadata_path

    argv = ["export", "GPT2", "onnxrt", "--torch-dir", tiny_gpt2_dir, "--working-dir", onnx_work_dir]
    assert run_cli(capsys, *argv)[0] == 0  # built now or earlier: reused from here on
    out_file = tmp_path / "export.json"
    code, out, err = run_cli(capsys, *argv, "--json", out_file)
    assert code == 0, err
    (row,) = json.loads(out_file.read_text())["results"][0]["rows"]
    assert row["status"] == "reused" and f" reused  {row['size']}" in out
    assert isinstance(row["bytes"], int) and row["bytes"] > 2**20 and row["size"].endswith("MiB")
    graph = tmp_path / "export" / "decoder.onnx"
    graph.parent.mkdir()
    graph.write_bytes(b"graph")
    assert _status(graph, 0) == "given"  # no metadata: a file named by a flag
    metadata_path(graph.parent).write_text("{}")
    assert _status(graph, time.time_ns() - 10**9) == "built" and _status(graph, time.time_ns() + 10**9) == "reused"


def test_export_trt_without_a_gpu_points_at_the_export_that_can_run_here(capsys, monkeypatch, tiny_gpt2_dir,
                                                                          tmp_path):
    """export refuses frameworks, so the trt refusal cannot end in "choose the frameworks or onnxrt backend": it
    gives the onnxrt export that writes the ONNX files a TensorRT build reads, as a command to paste."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(capsys, "export", "GPT2", "trt", "--torch-dir", tiny_gpt2_dir, "--working-dir",
                             tmp_path, "--batch-size", "2")
    assert code == 1 and "frameworks" not in err and "loading" not in err
    assert err.strip().endswith(
        "or export the ONNX files that a TensorRT build reads, on any machine, with the onnxrt backend: python run.py "
        f"export GPT2 onnxrt --torch-dir {tiny_gpt2_dir} --working-dir {tmp_path} --kv-layout growing")
    code, _, err = run_cli(capsys, "benchmark", "GPT2", "trt", "--torch-dir", tiny_gpt2_dir)
    assert code == 1 and err.strip().endswith("or choose the frameworks or onnxrt backend")  # a run's alternatives


def test_export_output_help_says_the_folder_holds_the_graphs_weights(capsys):
    """-o's folder has the weights inside its graphs (decoder.onnx.data); what it lacks is a PyTorch checkpoint."""
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "graphs with their weights, config, tokenizer; no PyTorch checkpoint" in help_text
    assert "no weights" not in help_text


def test_export_of_frameworks_alone_is_refused_before_the_load(capsys, monkeypatch, tiny_gpt2_dir):
    """frameworks has no artifact: `export` of it alone would load the weights only to say so."""
    import nndf.actions.export as export_action

    monkeypatch.setattr(export_action, "open_models", lambda args, **_: pytest.fail("the model was loaded"))
    code, _, err = run_cli(capsys, "export", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir)
    assert code == 2
    assert ("export builds the ONNX graphs and engines of onnxrt and trt; frameworks runs the PyTorch model itself "
            "and has nothing to export: name onnxrt or trt") in err


def test_export_refuses_engine_flags_without_trt(capsys, monkeypatch, tiny_gpt2_dir):
    """--num-beams, lengths and batch sizes shape TensorRT's profiles; onnxrt's graphs are the same without them."""
    import nndf.actions.export as export_action

    monkeypatch.setattr(export_action, "open_models", lambda args, **_: pytest.fail("the model was loaded"))
    code, _, err = run_cli(capsys, "export", "GPT2", "onnxrt", "--torch-dir", tiny_gpt2_dir, "--num-beams", "4")
    assert code == 2 and ("--num-beams shapes TensorRT engines (their profiles); the ONNX graphs of onnxrt take any "
                          "batch and length, so without trt it changes nothing: name trt or drop it") in err


def test_sigterm_during_an_export_leaves_no_temporary_folder(tiny_gpt2_dir, tmp_path):
    """`timeout` or `kill` in the middle of an export: the half-built folder is removed and the exit code is 143."""
    import os
    import signal
    import time

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "run.py"), "export", "GPT2", "onnxrt", "--torch-dir",
                             str(tiny_gpt2_dir), "--working-dir", str(tmp_path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".*.tmp")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the export finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and err.strip().endswith("terminated")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_the_data_seed_it_would_ignore(capsys, monkeypatch, tiny_gpt2_dir):
    """--seed seeds data and draws, of which export has none: a user who meant the random weights' seed is told
    which flag that is, instead of getting the weights of seed 0."""
    import nndf.actions.export as export_action

    monkeypatch.setattr(export_action, "open_models", lambda args, **_: pytest.fail("the model was loaded"))
    code, _, err = run_cli(capsys, "export", "GPT2", "onnxrt", "--random-weights", "--seed", "3")
    assert code == 2 and err.strip() == ("error: --seed does not apply to export: it draws nothing at random "
                                         "(--weights-seed seeds --random-weights)")
