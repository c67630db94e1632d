"""Tests for nndf.lambada: reading LAMBADA jsonl files (one sentence naming the bad line), the hub fallback, and
the seeded passage sample that `accuracy --num-samples` scores."""

from __future__ import annotations

import json
import random

import pytest

from nndf.errors import HarnessError, UsageError
from nndf.lambada import load_lambada, read_jsonl_texts, sample_texts


def test_read_jsonl_texts_skips_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "one two"}\n\n{"text": "three four", "id": 3}\n', encoding="utf-8")
    assert read_jsonl_texts(p) == ["one two", "three four"]


def test_read_jsonl_missing_file(tmp_path):
    with pytest.raises(UsageError, match=r"nope\.jsonl does not exist; pass a jsonl file"):
        read_jsonl_texts(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [("not json", "not valid JSON"), ('["text"]', "not an object"), ('{"txt": "a b"}', 'no string "text"'),
     ('{"text": 5}', 'no string "text"'), ('{"text": "  "}', 'empty "text"')],
)
def test_read_jsonl_bad_line_names_its_line_number(tmp_path, bad_line, reason):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine line"}\n\n' + bad_line + "\n", encoding="utf-8")
    with pytest.raises(UsageError) as info:
        read_jsonl_texts(p)
    assert f"{p} line 3 " in str(info.value) and reason in str(info.value)


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_read_jsonl_empty_file(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError, match="contains no passages"):
        read_jsonl_texts(p)


def test_load_lambada_from_file(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text(json.dumps({"text": "a b c"}) + "\n", encoding="utf-8")
    assert load_lambada(str(p)) == ["a b c"]


def test_load_lambada_hub_failure_is_a_harness_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(HarnessError, match="Hugging Face hub.*--dataset-file PATH"):
        load_lambada(None)


def test_sample_texts_all_when_none_zero_or_too_many():
    texts = ["a", "b", "c"]
    expected = [(0, "a"), (1, "b"), (2, "c")]
    assert sample_texts(texts, None) == expected
    assert sample_texts(texts, 0) == expected
    assert sample_texts(texts, 10) == expected


def test_sample_texts_is_seeded_and_in_index_order():
    texts = [f"t{i}" for i in range(100)]
    first = sample_texts(texts, 10, seed=3)
    assert first == sample_texts(texts, 10, seed=3)
    indices = [i for i, _ in first]
    assert indices == sorted(random.Random(3).sample(range(100), 10))
    assert indices == sorted(set(indices)) and all(texts[i] == t for i, t in first)
    assert indices != [i for i, _ in sample_texts(texts, 10, seed=4)]


def test_sample_texts_negative_is_a_usage_error():
    with pytest.raises(UsageError, match="--num-samples"):
        sample_texts(["a"], -1)
