"""convert_model's refusals (issue 12): bad and odd flag values, a model, tokenizer or checkpoint that does not fit,
each one sentence with exit 2 (a failed check exit 1), before anything is written; and transformer-deploy's flags."""

from __future__ import annotations

import json
import types

import pytest
from conftest import TOKENIZER_DIR, needs_shared

from nndf.convert.cli import main as convert_model

FAST = ["--nb-measures", "3", "--warmup", "1"]


def test_what_the_triton_repository_needs_is_checked_before_the_conversion(minilm_dir, tmp_path, capsys,
                                                                           monkeypatch):
    """A file where a Triton model folder goes, or no tritonclient, failed only after the conversion and the
    benchmark (1000 timed calls per backend by default)."""
    import sys

    from nndf.convert import cli

    monkeypatch.setattr(cli, "_load", lambda opts: pytest.fail("the model loaded before the refusal"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "transformer_onnx_inference").write_text("not a folder")
    assert convert_model(["-m", str(minilm_dir), "-o", str(out)]) == 2
    assert "transformer_onnx_inference is a file; the Triton model" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)  # as where the `triton` extra is not installed
    assert convert_model(["-m", str(minilm_dir), "-o", str(tmp_path / "other")]) == 1
    assert "needs tritonclient[grpc] (pip install 'nndf[triton]')" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["transformer_onnx_inference"]


@pytest.mark.parametrize("task, head", [("classification", "classifier.bias, classifier.weight"),
                                        ("question-answering", "qa_outputs.bias, qa_outputs.weight")])
def test_a_checkpoint_without_the_tasks_head_is_refused(task, head, minilm_dir, tmp_path, capsys):
    """all-MiniLM-L6-v2 under the default --task classification (a user who forgot --task embedding) converted,
    checked, timed and served a classifier head of random weights, with only transformers' load notice to say so."""
    out = tmp_path / "out"
    code = convert_model(["-m", str(minilm_dir), "--task", task, "-o", str(out), *FAST])
    err = capsys.readouterr().err
    assert code == 2 and f"has no trained weights for --task {task} ({head} are not in the checkpoint" in err, err
    assert "--task embedding" in err and "MISSING" not in err and "Traceback" not in err and not out.exists()


@needs_shared(TOKENIZER_DIR)
def test_a_single_missing_head_weight_is_said_in_the_singular_with_the_language_model_task(tiny_gpt2_dir, tmp_path,
                                                                                           capsys):
    """A GPT-2 language model under the default --task classification lacks one weight (score.weight): the refusal
    said "score.weight are not in the checkpoint, so they would be random", and named only --task embedding as the
    way out, not the text-generation a language model was trained for."""
    code = convert_model(["-m", str(tiny_gpt2_dir), "-o", str(tmp_path / "out"), "--backend", "pytorch", *FAST])
    err = capsys.readouterr().err
    assert code == 2 and "(score.weight is not in the checkpoint, so it would be random)" in err, err
    assert "a causal language model --task text-generation" in err


