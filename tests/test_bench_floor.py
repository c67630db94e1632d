"""bench/harness/floor.py: the memory floor engine of bench/decoder_cpu.py (issue 21's "gpt2 fp32 decode within
1.25x of the memory floor"): the weights' fp32 bytes, the bandwidth probe's answer, the goal and the report's line.
A real run through the worker protocol is in tests/test_bench.py's tiny run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from test_bench import _report, _statuses, bench, render  # noqa: F401  (bench puts bench/ on sys.path)
from harness import floor  # noqa: E402

FLOOR_GOAL = "batch 1 onnxrt decode ms/step / floor"


def test_the_weights_count_four_bytes_an_element_whatever_their_stored_dtype(tmp_path):
    save_file({"a": torch.zeros(3, 4, dtype=torch.float16), "b": torch.zeros(5)}, str(tmp_path / "model-1.safetensors"),
              metadata={"format": "pt"})
    save_file({"c": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model-2.safetensors"))
    assert floor.weight_bytes(tmp_path) == 4 * (12 + 5 + 4)


def test_a_folder_without_safetensors_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} has no .safetensors file"):
        floor.weight_bytes(tmp_path)


def test_the_probe_answers_a_step_of_the_weights_bytes_at_the_bandwidth_it_read(tmp_path):
    save_file({"w": torch.zeros(1000, 1000)}, str(tmp_path / "model.safetensors"))
    runner = floor.FloorRunner(SimpleNamespace(threads=1, weights_dir=str(tmp_path)), buffer_bytes=64 << 20)
    assert runner.versions["weights_mb"] == 4.0 and runner.versions["buffer_mib"] == 64
    answer = runner.commands["generate"]({"cmd": "generate", "input_ids": [[1, 2]], "new_tokens": 8})
    assert answer["read_gb_s"] > 0.1  # any machine reads 64 MiB faster than 100 MB/s
    assert answer["step_median_s"] == pytest.approx(4e6 / (answer["read_gb_s"] * 1e9))
    assert answer["e2e_s"] == pytest.approx(8 * answer["step_median_s"]) and answer["marks"] == 8
    assert answer["ttft_s"] is None and answer["tokens"] is None
    assert runner.commands["memory"]({})["peak_rss_bytes"] is None  # no row in the peak memory table


@pytest.mark.parametrize("step, status", [(12.0, "PASS"), (12.5, "PASS"), (12.6, "FAIL")])
def test_onnxrt_fp32_decode_is_held_within_1_25x_of_the_floor(step, status):
    report = _report({1: {"onnxrt": (step, 80.0), "floor": (10.0, 100.0)}}, memory={})
    assert _statuses(report)[FLOOR_GOAL] == status


def test_the_batch_table_says_what_the_floor_row_measured():
    report = _report({1: {"onnxrt": (12.0, 80.0), "floor": (10.0, 100.0)}}, memory={})
    report["engines"]["floor"]["versions"] = {"weights_mb": 497.8}
    report["raw"] = {"rounds": {1: {"floor": [{"read_gb_s": 66.1}, {"read_gb_s": 35.2}, {"read_gb_s": 49.78}]}}}
    text = render.render_report(report, bench.BENCH)
    assert "\n  floor: 497.8 MB of fp32 weights per step at 49.8 GB/s (median over rounds of each round's median of " \
           "15 sums of 1 GiB; 35.2 to 66.1)\n" in text
    assert f"PASS  {FLOOR_GOAL} = 1.20x (goal <= 1.25x)" in text
