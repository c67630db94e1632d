"""`run` and `compare` as a user meets them: the order of their refusals, and what their tables say."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_GPT2, TOKENIZER_DIR, build_tiny, needs_shared
from test_cli import run_cli

SHORT_SAMPLE = ("error: the sample of models/gpt2/checkpoint.toml 'TensorRT is a Deep Learning compiler used ...': a "
                "prompt of 13 tokens plus 51 new tokens is 64, more than the 16 positions of this model "
                "(--output-seq-len sets the new tokens)")


@pytest.fixture(scope="module")
def short_gpt2(tmp_path_factory):
    """A tiny GPT-2 of 16 positions: fewer than the family's first sample and its label need."""
    return build_tiny(tmp_path_factory.mktemp("short"), "short", {**TINY_GPT2, "n_positions": 16})


@needs_shared(TOKENIZER_DIR)
@pytest.mark.parametrize("action, backends", [("run", ["trt"]), ("compare", ["onnxrt", "trt"])])
def test_a_sample_too_long_is_refused_before_the_machine_and_the_load(action, backends, short_gpt2, tmp_path,
                                                                      capsys, monkeypatch):
    """A sample too long for the model is the user's to fix (--output-seq-len, another model): it is said (exit 2)
    before trt's refusal of a machine without a GPU (exit 1), and before any weights load or graph is exported."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is present
    work = tmp_path / "work"
    code, out, err = run_cli(capsys, action, "GPT2", *backends, "--torch-dir", short_gpt2, "--working-dir", work)
    assert (code, out) == (2, "") and err.strip() == SHORT_SAMPLE
    assert not work.exists(), "nothing exported"


@pytest.mark.parametrize("action, flag", [("run", ["--percentile", "101"]), ("compare", ["--iterations", "0"])])
def test_timing_flags_are_refused_before_the_load(action, flag, tiny_gpt2_dir, tmp_path, capsys):
    """A timing flag out of range is refused (exit 2) before the weights load and the onnxrt graph is exported."""
    work = tmp_path / "work"
    code, out, err = run_cli(capsys, action, "GPT2", "onnxrt", "--torch-dir", tiny_gpt2_dir, "--working-dir", work,
                             *flag)
    assert (code, out) == (2, "") and "loading" not in err and not work.exists()
    assert err.strip() == {"run": "error: --percentile must be a number from 0 to 100, got 101.0",
                           "compare": "error: --iterations must be a whole number of at least 1, got 0"}[action]


@pytest.mark.parametrize("action, flags, message", [
    ("run", ["--top-k", "5"], "error: --top-k shapes sampled draws, and this run does not sample (the model's "
                              "generation config does not sample): add --do-sample, or leave it out"),
    ("benchmark", ["--temperature", "0.7"], "error: --temperature shapes sampled draws, and this run does not sample"),
    ("chat", ["--top-p", "0.9", "--min-p", "0.1"], "error: --top-p and --min-p shape sampled draws"),
])
def test_draw_flags_that_cannot_apply_are_refused_before_the_export(action, flags, message, tiny_gpt2_dir, tmp_path,
                                                                     capsys, monkeypatch):
    """Refused (exit 2) from the model's generation config alone: it came after the weights loaded and the onnxrt
    graph was exported, and on trt after the no-GPU refusal."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    work = tmp_path / "work"
    code, out, err = run_cli(capsys, action, "GPT2", "onnxrt", "trt", "--torch-dir", tiny_gpt2_dir,
                             "--working-dir", work, *flags)
    assert (code, out) == (2, "") and err.startswith(message) and "loading" not in err and not work.exists()


