"""nndf.run: every command-line action from Python, with the command line's flags, checks and tables."""

from __future__ import annotations

import pytest

import nndf
from nndf.errors import UsageError

FAST = dict(iterations=1, warmup=0)


def test_benchmark_from_python_returns_the_table(tiny_gpt2_dir):
    results = nndf.run("benchmark", "GPT2", "frameworks", torch_dir=tiny_gpt2_dir, input_seq_len=6, output_seq_len=3,
                       use_cache=True, random_weights=False, **FAST)
    [result] = results
    assert [row["backend"] for row in result.rows] == ["frameworks", "frameworks (HF generate)"]
    assert result.rows[0]["decode_ms"] > 0
    assert "6 prompt + 3 new tokens" in result.render()


def test_chat_from_python_answers_the_given_lines(tiny_gpt2_dir):
    [result] = nndf.run("chat", "GPT2", "frameworks", torch_dir=tiny_gpt2_dir, output_seq_len=3,
                        input="Hello there\nThe cat\n")
    assert [row["prompt"] for row in result.rows] == ["Hello there", "The cat"]
    assert all(row["new_tokens"] == 3 for row in result.rows)


@pytest.mark.parametrize("call, message", [
    (lambda: nndf.run("fly", "GPT2", "frameworks"), "unknown action 'fly'"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", bogus=1), "bogus= is not a flag of this action"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", iterations="many"), "invalid int value: 'many'"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", input="hi"), "input= is for chat"),
])
def test_bad_calls_raise_the_command_lines_sentence(call, message):
    with pytest.raises(UsageError, match=message):
        call()
