from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nndf.results import Column, Result, write_json


def make_result() -> Result:
    return Result(
        action="benchmark",
        title="Benchmark: gpt2",
        columns=[
            Column("backend", "Backend"),
            Column("latency", "Latency", "{:.2f}", "ms"),
            Column("tokens", "Tokens"),
            Column("peak", "Peak", "{:.1f}", "MiB"),
        ],
        rows=[
            {"backend": "pytorch", "latency": 12.3456, "tokens": 32, "peak": 512.0},
            {"backend": "onnxruntime", "latency": 3.2, "tokens": 128, "peak": None},
            {"backend": "tensorrt", "latency": None, "tokens": 7},
        ],
        context={"model": "gpt2", "variant": "fp32", "settings": {"iterations": 10, "warmup": 3}},
        notes=["TensorRT latency was not measured."],
    )


def test_render_exact() -> None:
    assert make_result().render() == (
        "Benchmark: gpt2\n"
        "Backend      Latency (ms)  Tokens  Peak (MiB)\n"
        "-----------  ------------  ------  ----------\n"
        "pytorch             12.35      32       512.0\n"
        "onnxruntime          3.20     128           -\n"
        "tensorrt                -       7           -\n"
        "TensorRT latency was not measured."
    )


def test_render_verbose_shows_context_above_table() -> None:
    lines = make_result().render(verbose=True).splitlines()
    assert lines[:4] == [
        "Benchmark: gpt2",
        "model: gpt2",
        "variant: fp32",
        "settings: iterations=10, warmup=3",
    ]
    assert lines[4].startswith("Backend")


def test_render_text_column_left_and_wide_header() -> None:
    result = Result(
        action="check",
        title="T",
        columns=[Column("n", "A long header"), Column("s", "S"), Column("ok", "OK")],
        rows=[{"n": 1, "s": "abc", "ok": True}, {"n": np.float32(2.5), "s": None, "ok": False}],
    )
    assert result.render() == (
        "T\n"
        "A long header  S    OK\n"
        "-------------  ---  -----\n"
        "            1  abc  True\n"
        "          2.5  -    False"
    )


def test_a_number_column_without_values_stays_right_aligned() -> None:
    """"-" in every row of a number's column (first text shown with --no-stream) lines up with the numbers beside."""
    result = Result(action="chat", title="T", columns=[Column("b", "backend"), Column("ms", "first text", "{:.1f}"),
                                                       Column("n", "new")],
                    rows=[{"b": "frameworks", "ms": None, "n": 12}, {"b": "onnxrt", "ms": None, "n": 7}])
    assert result.render().splitlines()[1:] == [
        "backend     first text  new",
        "----------  ----------  ---",
        "frameworks           -   12",
        "onnxrt               -    7",
    ]


def test_format_that_does_not_fit_falls_back_to_text() -> None:
    assert Column("x", "X", "{:.2f}").format("error") == "error"
    assert Column("x", "X", "{:.2f}").format(None) == "-"


def test_to_dict_keeps_raw_values() -> None:
    d = make_result().to_dict()
    assert d["action"] == "benchmark"
    assert d["columns"][1] == {"key": "latency", "header": "Latency", "unit": "ms"}
    assert d["rows"][0]["latency"] == 12.3456
    assert d["rows"][1]["peak"] is None
    assert d["context"]["settings"] == {"iterations": 10, "warmup": 3}
    assert d["notes"] == ["TensorRT latency was not measured."]


def test_write_json_round_trip_and_no_temp_file(tmp_path: Path) -> None:
    first = make_result()
    second = Result("export", "Export", [Column("path", "Path")], [{"path": tmp_path / "m.onnx", "n": np.int64(3)}])
    out = write_json([first, second], tmp_path / "out" / "results.json")
    assert out == tmp_path / "out" / "results.json"
    loaded = json.loads(out.read_text(encoding="utf-8"))
    assert loaded == {"results": [first.to_dict(), second.to_dict()]}
    assert loaded["results"][1]["rows"][0] == {"path": str(tmp_path / "m.onnx"), "n": 3}
    assert [p.name for p in out.parent.iterdir()] == ["results.json"]


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("cannot serialise")


def test_failing_serialisation_leaves_no_file(tmp_path: Path) -> None:
    bad = Result("x", "X", [Column("v", "V")], [{"v": Unprintable()}])
    target = tmp_path / "results.json"
    with pytest.raises(RuntimeError):
        write_json([bad], target)
    assert list(tmp_path.iterdir()) == []


