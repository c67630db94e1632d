"""LAMBADA passages: a jsonl file with a "text" field per line, or the `lambada_openai` test split from the hub,
and a seeded sample of them. The jsonl checker serves `evaluate`'s --dataset-file of any
task too. Every malformed input is one UsageError that names the file and line to fix.

Kept apart from `nndf.evaluation` (which scores passages) because reading and choosing them is the same for
decoder-only and encoder-decoder scoring.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from nndf.errors import HarnessError, UsageError

_JSONL_HINT = 'pass a jsonl file with one {"text": ...} object per line'
_LAMBADA_HUB = ("EleutherAI/lambada_openai", "default", "test")



def read_jsonl_records(path: str | Path, hint: str, rows: str = "rows") -> list[tuple[int, dict]]:
    """(line number, object) of every line of a jsonl file, failing with the file and line a user must fix, and
    `hint` (what the file should hold; `rows`: what its lines are called). Blank lines are skipped, so a trailing newline or a gap does not count as a
    malformed row. `accuracy` reads LAMBADA with it, `evaluate` checks a --dataset-file with it before a model
    loads (lm-eval would stop later, with a bare StopIteration for an empty file)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"dataset file {p} does not exist; {hint}")
    if not p.is_file():
        raise UsageError(f"dataset file {p} is not a regular file; {hint}")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UsageError(f"dataset file {p} is not UTF-8 text ({exc.reason}); {hint}") from exc
    except OSError as exc:
        raise UsageError(f"dataset file {p} cannot be read ({exc.strerror}); {hint}") from exc

    records: list[tuple[int, dict]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"dataset file {p} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where} is not valid JSON ({exc.msg}); {hint}") from exc
        if not isinstance(record, dict):
            raise UsageError(f"{where} is a JSON {type(record).__name__}, not an object; {hint}")
        records.append((number, record))
    if not records:
        raise UsageError(f"dataset file {p} contains no {rows}; {hint}")
    return records


def read_jsonl_texts(path: str | Path) -> list[str]:
    """The "text" field of every line of a jsonl file (`read_jsonl_records`), each a passage with words."""
    texts: list[str] = []
    for number, record in read_jsonl_records(path, _JSONL_HINT, "passages"):
        where = f"dataset file {Path(path)} line {number}"
        text = record.get("text")
        if not isinstance(text, str):
            raise UsageError(f'{where} has no string "text" field; {_JSONL_HINT}')
        if not text.strip():
            raise UsageError(f'{where} has an empty "text"; every passage needs words to score')
        texts.append(text)
    return texts


def load_lambada(dataset_file: str | None) -> list[str]:
    """LAMBADA passages from `dataset_file` if given, else the `lambada_openai` test split from the Hugging Face hub."""
    if dataset_file is not None:
        return read_jsonl_texts(dataset_file)
    name, config, split = _LAMBADA_HUB
    try:
        import datasets

        texts = list(datasets.load_dataset(name, config, split=split)["text"])
    except Exception as exc:  # any hub/cache/network failure means the same thing to the user
        raise HarnessError(
            f"the LAMBADA dataset {name} could not be loaded from the Hugging Face hub (offline? {exc}); "
            'pass --dataset-file PATH with a jsonl file that has a "text" field per line, '
            "e.g. LAMBADA's lambada_test.jsonl"
        ) from exc
    if not texts:
        raise HarnessError(f"the LAMBADA dataset {name} loaded from the hub is empty; pass --dataset-file PATH instead")
    return texts


def sample_texts(texts: Sequence[str], num_samples: int | None, seed: int = 0) -> list[tuple[int, str]]:
    """A reproducible subset of `(index, text)` pairs, kept in dataset order so runs are easy to compare.

    None or 0 means every passage; asking for more than exist also gives every passage.
    """
    if num_samples is not None and num_samples < 0:
        raise UsageError(f"--num-samples must be 0 (all passages) or a positive count, got {num_samples}")
    if not num_samples or num_samples >= len(texts):
        return list(enumerate(texts))
    chosen = sorted(random.Random(seed).sample(range(len(texts)), num_samples))
    return [(i, texts[i]) for i in chosen]
