"""Every registered family: its variants' known configs, the family names users type, and every action on a tiny
model of each decoder family (text actions with the real GPT-2 tokenizer). Parity with Hugging Face `generate()`
on every backend: tests/test_family_parity.py."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import build_tiny, decoder_only_families
from family_examples import FAMILY_EXAMPLES
from nndf.loading import known_config
from nndf.registry import FAMILIES, get_spec, resolve

FAMILY_NAMES = list(FAMILIES)


def test_every_family_has_a_test_example():
    assert set(FAMILY_EXAMPLES) == set(FAMILIES)


def _params(label: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)([MB])", label).groups()
    return float(number) * (1e6 if unit == "M" else 1e9)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_known_configs_have_the_published_sizes(family):
    """Each variant's known config, built on the meta device, has the parameter count its name says (within 12%):
    a wrong layer count, width or vocabulary shows up here."""
    import transformers

    spec = get_spec(family)
    auto = getattr(transformers, spec.auto_class)
    for variant in spec.variants:
        with torch.device("meta"):
            model = auto.from_config(known_config(variant))
        count = sum(p.numel() for p in model.parameters())
        if variant.config.get("tie_word_embeddings") is False and model.get_output_embeddings() is not None and \
                model.get_output_embeddings().weight is model.get_input_embeddings().weight:
            # Flan-T5 is published with an untied head; transformers 5 ties T5 v1.1's head to the embedding in the
            # module (T5Config forces tie_word_embeddings=True), so the published count has one table more.
            count += model.get_output_embeddings().weight.numel()
        assert count == pytest.approx(_params(variant.params), rel=0.12), variant.name
        assert spec.hooks.max_positions(model.config) >= 512


def test_gpt2_family_name_reaches_the_families_nvidia_runs_under_it():
    for hub_id, family in [("EleutherAI/gpt-j-6B", "GPTJ"), ("EleutherAI/gpt-neo-1.3B", "GPTNeo"),
                           ("EleutherAI/gpt-neox-20b", "GPTNeoX"), ("cerebras/Cerebras-GPT-111M", "CerebrasGPT")]:
        spec, variant = resolve("GPT2", hub_id)
        assert (spec.family, variant.hub_id) == (family, hub_id)
    assert resolve("gpt-neo", "gpt-neo-125m")[0].family == "GPTNeo"


# The real GPT-2 tokenizer's ids run to 50256.
GPT2_TOKENIZER_SIZE = 50257


@pytest.fixture(scope="module")
def family_dirs_with_tokenizer(tmp_path_factory, family_dirs):
    """Tiny models whose vocabulary holds the real GPT-2 tokenizer's ids, so that text actions can run on them: a
    family example whose vocabulary already does is its own folder (its exports are the family tests')."""
    from conftest import TOKENIZER_DIR

    if not TOKENIZER_DIR.exists():
        pytest.skip(f"{TOKENIZER_DIR} is absent (../shared/data is not beside this checkout)")
    root = tmp_path_factory.mktemp("families-text")
    return {name: family_dirs[name] if config["vocab_size"] >= GPT2_TOKENIZER_SIZE
            else build_tiny(root, name, dict(config, vocab_size=50272))
            for name, config in FAMILY_EXAMPLES.items() if name in decoder_only_families()}


@pytest.mark.parametrize("family", decoder_only_families())
def test_every_action_runs_for_every_family(family, family_dirs_with_tokenizer, capsys, monkeypatch):
    import io
    import sys

    from conftest import LAMBADA_FILE
    from nndf.cli import main

    model = ["--torch-dir", str(family_dirs_with_tokenizer[family])]
    fast = ["--iterations", "1", "--warmup", "0"]
    runs = [
        ["benchmark", family, "frameworks", *model, "--input-seq-len", "5", "--output-seq-len", "3", *fast],
        ["run", family, "frameworks", *model, "--output-seq-len", "4", *fast],
        ["compare", family, "frameworks", *model, "--output-seq-len", "4", *fast],
        ["accuracy", family, "frameworks", *model, "--dataset-file", str(LAMBADA_FILE), "--num-samples", "3"],
        ["chat", family, "frameworks", *model, "--output-seq-len", "3"],
    ]
    for argv in runs:
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nexit\n"))
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, f"{argv[0]}: {err}"
        assert f"{argv[0]} " in out and "frameworks" in out


@pytest.mark.parametrize("family", ["Phi3", "Gemma"])  # longrope past its switch; soft-capping and local windows
def test_accuracy_on_onnxrt_gives_the_pytorch_figures(family, family_dirs_with_tokenizer, onnx_work_dir, tmp_path,
                                                      capsys):
    """`accuracy` on the exported graph: LAMBADA passages (longer than the tiny models' windows and longrope's
    original length) score as on PyTorch, and the fidelity columns say so. Both examples hold GPT-2's vocabulary, so
    the graph is the family tests' export (the shared working dir)."""
    import json

    from conftest import LAMBADA_FILE
    from nndf.cli import main

    out = tmp_path / "accuracy.json"
    code = main(["accuracy", family, "frameworks", "onnxrt", "--torch-dir", str(family_dirs_with_tokenizer[family]),
                 "--dataset-file", str(LAMBADA_FILE), "--num-samples", "4", "--working-dir", str(onnx_work_dir),
                 "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    pytorch, onnxrt = json.loads(out.read_text())["results"][0]["rows"]
    assert onnxrt["top1_agreement"] == 1.0 and onnxrt["mean_kl"] < 1e-6
    for metric in ("top1", "token_perplexity", "sequence_perplexity", "lm_eval_accuracy", "lm_eval_perplexity"):
        assert onnxrt[metric] == pytest.approx(pytorch[metric], rel=1e-4), metric
