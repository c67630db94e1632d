"""bench/serving_cpu.py's pieces that need no server: the prompts it sends, its per-request maths, its report and
its goals (the figures themselves are measured by running it, never in tests)."""

from __future__ import annotations

import pytest

from conftest import TOKENIZER_DIR, load_bench, needs_shared

serving = load_bench("serving_cpu")


def record(latency, tokens=32, equal=True, ttft=None, direct_ttft=None):
    return {"latency": latency, "tokens": tokens, "equal": equal, "ttft": ttft, "direct_ttft": direct_ttft}


def test_percentile_interpolates_between_ranks():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert serving.percentile(values, 50) == pytest.approx(50.5)
    assert serving.percentile(values, 99) == pytest.approx(99.01)
    assert serving.percentile([3.0, 1.0, 2.0], 0) == 1.0 and serving.percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert serving.percentile([7.0], 99) == 7.0


def test_summary_counts_requests_tokens_and_equal_answers_over_the_wall_time():
    records = [record(1.0, tokens=32), record(2.0, tokens=30, equal=False), record(3.0, tokens=32),
               record(4.0, tokens=26)]
    s = serving.summarize(records, wall_s=5.0)
    assert s["requests_per_s"] == pytest.approx(0.8) and s["tokens_per_s"] == pytest.approx(24.0)
    assert s["p50_s"] == pytest.approx(2.5) and s["p99_s"] == pytest.approx(3.97)
    assert s["equal_pct"] == 75.0 and s["ttft_p50_s"] is None and s["direct_ttft_p50_s"] is None
    streamed = serving.summarize([record(1.0, ttft=0.1, direct_ttft=0.05), record(1.0, ttft=0.3, direct_ttft=0.07)],
                                 wall_s=1.0)
    assert streamed["ttft_p50_s"] == pytest.approx(0.2) and streamed["direct_ttft_p50_s"] == pytest.approx(0.06)


def test_mixed_prompts_take_the_lengths_in_turn():
    class Chars:  # a tokenizer of one token per character: the cut lengths are exact
        def __call__(self, text):
            return {"input_ids": list(text)}

        def decode(self, ids):
            return "".join(ids)

    prompts = serving.mixed_prompts(Chars(), ["abcdefghij" * 10, "ABCDEFGHIJ" * 10], 5, lengths=(3, 7, 12))
    assert prompts == ["abc", "ABCDEFG", "abcdefghijab", "ABC", "abcdefg"]


@needs_shared(TOKENIZER_DIR)
def test_mixed_prompts_span_8_to_64_gpt2_tokens():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    prompts = serving.mixed_prompts(tokenizer, serving.source_texts(serving.PROMPT_COUNT), serving.PROMPT_COUNT)
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert len(set(prompts)) == serving.PROMPT_COUNT
    assert min(lengths) in range(6, 11) and max(lengths) in range(60, 67) and len(set(lengths)) >= 8


def summary(tokens_per_s, p50=1.0, p99=1.0, ttft=None, direct_ttft=None, equal=100.0, requests=8):
    return {"requests": requests, "wall_s": 1.0, "requests_per_s": tokens_per_s / 32, "tokens_per_s": tokens_per_s,
            "p50_s": p50, "p99_s": p99, "ttft_p50_s": ttft, "direct_ttft_p50_s": direct_ttft, "equal_pct": equal}


def results(cont_tokens=400.0, cont_p99=2.0, stream_ttft=0.06, equal=100.0):
    return {"continuous": {1: summary(100.0, p50=0.8), 8: summary(cont_tokens, p99=cont_p99)},
            "streaming": {1: summary(95.0, ttft=stream_ttft, direct_ttft=0.05), 8: summary(380.0, ttft=0.2,
                                                                                            direct_ttft=0.05)},
            "sequential": {1: summary(100.0), 8: summary(100.0, equal=equal)}}


def test_goals_pass_and_fail_on_their_ratios():
    passing = serving.evaluate_goals(results())
    assert [g["ok"] for g in passing] == [True, True, True, True]
    assert [round(g["value"], 3) for g in passing] == [4.0, 2.5, 100.0, 1.2]
    failing = serving.evaluate_goals(results(cont_tokens=250.0, cont_p99=2.5, stream_ttft=0.08, equal=50.0))
    assert [g["ok"] for g in failing] == [False, False, False, False]
    assert failing[2]["value"] == pytest.approx(100 * (5 * 8 + 4) / 48)  # weighted by requests


def test_goals_without_8_clients_are_skipped_as_not_measured():
    partial = {label: {1: by[1]} for label, by in results().items()}
    goals = serving.evaluate_goals(partial)
    assert [g["value"] is None for g in goals] == [True, True, False, False]
    assert not goals[0]["ok"] and not goals[1]["ok"]
    assert ("SKIP  tokens/s, continuous / sequential, 8 clients (goal >= 3x): not measured (its client counts were "
            "not all among --clients)") in serving.render_goals(goals)


def test_report_tables_and_goal_lines():
    text = serving.render(results())
    assert "continuous (gpt2)" in text and "streaming (gpt2_stream)" in text and "sequential (gpt2_seq)" in text
    assert "  clients  requests/s  tokens/s  p50 s  p99 s  TTFT p50 s  answers equal" in text
    assert "        8       12.50     400.0  1.000  2.000           -           100%" in text
    assert "        1        2.97      95.0  1.000  1.000       0.060           100%" in text
    lines = serving.render_goals(serving.evaluate_goals(results(equal=50.0))).splitlines()
    assert lines[0] == "PASS  tokens/s, continuous / sequential, 8 clients (goal >= 3x): 4.00x"
    assert lines[2] == "FAIL  answers equal to direct generation, all models (goal >= 100%): 91.7%"
    assert lines[3].endswith("(goal <= 1.5x): 1.20x")


@pytest.mark.parametrize("argv, needle", [(["--clients", "4", "0"], "argument --clients: 0 must be at least 1"),
                                          (["--requests-per-client", "0"],
                                           "argument --requests-per-client: 0 must be at least 1"),
                                          (["--quick", "--variant-dir", "."], "give it or --variant-dir, not both"),
                                          (["--variant-dir", "."], "is not a Hugging Face model folder")])
def test_bad_flags_exit_2_with_one_sentence(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serving.parse_args(argv)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_clients_are_sorted_once_each():
    assert serving.parse_args(["--clients", "8", "1", "8", "4"]).clients == [1, 4, 8]