def test_failing_serialisation_keeps_previous_file(tmp_path: Path) -> None:
    target = write_json([make_result()], tmp_path / "results.json")
    before = target.read_text(encoding="utf-8")
    with pytest.raises(RuntimeError):
        write_json([Result("x", "X", [Column("v", "V")], [{"v": Unprintable()}])], target)
    assert target.read_text(encoding="utf-8") == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_nan_is_a_dash_on_screen_and_null_in_strict_json(tmp_path: Path) -> None:
    """An average over no passage (NaN) or a perplexity that overflowed (inf): "-" in the table, null in the JSON,
    which strict parsers (JavaScript's, jq's) read; Python's json would write NaN and Infinity."""
    result = Result("accuracy", "LAMBADA", [Column("backend", "backend"), Column("ppl", "seq ppl", "{:.1f}")],
                    [{"backend": "onnxrt", "ppl": float("nan")}, {"backend": "frameworks", "ppl": np.float64(np.inf)},
                     {"backend": "trt", "ppl": 3.25}, {"backend": "gpu", "ppl": np.float32("nan")}],
                    context={"spread": [1.0, float("nan")]})
    assert [line.split()[-1] for line in result.render().splitlines()[3:]] == ["-", "inf", "3.2", "-"]
    out = write_json([result], tmp_path / "r.json")
    text = out.read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert [row["ppl"] for row in loaded["results"][0]["rows"]] == [None, None, 3.25, None]
    assert loaded["results"][0]["context"]["spread"] == [1.0, None]


def test_a_reply_with_line_breaks_stays_on_its_row() -> None:
    result = Result("run", "outputs", [Column("backend", "backend"), Column("text", "output")],
                    [{"backend": "onnxrt", "text": "one\ntwo\r\nthree"}, {"backend": "trt", "text": "four"}])
    lines = result.render().splitlines()
    assert len(lines) == 5 and lines[3].endswith("one\\ntwo\\r\\nthree") and lines[4].endswith("four")


def test_a_column_with_a_width_cuts_long_text_at_a_word_on_screen_only(tmp_path: Path) -> None:
    """run's inputs (a paragraph of BART's checkpoint) made rows 700 characters wide; the JSON keeps them whole."""
    paragraph = "NVIDIA TensorRT-based applications perform up to 36X faster than CPU-only platforms " * 5
    result = Result("run", "outputs", [Column("input", "input", width=40), Column("output", "output")],
                    [{"input": paragraph, "output": "x"}, {"input": "a" * 50, "output": "y"}])
    cells = [line[:40].rstrip() for line in result.render().splitlines()[3:]]
    assert cells == ["NVIDIA TensorRT-based applications ...", "a" * 36 + " ..."]
    loaded = json.loads(write_json([result], tmp_path / "r.json").read_text())
    assert loaded["results"][0]["rows"][0]["input"] == paragraph


def test_a_benchmark_row_that_spread_widely_is_named_in_a_note() -> None:
    """A busy machine gave one row a 73% stdev and a total that did not fit its first token and steps: the table
    now says which rows to read with care (one timed run has no spread: NaN, never noisy)."""
    from nndf.actions.benchmark import noisy_note

    rows = [{"backend": "frameworks", "spread_pct": 4.0}, {"backend": "frameworks (HF generate)", "spread_pct": 73.0},
            {"backend": "onnxrt", "spread_pct": float("nan")}]
    [note] = noisy_note(rows)
    assert note.startswith("stdev above 30% (frameworks (HF generate)): other work on this machine")
    assert noisy_note(rows[:1] + rows[2:]) == []


def test_info_shows_each_setting_once() -> None:
    """--info printed the settings above the tensor shapes, then again above the results."""
    result = Result("benchmark", "t", [Column("backend", "backend")], [{"backend": "onnxrt"}],
                    context={"model": "GPT2", "settings": {"batch_size": 1}, "timing": {"iterations": 5}})
    lines = result.render(verbose=True, shown={"model": "GPT2", "settings": {"batch_size": 1}}).splitlines()
    assert lines[:2] == ["t", "timing: iterations=5"]
    assert result.render(verbose=True).splitlines()[1:3] == ["model: GPT2", "settings: batch_size=1"]


def test_the_benchmark_note_gives_each_backends_runs_when_they_differ() -> None:
    """--duration 2 gave onnxrt 55 runs and frameworks 12, and the note said "55 timed runs per backend" (the last
    row's count); it also says now what throughput and stdev are computed from."""
    from nndf.actions.benchmark import runs_note
    from nndf.measure import TimingSettings

    rows = [{"backend": "frameworks", "runs": 12}, {"backend": "onnxrt", "runs": 55}]
    note = runs_note(rows, TimingSettings(iterations=2, warmup=1, duration=2, percentile=90))
    assert note.startswith("timed runs: frameworks 12, onnxrt 55 (as many as fit in --duration 2 s) after 1 warm-up "
                           "run; throughput is batch x new tokens over the p90 latency (prompt tokens not counted)")
    same = runs_note([{"backend": "frameworks", "runs": 3}, {"backend": "onnxrt", "runs": 3}], TimingSettings(3))
    assert same.startswith("3 timed runs per backend after 3 warm-up runs; throughput is batch x new tokens over the "
                           "p50 latency")
