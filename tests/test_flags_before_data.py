"""`accuracy` and `evaluate` check every flag, then this machine, then read their data, then load the model: a user
with a typo in a flag is told about the typo, not about a data set the hub cannot give offline (exit 1), and a data
set that cannot be read is still told before any weights load."""

from __future__ import annotations

import pytest

from conftest import SHARED_DATA
from test_cli import run_cli

OFFLINE_LAMBADA = "the LAMBADA dataset EleutherAI/lambada_openai could not be loaded from the Hugging Face hub"
OFFLINE_TASK = "lm-eval task lambada_openai reads its data set EleutherAI/lambada_openai from the Hugging Face hub"

# (backends and flags, the sentence said instead of the data set's, exit code): usage errors of open_models' kinds,
# then the machine's refusals (checked after every flag, as nndf.actions.plans.check_machine says why)
BEFORE_DATA = [
    (["frameworks", "--batch-size", "0"], "--batch-size must be at least 1, got 0", 2),
    (["frameworks", "--int8"], "--int8 applies to the onnxrt backend(s); add one of them", 2),
    (["frameworks", "--kv-layout", "growing"], "--kv-layout lays out the onnxrt backend's graph", 2),
    # (the tests below see no GPU: no_cuda)
    (["frameworks", "--cuda-graph"], "--cuda-graph replays decode steps on a CUDA GPU, and none is visible", 2),
    (["frameworks", "trt"], "the trt backend needs", 1),
]


@pytest.mark.parametrize(("flags", "message", "code"), BEFORE_DATA)
def test_accuracy_says_a_bad_flag_before_the_hub_data_it_cannot_read_offline(flags, message, code, tiny_gpt2_dir,
                                                                           monkeypatch, capsys, no_cuda):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got, _, err = run_cli(capsys, "accuracy", "GPT2", *flags, "--torch-dir", tiny_gpt2_dir)
    assert (got, err.count("\n")) == (code, 1), err
    assert message in err and OFFLINE_LAMBADA not in err


def test_accuracy_says_a_data_set_it_cannot_read_before_loading_the_model(tiny_gpt2_dir, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(capsys, "accuracy", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir)
    assert code == 1 and OFFLINE_LAMBADA in err and "loading" not in err


@pytest.mark.skipif(not SHARED_DATA.exists(), reason=f"{SHARED_DATA} is absent (lm-eval's tests need its data)")
@pytest.mark.parametrize(("flags", "message", "code"), BEFORE_DATA)
def test_evaluate_says_a_bad_flag_before_the_hub_data_it_cannot_read_offline(flags, message, code, tiny_gpt2_dir,
                                                                           onnx_work_dir, monkeypatch, capsys,
                                                                           no_cuda):
    pytest.importorskip("lm_eval", reason="lm-eval (the eval and test extras) is absent")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got, _, err = run_cli(capsys, "evaluate", "GPT2", *flags, "--torch-dir", tiny_gpt2_dir, "--tasks",
                          "lambada_openai", "--working-dir", onnx_work_dir)  # lm-eval's task index kept there once
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert (got, len(errors)) == (code, 1), err
    assert message in errors[0] and OFFLINE_TASK not in err


@pytest.mark.parametrize("flags, message", [
    (["--topN", 50258], "--topN 50258 covers all 50257 tokens of this model's vocabulary (its top-N would always be "
                        "100%); give less than 50257"),
    (["--topN", 50257], "--topN 50257 covers all 50257 tokens"),
    (["--tokens-to-generate", 128], "--tokens-to-generate 128 leaves no position for a passage's context in this "
                                    "model's 128; give less than 128"),  # every passage was skipped, the columns "-"
])
def test_lambada_settings_that_say_nothing_are_refused_before_scoring(capsys, tiny_gpt2_dir, tmp_path, flags, message):
    passages = tmp_path / "lambada.jsonl"
    passages.write_text('{"text": "the cat sat on the mat"}\n')
    code, _, err = run_cli(capsys, "accuracy", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir, "--dataset-file",
                           passages, *flags)
    assert code == 2 and message in err and "loading" not in err