@needs_shared(TOKENIZER_DIR)
def test_the_tokenizer_that_checks_the_samples_is_the_one_the_run_uses(tiny_gpt2_dir, capsys, monkeypatch):
    """The samples' lengths are checked with the model's own (lazily loaded) tokenizer: loaded once per command."""
    import nndf.loading

    loads = []
    original = nndf.loading.load_tokenizer
    monkeypatch.setattr(nndf.loading, "load_tokenizer", lambda *a, **k: loads.append(a) or original(*a, **k))
    code, _, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir, "--output-seq-len", 2,
                           "--iterations", 1, "--warmup", 0)
    assert code == 0, err
    assert len(loads) == 1


@needs_shared(TOKENIZER_DIR)
@pytest.mark.parametrize("asked", [8, 60])
def test_output_seq_len_is_the_new_tokens_beside_a_label_shorter_or_longer(asked, tiny_gpt2_dir, capsys,
                                                                           monkeypatch):
    """--output-seq-len sets how many tokens each sample generates, as --help and the table's note say: fewer than
    the GPT-2 sample's 51-token label, and more (it used to stop at the label's length); the label is still scored
    over its own tokens."""
    import nndf.actions.run

    asked_for = []
    original = nndf.actions.run.time_generation

    def timed(runner, inputs, new_tokens, *args, **kwargs):
        asked_for.append(new_tokens)
        return original(runner, inputs, new_tokens, *args, **kwargs)

    monkeypatch.setattr(nndf.actions.run, "time_generation", timed)
    code, out, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir, "--output-seq-len",
                             asked, "--iterations", 1, "--warmup", 0)
    assert code == 0, err
    assert asked_for == [asked, asked]  # our loop, then HF generate(), on the one sample
    assert f"+ up to {asked} tokens" in err


@pytest.mark.parametrize(("action", "iterations", "warmup"), [("run", 3, 1), ("compare", 3, 1), ("benchmark", 10, 3)])
def test_help_gives_each_action_its_own_timing_defaults(action, iterations, warmup):
    """run and compare time each sample 3 times after 1 warm-up call; their --help said benchmark's 10 and 3."""
    from nndf.cli import build_parser

    subparser = build_parser().action_parsers[action]
    text = " ".join(subparser.format_help().split())
    assert f"timed samples (default {iterations})" in text and f"untimed calls first (default {warmup})" in text
    assert (subparser.get_default("iterations"), subparser.get_default("warmup")) == (iterations, warmup)


@needs_shared(TOKENIZER_DIR)
def test_when_every_generation_ends_at_once_the_plot_says_why_there_is_no_decode_step(tiny_gpt2_dir, tmp_path,
                                                                                      capsys, monkeypatch, no_cuda):
    """Every token an end of sequence: each sample's generation ends at its first token, so no decode step is
    timed; the table's note and the plot's decode panel both say why (the panel said "not measured in this run").
    On the CPU: on a GPU our loop asks whether every row has ended only every few steps (`GPU_STOP_CHECK_EVERY`),
    so steps past the end run, are timed, and are cut from the output."""
    import json
    import shutil

    import nndf.actions.compare
    from nndf.cli import main

    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from nndf.plots import draw_bars, plot_bars

    folder = tmp_path / "ends-at-once"
    shutil.copytree(tiny_gpt2_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    generation = {"eos_token_id": list(range(config["vocab_size"])), "pad_token_id": 0}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    drawn = []
    monkeypatch.setattr(nndf.actions.compare, "plot_bars",
                        lambda path, title, rows, panels: drawn.append((rows, panels)) or plot_bars(path, title, rows,
                                                                                                   panels))
    code = main(["compare", "GPT2", "frameworks", "--torch-dir", str(folder), "--iterations", "1", "--warmup", "0",
                 "--plot", str(tmp_path / "compare.png")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "decode step: '-' where every generation ended at its first token (EOS at once): no step to time." in out
    [(rows, panels)] = drawn
    fig = Figure()
    draw_bars(fig, "t", rows, panels)
    decode = fig.axes[1]
    assert " ".join(t.get_text() for t in decode.texts).replace("\n", " ") == (
        "every generation ended at its first token (EOS at once): no step to time")
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
