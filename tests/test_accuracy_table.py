"""The `accuracy` table as a user reads it: one column per top-N, in increasing N, and notes for what looks odd."""

from __future__ import annotations

import json

import pytest

from conftest import TOKENIZER_DIR, needs_shared
from nndf.cli import main

PASSAGES = ["The cat sat on the mat and looked at the door for a long time",
            "She opened the window and the cold air of the morning came into the room"]


def accuracy(capsys, tmp_path, model_dir, *flags):
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
