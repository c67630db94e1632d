"""The `accuracy` table as a user reads it: one column per top-N, in increasing N, and notes for what looks odd."""

from __future__ import annotations

import json

import pytest

from conftest import LAMBADA_FILE, TOKENIZER_DIR, TRAINED_TINY_GPT2, needs_shared
from nndf.actions.accuracy import PPL
from nndf.cli import main
from nndf.results import Column

PASSAGES = ["The cat sat on the mat and looked at the door for a long time",
            "She opened the window and the cold air of the morning came into the room"]


def accuracy(capsys, tmp_path, model_dir, *flags, data=None):
    if data is None:
        data = tmp_path / "passages.jsonl"
        data.write_text("".join(json.dumps({"text": text}) + "\n" for text in PASSAGES), encoding="utf-8")
    code = main(["accuracy", "GPT2", "frameworks", "--torch-dir", str(model_dir), "--dataset-file", str(data),
                 "--json", str(tmp_path / "acc.json"), *map(str, flags)])
    out, err = capsys.readouterr()
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("backend"))
    return out, header.split("  "), json.loads((tmp_path / "acc.json").read_text())["results"][0]["rows"][0]


@needs_shared(TOKENIZER_DIR)
@pytest.mark.parametrize("n, headers", [(1, ["top-1", "top-10"]), (10, ["top-1", "top-10"]),
                                        (20, ["top-1", "top-10", "top-20"]), (5, ["top-1", "top-5", "top-10"])])
def test_top_n_columns_are_each_n_once_in_increasing_order(capsys, tmp_path, tiny_gpt2_dir, n, headers):
    """--topN 10 printed two "top-10" columns, --topN 1 two "top-1" ones, and --topN 20 put "top-20" before
    "top-10"; the JSON rows keep top1, topN and top10 whatever N is."""
    _, header, row = accuracy(capsys, tmp_path, tiny_gpt2_dir, "--topN", n)
    assert [cell.strip() for cell in header if cell.strip().startswith("top-")] == headers
    assert {"top1", "topN", "top10"} <= set(row)


def test_six_digit_perplexities_print_without_a_trailing_point():
    """"{:#.6g}" keeps six digits (57550.0 beside 57715.8) but wrote 100000 as "100000." and 123456.7 as "123457."."""
    column = Column("ppl", "ppl", PPL)
    assert [column.format(v) for v in (100000.0, 123456.7, 57550.0, 2.2e24)] == ["100000", "123457", "57550.0",
                                                                                  "2.20000e+24"]


@needs_shared(TRAINED_TINY_GPT2)
@needs_shared(LAMBADA_FILE)
def test_a_perplexity_at_nvidias_cap_is_said_to_be_the_cap(capsys, tmp_path):
    """The trained tiny GPT-2 memorised neither of these two LAMBADA passages (--seed 0's): its token and seq ppl are
    NVIDIA's cap, 1e5, which the table showed as "100000." with nothing to say that it is a cap, not a measurement."""
    out, header, row = accuracy(capsys, tmp_path, TRAINED_TINY_GPT2, "--num-samples", 2,
                                data=LAMBADA_FILE)
    assert row["token_perplexity"] == row["sequence_perplexity"] == 100000.0
    line = next(line for line in out.splitlines() if line.startswith("frameworks"))
    assert line.split()[5:7] == ["100000", "100000"]
    assert ("100000 under token ppl and seq ppl is the cap of NVIDIA's demo (it reports min(perplexity, "
            "100000)), not a measured value" in out)


@needs_shared(TOKENIZER_DIR)
def test_no_cap_note_below_the_cap(capsys, tmp_path, tiny_gpt2_dir):
    out, _, row = accuracy(capsys, tmp_path, tiny_gpt2_dir)
    assert row["sequence_perplexity"] < 100000.0 and "is the cap" not in out


@needs_shared(TOKENIZER_DIR)
def test_the_note_says_seq_ppl_is_over_the_whole_passage(capsys, tmp_path, tiny_gpt2_dir):
    """The note said "top-N, token and sequence perplexity as NVIDIA's demo defines them over the last 2 token(s)";
    the sequence perplexity is the whole passage's (nndf.evaluation), only top-N and token ppl are the last tokens'."""
    out, _, _ = accuracy(capsys, tmp_path, tiny_gpt2_dir, "--tokens-to-generate", 2)
    assert ("top-N and token ppl as NVIDIA's demo defines them, over each passage's last 2 token(s), and seq ppl over "
            "the whole passage;") in out


@needs_shared(TOKENIZER_DIR)
def test_more_samples_than_passages_says_all_were_scored(capsys, tmp_path, tiny_gpt2_dir):
    """--num-samples 50 on a file of fewer passages titled the table "(all)" with nothing to say that fewer than asked
    for were scored."""
    out, _, row = accuracy(capsys, tmp_path, tiny_gpt2_dir, "--num-samples", 50)
    assert row["samples"] == len(PASSAGES) < 50
    assert (f"--num-samples 50 asked for more passages than the data set's {len(PASSAGES)}: all of them were "
            "scored") in out
    out, _, _ = accuracy(capsys, tmp_path, tiny_gpt2_dir, "--num-samples", len(PASSAGES))
    assert "asked for more passages" not in out


@needs_shared(TOKENIZER_DIR)
def test_passages_longer_than_the_positions_are_said_to_be_cut(capsys, tmp_path, tiny_gpt2_dir):
    """A passage longer than the model's positions was cut (as NVIDIA's demo and lm-eval cut it) without a word."""
    data = tmp_path / "long.jsonl"
    long = " ".join(["the cat sat on the mat"] * 40) + " and slept"  # ~240 tokens, the tiny GPT-2 has 128 positions
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in (*PASSAGES, long)), encoding="utf-8")
    out, _, row = accuracy(capsys, tmp_path, tiny_gpt2_dir, data=data)
    assert row["cut_passages"] == 1
    assert ("1 of the 3 passages are longer than the model's 128 positions and were cut as each tool cuts them"
            in out)
    out, _, row = accuracy(capsys, tmp_path, tiny_gpt2_dir)
    assert row["cut_passages"] == 0 and "longer than the model's" not in out
