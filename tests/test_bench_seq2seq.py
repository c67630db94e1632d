"""bench/seq2seq_cpu.py: per-family defaults and flags, lengths, goals and report layout on made-up numbers, and a
tiny BLIP through the worker protocol (the harness shared with decoder_cpu.py is tested in test_bench.py)."""

from __future__ import annotations

import pytest

from test_bench import MiB, SEQ2SEQ_SCRIPT, _report, _statuses, _tiny_run, driver, render, seq2seq
from test_bench import bench_work_dir  # noqa: F401  (a fixture)


def test_seq2seq_defaults_and_flags_per_family():
    args = driver.parse_args(seq2seq.BENCH, [])
    assert (args.family, args.variant, args.random_weights) == ("T5", "t5-small", True)
    assert args.batch_sizes == [1, 4] and (args.input_len, args.output_len) == (64, 64)
    assert args.engines == ["hf", "onnxrt", "onnxrt-int8", "optimum"]
    args = driver.parse_args(seq2seq.BENCH, ["--family", "BART", "--variant", "bart-base", "--rounds", "3",
                                             "--engines", "hf", "nndf-frameworks", "hf", "--threads", "1"])
    assert (args.family, args.variant, args.rounds, args.threads) == ("BART", "bart-base", 3, 1)
    assert args.engines == ["hf", "nndf-frameworks"]
    assert seq2seq.BENCH.for_family("BART") is seq2seq.BENCH and seq2seq.BENCH.family.inputs == "tokens"
    # BLIP (matched as the registry matches names): its own defaults, goal and data; given flags still win
    args = driver.parse_args(seq2seq.BENCH, ["--family", "blip"])
    assert (args.variant, args.output_len) == ("blip-image-captioning-base", 20)
    assert args.engines == ["hf", "onnxrt", "onnxrt-int8"]
    args = driver.parse_args(seq2seq.BENCH, ["--family", "BLIP", "--output-len", "8", "--engines", "hf",
                                             "nndf-frameworks"])
    assert (args.output_len, args.engines) == (8, ["hf", "nndf-frameworks"])  # optimum: refused (test_bench.py)
    assert seq2seq.BENCH.for_family("BLIP").goals == (("onnxrt", 1, "tok_s", "hf", ">=", 1.4),)
    helped = " ".join(driver.build_parser(seq2seq.BENCH).format_help().split())
    assert "optimum; BLIP: hf onnxrt onnxrt-int8, as Optimum does not export BLIP)" in helped


def test_seq2seq_lengths_must_fit_the_positions():
    args = driver.parse_args(seq2seq.BENCH, ["--input-len", "1024", "--output-len", "1023"])
    assert seq2seq.check_lengths({"max_position_embeddings": 1024}, args) is None
    args = driver.parse_args(seq2seq.BENCH, ["--output-len", "1024"])
    assert "--output-len 1024" in seq2seq.check_lengths({"max_position_embeddings": 1024}, args)
    assert seq2seq.check_lengths({"vocab_size": 32128}, args) is None  # no bound known
    blip = driver.parse_args(seq2seq.BENCH, ["--family", "BLIP", "--input-len", "4096"])  # pixels in: not used
    config = {"text_config": {"max_position_embeddings": 512}, "vision_config": {"image_size": 384}}
    assert seq2seq.check_lengths(config, blip) is None
    blip.output_len = 512
    assert seq2seq.check_lengths(config, blip).startswith("--output-len 512 (+ the decoder start token) must each fit")


S2S_MEMORY = {"hf": 600 * MiB, "onnxrt": 500 * MiB, "onnxrt-int8": 300 * MiB, "optimum": 900 * MiB}


def _s2s_report(b4_onnxrt_tok=130.0, optimum=True):
    engines = {1: {"hf": (24.0, 30.0, 1.0, 21.0), "onnxrt": (12.0, 50.0, 1.0, 9.0),
                   "onnxrt-int8": (6.0, 95.0, 0.9, 5.0), "optimum": (16.0, 40.0, 1.0, 11.0)},
               4: {"hf": (45.0, 60.0, 1.0, 65.0), "onnxrt": (14.0, b4_onnxrt_tok, 1.0),
                   "onnxrt-int8": (8.0, 170.0, 0.85), "optimum": (30.0, 100.0, 1.0, 40.0)}}
    failed = {}
    if not optimum:
        for per in engines.values():
            del per["optimum"]
        failed["optimum"] = "pip install failed: no network"
    return _report(engines, S2S_MEMORY, failed=failed, config=seq2seq.BENCH)