@pytest.mark.parametrize("argv, needle", [
    (["-b", "4", "2", "8"], "-b/--batch-size takes MIN OPT MAX with MIN <= OPT <= MAX, got 4 2 8"),
    (["-s", "0", "8", "8"], "-s/--seq-len values must be at least 1, got 0"),
    (["--backend", "tensorrt", "-d", "cpu"], "--backend tensorrt builds a TensorRT plan, which needs a CUDA GPU"),
    (["--nb-measures", "0"], "--nb-measures must be at least 1"),
    (["-s", "1", "8", "4096"], "-s/--seq-len MAX 4096 exceeds the 512 positions"),
    (["--generative-model", "t5"], "--generative-model t5: convert_model converts decoder-only (gpt) text generation"),
])
def test_bad_flags_are_one_sentence_and_exit_2(argv, needle, minilm_dir, tmp_path, capsys):
    code = convert_model(["-m", str(minilm_dir), "--task", "embedding", "-o", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["-n", ".x"], "-n/--name '.x' names Triton models: use letters, digits, - and _"),  # was refused after the run
    (["-n", "a:b"], "-n/--name 'a:b' names Triton models: use letters, digits, - and _"),  # was written as a:b_onnx_*
    (["--atol", "nan"], "--atol must be a positive number, got nan"),  # was blamed on the machine's noise
    (["--nb-threads", "100000"], "--nb-threads 100000 is more than the"),  # was a crash in OpenBLAS (exit 139)
    (["-b", "1", "1", "100000000000"], "-b/--batch-size MAX 100000000000 with -s/--seq-len MAX 16 needs at least"),
    (["-q", "--backend", "pytorch"], "with --backend pytorch alone there is nothing to quantize"),  # was ignored
    (["--seed", str(2**64)], f"--seed must be from 0 to 4294967295, got {2**64}"),  # was torch's overflow traceback
    (["--nb-instances", str(2**31)], "--nb-instances must be at most 2147483647"),  # was protobuf's, after the run
    (["-w", str(2**44)], "-w/--workspace-size must be at most 17592186044415 MiB"),  # overflowed TensorRT's size_t
])
def test_odd_values_are_refused_before_anything_is_written(argv, needle, minilm_dir, tmp_path, capsys):
    """Values that parsed but failed late (a name refused only by the repository writer, after the graphs and the
    benchmark), crashed (threads, a batch torch could not allocate: a traceback) or misled (NaN tolerance)."""
    out = tmp_path / "out"
    code = convert_model(["-m", str(minilm_dir), "--task", "embedding", "-o", str(out), *FAST, *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_tensorrt_profile_must_take_a_batch_of_1(minilm_dir, tmp_path, capsys, monkeypatch):
    """Triton hands the plan batches of 1 to -b MAX (a single text is a batch of 1): a profile from -b MIN 2 was
    built, checked and served, and the server then refused every lone request. ONNX Runtime takes any batch, so
    there -b MIN is only a check shape. (CUDA is made to look present: the refusal comes before any use of it.)"""
    import torch

    from nndf.convert import cli
    from nndf.convert.options import parse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "_load", lambda opts: pytest.fail("the model loaded before the refusal"))
    out = tmp_path / "out"
    code = convert_model(["-m", str(minilm_dir), "--backend", "onnx", "tensorrt", "-d", "cuda", "-b", "2", "4", "8",
                          "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "-b/--batch-size MIN 2 with --backend tensorrt: the served TensorRT plan gets batches of 1 " \
        "to MAX texts" in err and "give -b 1 4 8" in err and "Traceback" not in err, err
    assert not out.exists()
    assert parse(["-m", str(minilm_dir), "-d", "cpu", "-b", "2", "4", "8", "-o", str(out)]).batch_size == (2, 4, 8)


def test_missing_model_and_unfaithful_backend_are_errors_without_leftovers(minilm_dir, tmp_path, capsys):
    code = convert_model(["-m", str(tmp_path / "nowhere"), "-o", str(tmp_path / "a")])
    assert code == 2 and f"-m/--model {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    code = convert_model(["-m", str(tmp_path / "empty"), "-o", str(tmp_path / "a")])
    assert code == 2 and f"-m/--model {tmp_path / 'empty'} holds no config.json" in capsys.readouterr().err
    code = convert_model(["-m", str(minilm_dir / "config.json"), "-o", str(tmp_path / "a")])
    assert code == 2 and "config.json is a file; it takes a folder" in capsys.readouterr().err
    code = convert_model(["-m", str(minilm_dir), "-t", str(tmp_path / "empty"), "-o", str(tmp_path / "a")])
    assert code == 2 and f"-t/--tokenizer {tmp_path / 'empty'}: cannot load a tokenizer" in capsys.readouterr().err
    code = convert_model(["-m", "nobody/no-such-model", "-o", str(tmp_path / "a")])  # offline: not on this machine
    assert code == 2 and "-m/--model nobody/no-such-model: cannot load it from the Hugging Face hub (" in \
        capsys.readouterr().err
    assert not (tmp_path / "a").exists()  # no empty -o folder left by a model that did not load
    out, report = tmp_path / "b", tmp_path / "report.json"
    code = convert_model(["-m", str(minilm_dir), "--task", "embedding", "-q", "-o", str(out), "--atol", "1e-6",
                          "--json", str(report), *FAST])
    err = capsys.readouterr().err
    assert code == 1
    assert "[ONNX Runtime (INT-8)] output 'output' differs from PyTorch's by up to" in err
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    backends = json.loads(report.read_text())["backends"]  # what was measured before the failure is kept
    assert backends["ONNX Runtime (FP32)"]["max_abs_diff"] < 1e-6
    assert backends["ONNX Runtime (INT-8)"]["error"].startswith("[ONNX Runtime (INT-8)] output 'output' differs")


@needs_shared(TOKENIZER_DIR)
def test_the_tokenizer_must_fit_the_model_and_pad(minilm_dir, tmp_path, capsys):
    """A tokenizer with ids past the model's vocabulary is refused before anything is written; one without a
    padding token pads with its end token (the Triton tokenize model pads every request's texts)."""
    from transformers import AutoTokenizer

    from nndf.convert.cli import _check_tokenizer
    from nndf.convert.options import parse
    from nndf.errors import UsageError

    out = tmp_path / "out"
    code = convert_model(["-m", str(minilm_dir), "-t", str(TOKENIZER_DIR), "--task", "embedding", "-o", str(out)])
    assert code == 2 and (f"-t/--tokenizer {TOKENIZER_DIR}: the tokenizer has 50257 tokens and the model's "
                          "vocabulary 30522") in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
    opts = parse(["-m", str(minilm_dir), "-t", str(TOKENIZER_DIR), "-b", "1", "2", "4", "-o", str(out)])
    gpt2 = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    _check_tokenizer(opts, gpt2, types.SimpleNamespace(vocab_size=50257))
    assert gpt2.pad_token == "<|endoftext|>"
    assert gpt2(["a", "a b c"], padding=True)["attention_mask"][0] == [1, 0, 0]
    gpt2.pad_token, gpt2.eos_token = None, None
    with pytest.raises(UsageError, match="has no padding token .* batches of up to 4 texts"):
        _check_tokenizer(opts, gpt2, types.SimpleNamespace(vocab_size=50257))


def test_a_path_with_a_tilde_is_the_home_folders(minilm_dir, tmp_path, monkeypatch):
    """The shell does not expand ~ after `=` (--model=~/minilm): -m passed the existence check (which expanded it),
    then the tokenizer's load took '~/minilm' for a hub id and failed; -o and --json made a folder named '~'."""
    from nndf.convert.options import parse

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "minilm").symlink_to(minilm_dir)
    opts = parse(["--model=~/minilm", "--tokenizer=~/minilm", "--output=~/out", "--json=~/r.json"])
    assert (opts.model, opts.tokenizer) == (str(tmp_path / "minilm"),) * 2
    assert (opts.output, opts.json) == (str(tmp_path / "out"), str(tmp_path / "r.json"))


def test_transformer_deploy_flags_are_accepted(minilm_dir, tmp_path):
    from nndf.convert.options import parse, parser
    from nndf.errors import UsageError

    assert "nothing either (default: True)" not in " ".join(parser().format_help().split())  # the default is off

    base = ["-m", str(minilm_dir), "-o", str(tmp_path / "out")]
    assert parse([*base, "--auth-token", "true", "--load-external-data"]).auth_token is True
    assert parse([*base, "--auth-token", "hf_abc", "--no-load-external-data"]).auth_token == "hf_abc"
    assert parse([*base, "--generative-model", "gpt"]).auth_token is None
    # transformer-deploy's parser spelled it --generative_model (commits 01edf51 to 3933e9b): it was refused here
    assert parse([*base, "--generative_model", "gpt"]).model == str(minilm_dir)
    with pytest.raises(UsageError, match="--generative-model t5: convert_model converts decoder-only"):
        parse([*base, "--generative_model", "t5"])


def test_transformer_deploy_flags_that_change_nothing_here_say_so(minilm_dir, tmp_path, capsys):
    """--fast on the CPU and -w without TensorRT were taken without a word, as though they had applied; they stay
    accepted (transformer-deploy's scripts pass them everywhere) with a line on stderr."""
    from nndf.convert.options import WORKSPACE_MIB, parse

    base = ["-m", str(minilm_dir), "-o", str(tmp_path / "out"), "-d", "cpu"]
    opts = parse([*base, "--fast", "-w", "2048"])
    err = capsys.readouterr().err
    assert opts.fast and opts.workspace_size == 2048
    assert ("note: --fast skips the PyTorch fp16 benchmark, which runs on a GPU only; on the CPU it changes nothing"
            in err)
    assert "note: -w/--workspace-size sizes TensorRT's build; without --backend tensorrt it changes nothing" in err
    assert parse(base).workspace_size == WORKSPACE_MIB and capsys.readouterr().err == ""
