"""Every registered family: its variants' known configs, and parity with Hugging Face generate() on frameworks
and onnxrt for greedy search, beam search and seeded sampling (with the streamer's calls), batches with masks, with
and without cache."""

from __future__ import annotations

import re

import pytest
import torch

import nndf
from conftest import build_tiny, decoder_only_families
from family_examples import FAMILY_EXAMPLES
from sampling_checks import assert_samples_like_generate
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


def _prompts(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 990, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :6] = 0
    return ids, mask


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("backend", ["frameworks", "onnxrt"])
@pytest.mark.parametrize("family", decoder_only_families())  # encoder-decoder ones: tests/test_seq2seq.py
def test_family_parity_with_hf_generate(family, backend, use_cache, family_dirs, onnx_work_dir):
    m = nndf.load(family, backend=backend, torch_dir=str(family_dirs[family]), use_cache=use_cache,
                  working_dir=str(onnx_work_dir), device="cpu")
    ids, mask = _prompts()
    for num_beams in (1, 3):
        ours = m.generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
        reference = m.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
        assert torch.equal(ours, reference), f"{family} {backend} beams={num_beams}"
    assert_samples_like_generate(m, input_ids=ids, attention_mask=mask, max_new_tokens=12)


@pytest.mark.parametrize("family", decoder_only_families())
def test_onnx_graph_is_exact_up_to_the_last_position(family, family_dirs, onnx_work_dir):
    """The export traces with past and new lengths of at most half the positions each (see `dynamic_dims`); the
    graph must stay exact beyond that: a prompt of 3/4 of the positions, decoding to the very last one, and logits
    for a whole max-length text at once."""
    m = nndf.load(family, backend="onnxrt", torch_dir=str(family_dirs[family]), working_dir=str(onnx_work_dir),
                  device="cpu")
    length = m.max_positions * 3 // 4
    ids = torch.randint(4, 990, (2, length), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    new = m.max_positions - length
    ours = m.generate(ids, mask, max_new_tokens=new, min_new_tokens=new)
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=new, min_new_tokens=new)), family
    full = ours[:1, -m.max_positions:]  # scoring: logits for every one of max_positions tokens at once
    torch.testing.assert_close(m.logits(full), m.reference_logits(full), rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def family_dirs_with_tokenizer(tmp_path_factory):
    """Tiny models whose vocabulary holds the real GPT-2 tokenizer's ids, so that text actions can run on them."""
    from conftest import TOKENIZER_DIR

    if not TOKENIZER_DIR.exists():
        pytest.skip(f"{TOKENIZER_DIR} is absent (../shared/data is not beside this checkout)")
    root = tmp_path_factory.mktemp("families-text")
    return {name: build_tiny(root, name, dict(config, vocab_size=max(50272, config["vocab_size"])))
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