def test_seq2seq_goals_on_made_up_numbers_and_without_optimum():
    report = _s2s_report()
    assert _statuses(report) == {
        "batch 1 onnxrt tok/s / hf": "PASS",           # 50 / 30 = 1.67 >= 1.6
        "batch 1 onnxrt tok/s / optimum": "PASS",      # 1.25 >= 1.15
        "batch 4 onnxrt tok/s / hf": "PASS",           # 2.17
        "batch 4 onnxrt tok/s / optimum": "PASS",      # 1.30
        "batch 1 onnxrt-int8 tok/s / hf": "PASS",      # 3.17 >= 3.0
        "batch 4 onnxrt-int8 tok/s / hf": "FAIL",      # 2.83 < 3.0
        "onnxrt fp32 tokens equal hf's": "PASS",
    }
    report = _s2s_report(b4_onnxrt_tok=110.0)
    assert _statuses(report)["batch 4 onnxrt tok/s / optimum"] == "FAIL"  # 1.10 < 1.15
    ratios = {(r["batch"], r["metric"], r["engine"]): r for r in report["ratios"]}
    assert ratios[(1, "tok_s", "onnxrt")]["vs_hf"] == pytest.approx(50 / 30)
    assert ratios[(4, "step_ms", "onnxrt")]["vs_optimum"] == pytest.approx(14 / 30)
    assert ratios[(None, "peak_rss", "optimum")]["vs_hf"] == pytest.approx(1.5)
    goals = {g["label"]: g for g in _s2s_report(optimum=False)["goals"]}
    assert goals["batch 1 onnxrt tok/s / hf"]["status"] == "PASS"
    skipped = goals["batch 4 onnxrt tok/s / optimum"]
    assert skipped["status"] == "SKIP" and "optimum did not run: pip install failed" in skipped["text"]


def test_seq2seq_report_layout():
    report = _s2s_report()
    report["settings"]["generation"] = {"decoder_start_token_id": 0, "eos_token_id": 1}
    text = render.render_report(report, seq2seq.BENCH)
    lines = text.splitlines()
    assert lines[0].startswith("seq2seq_cpu: T5 t5-small (random weights (seed 0)), 64 encoder + 64 new tokens")
    assert lines[1] == ("generation config of the weights (applies to every engine): decoder_start_token_id 0, "
                        "eos_token_id 1")
    header = next(line for line in lines if line.strip().startswith("engine") and "encoder ms" in line)
    assert header.split() == ["engine", "encoder", "ms", "spread", "decode", "ms/step", "spread", "first", "token",
                              "ms", "spread", "tok/s", "spread", "tokens", "vs", "hf"]
    assert any(line.split()[:3] == ["onnxrt", "9.00", "4.0%"] for line in lines)  # batch 1: encoder timed
    assert any(line.split()[:4] == ["onnxrt", "-", "-", "14.00"] for line in lines)  # batch 4: no encoder time
    order = [text.index(s) for s in ("\nbatch 1\n", "\nbatch 4\n", "RATIOS", "batch 1: tok/s",
                                     "batch 1: decode ms/step", "batch 4: tok/s", "batch 4: decode ms/step",
                                     "peak memory of each worker", "GOALS")]
    assert order == sorted(order)
    assert "onnxrt-int8: batch 1: 90.0% equal (first difference: row 0, new token 7); batch 4: 85.0% equal" in text
    assert any(line.split() == ["onnxrt", "50.0", "1.67x", "1.25x"] for line in lines)
    assert lines[-1].startswith("  PASS  onnxrt fp32 tokens equal hf's at batch 1, 4")


def test_tiny_blip_run_through_the_worker_protocol(blip_dir, bench_work_dir, tmp_path):
    """BLIP's hf worker (AutoModelForImageTextToText, its vision encoder timed) and ours on the same pixels file."""
    done, report = _tiny_run(SEQ2SEQ_SCRIPT, ["--family", "BLIP", "--torch-dir", str(blip_dir), "--batch-sizes", "1",
                                              "2", "--output-len", "4"], bench_work_dir, tmp_path)
    for needle in ("random 32x32 images + 4 new tokens", "(applies to every engine): eos_token_id 102, pad_token_id 0",
                   "onnxrt: batch 1: identical; batch 2: identical", "batch 1 onnxrt tok/s / hf = ",
                   "x (goal >= 1.40x)\n  PASS  onnxrt fp32 tokens equal hf's at batch 1, 2"):
        assert needle in done.stdout, done.stdout
    assert len(report["goals"]) == 2  # BLIP's: no optimum nor int8 goals
    for b in ("1", "2"):
        assert [len(row) for row in report["raw"]["warm_up"][b]["hf"]["tokens"]] == [4] * int(b)
        assert all(report["batches"][b][e]["encoder_ms"]["median"] > 0 for e in ("hf", "onnxrt"))
