"""bench/sampling_cpu.py: the overhead and first-text arithmetic on made-up figures, and a tiny real run."""

from __future__ import annotations

import importlib.util
import re

from conftest import REPO, TOKENIZER_DIR, needs_shared

SCRIPT = REPO / "bench" / "sampling_cpu.py"
spec = importlib.util.spec_from_file_location("sampling_cpu", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_overhead_is_the_median_of_per_round_ratios_and_goals_pass_or_fail():
    steps = {("onnxrt", 1, "greedy"): [10.0, 10.0, 12.0], ("onnxrt", 1, "sample"): [10.2, 10.1, 12.6],
             ("onnxrt", 1, "sample top-p 0.9"): [11.0, 11.0, 13.2],
             ("onnxrt", 4, "greedy"): [20.0, 20.0, 20.0], ("onnxrt", 4, "sample"): [21.0, 21.0, 21.0],
             ("onnxrt", 4, "sample top-p 0.9"): [22.0, 22.0, 22.0],
             ("onnxrt", 4, "sample, fast stream"): [20.2, 20.0, 19.8]}
    firsts = {"onnxrt": [(11.0, 10.0, 10.0), (13.0, 10.0, 10.0), (12.0, 10.0, 10.0)]}
    inside = {("onnxrt", 4, "greedy"): [19.5, 19.5, 19.5], ("onnxrt", 4, "sample"): [20.0, 19.8, 20.2]}
    text, raw = bench.report(bench.parse_args([]), {"steps": steps, "inside": inside, "firsts": firsts,
                                                    "foreign_cores": 0.5})
    cells = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines() if line.startswith("onnxrt ")]
    rows = {tuple(row[:3]): row[3:6] for row in cells}  # engine, batch, mode: step, in the runtime, outside
    assert rows[("onnxrt", "4", "sample")] == ["21.00", "20.00", "1.00"]
    assert rows[("onnxrt", "4", "greedy")] == ["20.00", "19.50", "0.50"]
    assert rows[("onnxrt", "1", "greedy")] == ["10.00", "-", "-"]  # no split measured
    assert "GOAL PASS: onnxrt b1: default sampling overhead +2.0% per decode step (goal <= 3%)" in text
    assert "GOAL FAIL: onnxrt b4: default sampling overhead +5.0% per decode step (goal <= 3%)" in text
    assert "GOAL PASS: onnxrt b4: default sampling, fast stream, overhead +0.0% per decode step (goal <= 3%)" in text
    assert "GOAL PASS: onnxrt b1: streamed first text 1.200x the first-token time (goal <= 1.2x)" in text
    assert "other processes used 0.50 of" in text and raw["steps"]["onnxrt b4 sample"] == [21.0, 21.0, 21.0]


@needs_shared(TOKENIZER_DIR)
def test_tiny_run(tiny_gpt2_dir, onnx_work_dir, capsys):
    bench.main(["--torch-dir", str(tiny_gpt2_dir), "--engines", "frameworks", "onnxrt", "hf", "--batch-sizes", "1",
                "--input-len", "4", "--output-len", "3", "--rounds", "1", "--working-dir", str(onnx_work_dir)])
    out = capsys.readouterr().out
    for engine in ("frameworks", "onnxrt", "hf"):
        for mode in ("greedy", "sample", "sample top-p 0.9", "sample, fast stream"):
            words = [engine, "1", *mode.split()[:2]]
            shown = any(line.split()[:len(words)] == words for line in out.splitlines())
            assert shown == (engine != "hf" or "fast" not in mode), (engine, mode)  # generate() has no fast stream
    assert out.count("GOAL ") == 6 and "streamed first text" in out
    onnxrt = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.startswith("onnxrt ")]
    steps = [row for row in onnxrt if row[2:3] and row[2] in bench.MODES]  # the first-text table's row is not one
    assert len(steps) == 4 and all(float(row[4]) > 0 for row in steps)  # every mode's runtime share timed
    assert "in the runtime: the median of a decode step's ONNX Runtime run" in out
