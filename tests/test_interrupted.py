"""Ctrl-C during a command that measures several backends in turn: the backends measured before it keep their
tables (on screen and in --json), which say where it stopped, and the command still exits as interrupted (130).

Before, every table was lost: an hour of LAMBADA on one backend went with a Ctrl-C during the next. Ctrl-C is
simulated by raising KeyboardInterrupt where the work of one backend runs, as Python raises it there on SIGINT.
"""

from __future__ import annotations

import json

import pytest

import nndf
import nndf.actions.benchmark
import nndf.actions.run
from conftest import LAMBADA_FILE, TOKENIZER_DIR, needs_shared
from nndf.architectures import DecoderOnly
from nndf.interrupt import Interrupted
from test_cli import FAST, run_cli


def ctrl_c_on(monkeypatch, module, backend: str, after: int = 0):
    """`module.time_generation` raising KeyboardInterrupt on the runner labelled `backend`, after `after` calls
    of its own."""
    timed = module.time_generation
    calls = []

    def interrupted(runner, *args, **kwargs):
        if runner.label == backend:
            calls.append(runner.label)
            if len(calls) > after:
                raise KeyboardInterrupt
        return timed(runner, *args, **kwargs)

    monkeypatch.setattr(module, "time_generation", interrupted)


def benchmark(tiny_gpt2_dir, *flags):
    return ["benchmark", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir, "--input-seq-len", 4,
            "--output-seq-len", 3, *FAST, *flags]


def test_benchmark_keeps_the_backends_measured_before_ctrl_c(capsys, monkeypatch, tiny_gpt2_dir, tmp_path):
    out_file = tmp_path / "bench.json"
    out_file.write_text('{"results": "of an earlier run"}')
    ctrl_c_on(monkeypatch, nndf.actions.benchmark, "frameworks (HF generate)")
    code, out, err = run_cli(capsys, *benchmark(tiny_gpt2_dir, "--json", out_file))
    assert code == 130 and err.rstrip().endswith("interrupted")
    assert [line.split()[0] for line in out.splitlines() if line.startswith("frameworks")] == ["frameworks"]
    note = ("interrupted (Ctrl-C) while benchmarking frameworks (HF generate): not measured: frameworks (HF "
            "generate).")
    assert note in " ".join(out.split()) and "vs HF generate" not in out
    data = json.loads(out_file.read_text())["results"][0]
    assert [row["backend"] for row in data["rows"]] == ["frameworks"] and data["rows"][0]["decode_ms"] > 0
    assert data["context"]["interrupted"] == "benchmarking frameworks (HF generate)"


def test_ctrl_c_before_anything_was_measured_is_a_plain_interrupt(capsys, monkeypatch, tiny_gpt2_dir, tmp_path):
    ctrl_c_on(monkeypatch, nndf.actions.benchmark, "frameworks")
    code, out, err = run_cli(capsys, *benchmark(tiny_gpt2_dir, "--json", tmp_path / "bench.json"))
    assert code == 130 and err.rstrip().endswith("\ninterrupted")
    assert "backend" not in out and not (tmp_path / "bench.json").exists()


def test_the_python_api_raises_with_the_measured_tables(monkeypatch, tiny_gpt2_dir):
    """A script calling nndf.run stops on Ctrl-C as it would (a KeyboardInterrupt), the measured tables on it."""
    ctrl_c_on(monkeypatch, nndf.actions.benchmark, "frameworks (HF generate)")
    with pytest.raises(Interrupted) as stopped:
        nndf.run("benchmark", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), input_seq_len=4, output_seq_len=3,
                 iterations=2, warmup=1)
    assert isinstance(stopped.value, KeyboardInterrupt)
    [result] = stopped.value.results
    assert [row["backend"] for row in result.rows] == ["frameworks"]


@needs_shared(TOKENIZER_DIR)
def test_run_keeps_whole_backends_only(capsys, monkeypatch, tiny_gpt2_dir):
    """Stopped in generate()'s second sample: its first sample's output goes with it, our loop's rows stay (`run`
    and `compare` share this loop)."""
    samples = nndf.actions.run.checkpoint_samples
    monkeypatch.setattr(nndf.actions.run, "checkpoint_samples", lambda args: samples(args) * 2)
    ctrl_c_on(monkeypatch, nndf.actions.run, "frameworks (HF generate)", after=1)
    code, out, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir, "--output-seq-len", 2,
                             "--iterations", 1, "--warmup", 0)
    assert code == 130, err
    firsts = [line.split()[:2] for line in out.splitlines() if line.startswith("frameworks")]
    assert firsts == [["frameworks", "2"]] + [["frameworks", "TensorRT"]] * 2  # its row, its output per sample
    text = " ".join(out.split())
    assert "while running the samples on frameworks (HF generate): not run: frameworks (HF generate)." in text


@needs_shared(LAMBADA_FILE)
@pytest.mark.parametrize("stop_in", ["lambada", "fidelities"])
def test_accuracy_keeps_the_backends_scored_before_ctrl_c(capsys, monkeypatch, tiny_gpt2_dir, onnx_work_dir, stop_in):
    scored = getattr(DecoderOnly, stop_in)

    def interrupted(self, texts, model, *args, **kwargs):
        models = model if isinstance(model, list) else [model]
        if any(m.backend == "onnxrt" for m in models):
            raise KeyboardInterrupt
        return scored(self, texts, model, *args, **kwargs)

    monkeypatch.setattr(DecoderOnly, stop_in, interrupted)
    code, out, err = run_cli(capsys, "accuracy", "GPT2", "frameworks", "onnxrt", "--torch-dir", tiny_gpt2_dir,
                             "--dataset-file", LAMBADA_FILE, "--num-samples", 3, "--working-dir", onnx_work_dir)
    assert code == 130, err
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("frameworks", "onnxrt"))]
    text = " ".join(out.split())
    if stop_in == "lambada":
        assert rows == ["frameworks"] and "while scoring onnxrt: not scored: onnxrt." in text
    else:
        assert rows == ["frameworks", "onnxrt"] and "top-1 = PyTorch" not in out
        assert "while comparing logits with PyTorch's (fidelity): no top-1 agreement or KL columns" in text


@needs_shared(LAMBADA_FILE)
def test_evaluate_keeps_the_backends_evaluated_before_ctrl_c(capsys, monkeypatch, tiny_gpt2_dir, onnx_work_dir,
                                                            tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval (the eval and test extras) is absent")
    from nndf.lm_eval import NndfLM

    made = NndfLM.__init__

    def interrupted(self, model, *args, **kwargs):
        if model.backend == "onnxrt":
            raise KeyboardInterrupt
        made(self, model, *args, **kwargs)

    monkeypatch.setattr(NndfLM, "__init__", interrupted)
    passages = tmp_path / "lambada.jsonl"
    passages.write_text("\n".join(LAMBADA_FILE.read_text(encoding="utf-8").splitlines()[:5]) + "\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "evaluate", "GPT2", "frameworks", "onnxrt", "--torch-dir", tiny_gpt2_dir,
                             "--working-dir", onnx_work_dir, "--tasks", "lambada_openai", "--dataset-file", passages,
                             "--bootstrap-iters", 0, "--limit", 1)
    assert code == 130, err
    assert "on frameworks: lm-evaluation-harness" in out and "on onnxrt" not in out and "against" not in out
    assert "interrupted (Ctrl-C) while evaluating onnxrt: not evaluated: onnxrt." in " ".join(out.split())
