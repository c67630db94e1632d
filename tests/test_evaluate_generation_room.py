"""`evaluate`: a generation task's new tokens against a decoder-only model's positions, checked before the load."""

from __future__ import annotations

import json

import pytest

from conftest import LAMBADA_FILE, TRAINED_TINY_GPT2, needs_shared

pytest.importorskip("lm_eval", reason="lm-eval (the eval and test extras) is absent")


def generation_task(tmp_path, **generation) -> None:
    """A generate_until task over two LAMBADA passages, in `tmp_path` as a task folder (--include-path)."""
    data = tmp_path / "passages.jsonl"
    data.write_text("".join(LAMBADA_FILE.read_text(encoding="utf-8").splitlines(keepends=True)[:2]), encoding="utf-8")
    task = {"task": "generate_local", "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
            "doc_to_target": "{{' '+text.split(' ')[-1]}}", "generation_kwargs": {"until": ["\n"], **generation},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    (tmp_path / "generate_local.yaml").write_text(json.dumps(task))  # JSON is YAML


def evaluate(tmp_path, capsys, *flags):
    from nndf.cli import main

    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(TRAINED_TINY_GPT2), "--tasks", "generate_local",
                 "--include-path", str(tmp_path), "--limit", "1", "--bootstrap-iters", "0", *flags])
    return code, capsys.readouterr().err


@needs_shared(TRAINED_TINY_GPT2)
@needs_shared(LAMBADA_FILE)
@pytest.mark.parametrize("flags, said", [
    ([], "--max-gen-toks 256 (its default), the new tokens of lm-eval task generate_local's answers, leaves no "
         "position for their context in this model's 256 positions; give less than 256"),
    (["--max-gen-toks", "100000"], "--max-gen-toks 100000, the new tokens"),
])
def test_new_tokens_that_fill_the_positions_are_refused_before_the_load(tmp_path, capsys, flags, said):
    """The trained tiny GPT-2 has 256 positions: lm-eval's default 256 new tokens left no context, which was said
    after the load and the exports, exit 1, as "max_gen_toks 256 leaves no room ..." (no flag the user typed)."""
    generation_task(tmp_path)
    code, err = evaluate(tmp_path, capsys, *flags)
    assert code == 2 and f"error: {said}" in err, err
    assert "loading" not in err


@needs_shared(TRAINED_TINY_GPT2)
@needs_shared(LAMBADA_FILE)
def test_a_task_that_sets_too_many_new_tokens_itself_is_named_before_the_load(tmp_path, capsys):
    generation_task(tmp_path, max_gen_toks=300)
    code, err = evaluate(tmp_path, capsys, "--max-gen-toks", "8")  # the task's own wins, as in lm-eval
    assert code == 1 and ("lm-eval task generate_local sets max_gen_toks 300, which leaves no position for its "
                          "context in this model's 256 positions") in err, err
    assert "loading" not in err


@needs_shared(TRAINED_TINY_GPT2)
@needs_shared(LAMBADA_FILE)
def test_new_tokens_within_the_positions_run(tmp_path, capsys):
    generation_task(tmp_path)
    code, err = evaluate(tmp_path, capsys, "--max-gen-toks", "8")
    assert code == 0, err
