"""bench/encoder_cpu.py (issue 12's benchmark): flags and defaults, the goals as PASS / FAIL / SKIP on made-up
numbers, the report's layout and busy-machine warning, that the script (the Optimum worker too) imports only the
standard library, and one real run of the four non-Optimum engines through the worker protocol on a tiny random
BERT saved as a sentence-transformers folder with MiniLM's tokenizer (the real MiniLM's conversion alone takes
~25 s here; the Optimum venv is never built in tests)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "bench" / "encoder_cpu.py"
_spec = importlib.util.spec_from_file_location("encoder_cpu", SCRIPT)
encoder_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(encoder_cpu)
from harness import encoder_report, encoders  # noqa: E402  (on sys.path once the script is loaded)


def test_defaults_are_the_documented_run():
    args = encoder_cpu.parse_args([])
    assert args.shapes == [(1, 16), (16, 128)] and args.rounds == 5 and args.seconds == 1.0
    assert args.engines == ["pytorch", "ort-plain", "ort-optimized", "ort-int8", "optimum"]
    assert (args.threads, args.working_dir, args.json, args.model_dir, args.worker) == (None, "temp", None, None, None)


def test_flags_are_parsed_and_duplicates_dropped():
    args = encoder_cpu.parse_args(["--shapes", "2x8", "4X32", "2x8", "--rounds", "3", "--engines", "pytorch",
                                   "ort-int8", "pytorch", "--threads", "1", "--working-dir", "/tmp/w", "--json",
                                   "out.json", "--seconds", "0.5", "--model-dir", "m"])
    assert args.shapes == [(2, 8), (4, 32)] and args.engines == ["pytorch", "ort-int8"]
    assert (args.rounds, args.threads, args.working_dir, args.json, args.seconds, args.model_dir) == \
        (3, 1, "/tmp/w", "out.json", 0.5, "m")


@pytest.mark.parametrize("argv, needle", [
    (["--shapes", "16"], "is not BATCHxSEQ"),
    (["--shapes", "0x16"], "must be at least 1"),
    (["--shapes", "1x1"], "at least 2 tokens"),
    (["--engines", "pytorch", "tensorflow"], "invalid choice: 'tensorflow'"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        encoder_cpu.parse_args(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def _report(ms: dict, cosine: dict | None = None, foreign: float = 0.0) -> dict:
    """A report with made-up median ms per call: {shape: {engine: ms}}; cosine: {engine: mean cosine}."""
    engines = {e: {"status": "ok"} for per in ms.values() for e in per}
    batches = {}
    for shape, per in ms.items():
        batch = int(shape.split("x")[0])
        batches[shape] = {e: {"call_ms": encoder_report.stat([v]), "sent_s": encoder_report.stat([batch * 1e3 / v]),
                              "fidelity": {"mean_cosine": (cosine or {}).get(e, 1.0), "min_cosine": 0.98,
                                           "max_abs_diff": 0.01}} for e, v in per.items()}
    report = {"settings": {"model": "m", "inputs": "text", "shapes": list(ms), "rounds": 1, "seconds": 1.0,
                           "engines": list(engines), "threads": None},
              "machine": {"cores": 2, "foreign_cores": foreign}, "environment": {"main": {"torch": "x"}},
              "engines": engines, "batches": batches}
    report["goals"] = encoder_cpu.evaluate_goals(report, encoder_cpu.GOALS)
    return report


def _statuses(report: dict) -> list[tuple[str, str]]:
    return [(g["status"], g["text"]) for g in report["goals"]]


def test_goals_pass_and_fail_on_made_up_numbers():
    good = _report({"1x16": {"pytorch": 10.0, "ort-optimized": 6.0, "ort-int8": 4.0, "optimum": 6.5},
                    "16x128": {"pytorch": 400.0, "ort-optimized": 300.0, "ort-int8": 190.0, "optimum": 300.0}},
                   cosine={"ort-int8": 0.995})
    assert [s for s, _ in _statuses(good)] == ["PASS"] * 6, _statuses(good)
    texts = [t for _, t in _statuses(good)]
    assert texts[0] == "1x16 ort-optimized throughput / pytorch = 1.67x (goal >= 1.50x)"
    assert texts[3] == "16x128 ort-int8 mean cosine to pytorch = 0.9950 (goal >= 0.99)"
    assert texts[5] == "16x128 ort-optimized ms/call / optimum = 1.0000x (goal <= 1.00x)"  # rounds to its target
    bad = _report({"1x16": {"pytorch": 10.0, "ort-optimized": 7.0, "ort-int8": 4.0, "optimum": 6.5},
                   "16x128": {"pytorch": 400.0, "ort-optimized": 320.0, "ort-int8": 210.0, "optimum": 300.0}},
                  cosine={"ort-int8": 0.98})
    assert [s for s, _ in _statuses(bad)] == ["FAIL"] * 6, _statuses(bad)


def test_goals_skip_with_the_reason():
    report = _report({"1x16": {"pytorch": 10.0, "ort-optimized": 6.0}})
    report["engines"]["ort-int8"] = {"status": "failed", "reason": "preparation failed: boom"}
    goals = [(g["status"], g["text"]) for g in encoder_cpu.evaluate_goals(report, encoder_cpu.GOALS)]
    assert goals[0][0] == "PASS"
    assert goals[1] == ("SKIP", "16x128 ort-optimized throughput / pytorch (goal >= 1.30x): shape 16x128 was not "
                                "among --shapes")
    assert goals[2] == ("SKIP", "16x128 ort-int8 throughput / pytorch (goal >= 2.00x): ort-int8 did not run: "
                                "preparation failed: boom")
    assert goals[4] == ("SKIP", "1x16 ort-optimized ms/call / optimum (goal <= 1.00x): optimum was not among --engines")


def test_report_layout_tables_then_ratios_last_then_goals_and_a_busy_machine():
    report = _report({"1x16": {"pytorch": 10.0, "ort-optimized": 5.0, "optimum": 6.0}}, foreign=0.05)
    text = encoder_report.render_report(report)
    lines = text.splitlines()
    assert lines.index("batch 1, seq 16") < lines.index("RATIOS (same run, side by side; throughput = pytorch ms/call "
                                                        "/ engine ms/call)") < lines.index("GOALS")
    assert "other processes used 0.05 of 2 cores on average while we measured" in text and "WARNING" not in text
    assert any(line.split() == ["ort-optimized", "5.00", "2.00x", "0.83x"] for line in lines), text
    assert any(line.split()[:3] == ["ort-optimized", "5.00", "-"] for line in lines), text  # one round: no spread
    busy = _report({"1x16": {"pytorch": 10.0}}, foreign=0.6)
    assert "WARNING: other processes used 0.60 of 2 cores" in encoder_report.render_report(busy)


def test_fidelity_of_embeddings():
    same = encoder_report.fidelity([[1.0, 0.0], [0.6, 0.8]], [[1.0, 0.0], [0.6, 0.8]])
    assert same["mean_cosine"] == pytest.approx(1.0) and same["max_abs_diff"] == 0.0
    turned = encoder_report.fidelity([[1.0, 0.0]], [[0.0, 2.0]])
    assert turned["min_cosine"] == pytest.approx(0.0) and turned["max_abs_diff"] == 2.0


def test_the_script_imports_neither_nndf_nor_torch():
    """It is the Optimum worker too, in a venv without nndf: the standard library only at import time."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import encoder_cpu; "
            "print(sorted({'nndf', 'torch', 'transformers', 'numpy', 'onnxruntime'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code, str(REPO / "bench")], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


@pytest.fixture(scope="module")
def tiny_sentence_model(minilm_dir, tmp_path_factory):
    """A 2-layer random BERT (hidden 32) as a sentence-transformers folder: MiniLM's tokenizer, pooling and modules
    files with the tiny weights; converted once by convert_model in this process, into the folder where the
    benchmark looks for the graphs, so that the run below reuses them."""
    import torch
    import transformers

    work = tmp_path_factory.mktemp("encoder-bench")
    folder = work / "tiny-st"
    shutil.copytree(minilm_dir, folder)
    for weights in ("model.safetensors", "config.json"):
        (folder / weights).unlink()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)
    transformers.BertModel(config).save_pretrained(folder)
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps(dict(json.loads(pooling.read_text()), word_embedding_dimension=32)))
    encoders.convert_once(folder, encoders.graphs_dir(work, folder), threads=1)
    return folder, work


def test_tiny_run_of_the_non_optimum_engines(tiny_sentence_model, tmp_path, capsys):
    folder, work = tiny_sentence_model
    out = tmp_path / "report.json"
    code = encoder_cpu.main(["--model-dir", str(folder), "--shapes", "1x8", "2x16", "--rounds", "1", "--seconds",
                             "0.02", "--engines", "pytorch", "ort-plain", "ort-optimized", "ort-int8",
                             "--working-dir", str(work), "--threads", "1", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    for needle in ("\nbatch 1, seq 8\n", "\nbatch 2, seq 16\n", "RATIOS", "GOALS", "threads: 1"):
        assert needle in printed.out, printed.out
    assert "round 1/1 2x16 ort-int8" in printed.err
    assert "convert_model" not in (work / "bench-logs" / "ort-plain.log").read_text()  # the fixture's graphs reused
    report = json.loads(out.read_text())
    assert all(report["engines"][e]["status"] == "ok" and report["engines"][e]["peak_rss_bytes"] > 0
               for e in ("pytorch", "ort-plain", "ort-optimized", "ort-int8"))
    for shape, batch in (("1x8", 1), ("2x16", 2)):
        entries = report["batches"][shape]
        assert all(e["call_ms"]["median"] > 0 and e["calls"] >= 3 for e in entries.values())
        for engine in ("ort-plain", "ort-optimized"):  # fp32 graphs: sentence-transformers' own embeddings
            assert entries[engine]["fidelity"]["max_abs_diff"] < 1e-5
        assert len(report["raw"]["warm_up"][shape]["pytorch"]["embeddings"]) == batch
    assert {g["status"] for g in report["goals"]} == {"SKIP"}  # neither default shape was measured
