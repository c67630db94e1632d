"""The Llama-class families' quirks: each one switched on for real in the tiny examples, and exact where the parity
tests' shapes do not reach.

tests/test_family_parity.py compares whole sequences with Hugging Face `generate()` on every backend. Here:
the same weights without a quirk compute other logits (so a backend that lost it could not pass those tests),
longrope's two factor sets in the exported graph, Phi-3's cache restart on the trt runner, the KV cache of
grouped-query attention in `--info`, and any hub id of a family's architecture as a variant.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TOKENIZER_DIR, needs_shared
from fake_tensorrt import fake_gpu  # noqa: F401  (a fixture)
from test_cli import run_cli

import nndf
from nndf.errors import UsageError
from nndf.loading import known_config
from nndf.registry import get_spec
from nndf.spec import BuildSettings, ShapeSpec


def _ids(length: int, rows: int = 2, seed: int = 7) -> torch.Tensor:
    return torch.randint(4, 990, (rows, length), generator=torch.Generator().manual_seed(seed))


def _no_rope_scaling(config):
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}


def _short_factors_only(config):
    config.rope_parameters = dict(config.rope_parameters, long_factor=config.rope_parameters["short_factor"])


def _zero_qkv_biases(model):
    for name, parameter in model.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            parameter.data.zero_()


def _unit_qk_norms(model):
    for name, parameter in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            parameter.data.fill_(1.0)


# (family, what the quirk is, config change or model change that removes it)
QUIRKS = [
    ("Llama", "llama3 rope scaling", _no_rope_scaling, None),
    ("Mistral", "sliding window shorter than the sequence", lambda c: setattr(c, "sliding_window", None), None),
    ("Qwen2", "q/k/v biases", None, _zero_qkv_biases),
    ("Qwen3", "q/k norm weights", None, _unit_qk_norms),
    ("Phi3", "longrope long factors past the original length", _short_factors_only, None),
    ("Gemma", "attention soft-capping", lambda c: setattr(c, "attn_logit_softcapping", None), None),
    ("Gemma", "final logit soft-capping", lambda c: setattr(c, "final_logit_softcapping", None), None),
    ("Gemma", "local layers' window", lambda c: setattr(c, "sliding_window", 128), None),
]


@pytest.mark.parametrize("family, quirk, config_change, model_change", QUIRKS, ids=[q[1] for q in QUIRKS])
def test_each_quirk_changes_the_tiny_models_logits(family, quirk, config_change, model_change, family_dirs):
    """Without the quirk the same weights compute other logits over a 24-token text: the parity tests, which use
    these models, would see a backend that lost it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = family_dirs[family]
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config).eval()
    changed_config = AutoConfig.from_pretrained(folder)
    if config_change is not None:
        config_change(changed_config)
    changed = AutoModelForCausalLM.from_pretrained(folder, config=changed_config).eval()
    if model_change is not None:
        model_change(changed)
    ids = _ids(24)
    with torch.no_grad():
        difference = (model(ids).logits - changed(ids).logits).abs().max().item()
    assert difference > 1e-2, f"{family}: {quirk} makes no difference to the tiny model"


def test_longrope_graph_takes_each_factor_set_on_its_side_of_the_switch(family_dirs, onnx_work_dir):
    """Phi-3's longrope picks its frequencies per forward pass from the largest position (short factors up to
    `original_max_position_embeddings`, long ones beyond). The exported graph must keep both and choose as the
    model does: one text scored at the original length and one position longer (whose first positions then rotate
    with the long factors) gives PyTorch's logits both times."""
    m = nndf.load("Phi3", backend="onnxrt", torch_dir=str(family_dirs["Phi3"]), working_dir=str(onnx_work_dir),
                  device="cpu")
    original = m.loaded.config.original_max_position_embeddings
    ids = _ids(original + 1)
    short, long = m.reference_logits(ids[:, :original]), m.reference_logits(ids)
    assert (short - long[:, :original]).abs().max() > 1e-2, "the switch changed nothing: the test lost its point"
    torch.testing.assert_close(m.logits(ids[:, :original]), short, rtol=0, atol=1e-4)
    torch.testing.assert_close(m.logits(ids), long, rtol=0, atol=1e-4)


def test_dynamic_rope_exports_and_matches_generate(family_dirs, onnx_work_dir, tmp_path):
    """'dynamic' (NTK) RoPE recomputes its frequencies in Python once a sequence outgrows the model's positions: the
    export failed on that branch. No sequence of ours outgrows them, so the graph keeps the model's frequencies, and
    tokens and logits are `generate()`'s up to the last position."""
    folder = tmp_path / "llama-dynamic-rope"
    shutil.copytree(family_dirs["Llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    m = nndf.load("Llama", backend="onnxrt", torch_dir=str(folder), working_dir=str(onnx_work_dir), device="cpu")
    ids, mask = _ids(100), torch.ones(2, 100, dtype=torch.long)
    mask[1, :7] = 0
    new = m.max_positions - 100
    assert torch.equal(m.generate(ids, mask, max_new_tokens=new, num_beams=2),
                       m.hf_generate(ids, mask, max_new_tokens=new, num_beams=2))
    torch.testing.assert_close(m.logits(_ids(m.max_positions)), m.reference_logits(_ids(m.max_positions)), rtol=0,
                               atol=1e-4)

def test_phi3_restarts_its_cache_where_generate_does_on_the_trt_runner(fake_gpu, family_dirs, onnx_work_dir):
    """Phi-3's `generate()` drops its cache when the sequence first outgrows `original_max_position_embeddings` and
    recomputes it with the long factors. The engine's context profile must take that step (the whole sequence so
    far, longer than --input-seq-len), and without the restart the tokens would not be `generate()`'s."""
    settings = BuildSettings(batch_size=2, num_beams=2, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=2,
                             input_seq_len=10, output_seq_len=12, use_mask=True)
    model = nndf.load("Phi3", backend="trt", torch_dir=str(family_dirs["Phi3"]), working_dir=str(onnx_work_dir),
                      device="cpu", settings=settings)
    assert model.shapes.prompt.max == model.loaded.config.original_max_position_embeddings + 1
    ids, mask = _ids(10), torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    for num_beams in (1, 2):
        reference = model.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
        assert torch.equal(model.generate(ids, mask, max_new_tokens=12, num_beams=num_beams), reference)
    model.decoder.cache_restart = None
    reference = model.hf_generate(ids, mask, max_new_tokens=12)
    assert not torch.equal(model.generate(ids, mask, max_new_tokens=12), reference)


@pytest.mark.parametrize("family, variant, fp16_bytes", [
    ("Llama", "Llama-3.1-8B", 131072),  # 2 x 32 layers x 8 KV heads x 128: the published 128 KiB per token
    ("Llama", "Llama-2-7b-hf", 524288),  # no grouping: 32 KV heads
    ("Gemma", "gemma-2b", 18432),  # multi-query: 1 KV head of 256
    ("Qwen3", "Qwen3-0.6B", 114688),  # head_dim 128 on a 1024-wide model
])
def test_kv_cache_holds_the_key_value_heads(family, variant, fp16_bytes):
    spec = get_spec(family)
    shapes = ShapeSpec.derive(BuildSettings(), spec, known_config(spec.variant(variant)))
    assert shapes.kv_bytes_per_token(2) == fp16_bytes


def test_info_shows_the_kv_cache_bytes_per_token(capsys, family_dirs):
    code, out, err = run_cli(capsys, "benchmark", "Llama", "frameworks", "--torch-dir", family_dirs["Llama"], "--info",
                             "--input-seq-len", "4", "--output-seq-len", "2", "--iterations", "1", "--warmup", "0")
    assert code == 0, err
    assert ("KV cache: 512 bytes per token and sequence (2 x 2 layers x 2 KV heads x 16 head size x 4 bytes); "
            "3.0 KiB at 1 rows x 6 positions") in out  # not "0.0 MiB"
    assert "past_key_values.{0..1}.key|value  [1, 2, 0..5, 16]" in out


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, family_dirs):
    """A Hugging Face cache (offline) holding the tiny Llama as someorg/tiny-llama-finetune and the tiny Qwen2 as
    someorg/tiny-qwen, laid out as the hub client writes it."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    for repo, family in (("someorg/tiny-llama-finetune", "Llama"), ("someorg/tiny-qwen", "Qwen2")):
        root = cache / f"models--{repo.replace('/', '--')}"
        shutil.copytree(family_dirs[family], root / "snapshots" / commit)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_any_hub_id_of_the_architecture_is_a_variant(hub_cache):
    m = nndf.load("Llama", variant="someorg/tiny-llama-finetune", device="cpu")
    assert (m.variant.hub_id, m.variant.name) == ("someorg/tiny-llama-finetune", "tiny-llama-finetune")
    assert m.loaded.source == "hub someorg/tiny-llama-finetune"
    ids = _ids(6)
    assert torch.equal(m.generate(ids, max_new_tokens=5), m.hf_generate(ids, max_new_tokens=5))


def test_a_hub_id_of_another_architecture_names_its_family(hub_cache):
    with pytest.raises(UsageError, match=r"someorg/tiny-qwen is a model of type qwen2, not one of the Llama family's "
                                         r"\(llama\); run it as Qwen2"):
        nndf.load("Llama", variant="someorg/tiny-qwen", device="cpu")


def test_a_local_folder_of_another_architecture_names_its_family(family_dirs, capsys):
    """A folder ran as the family's default variant under its name (a Qwen3 folder as "Qwen2 Qwen2.5-0.5B")."""
    code, _, err = run_cli(capsys, "benchmark", "Qwen2", "frameworks", "--torch-dir", family_dirs["Qwen3"])
    assert code == 2 and (f"--torch-dir {family_dirs['Qwen3']} is a model of type qwen3, not one of the Qwen2 family's "
                          "(qwen2); run it as Qwen3") in err
    assert "loading" not in err


def test_an_image_and_text_checkpoint_names_what_runs_its_language_model(tmp_path, capsys):
    """Gemma 3 from 4B up (Gemma3ForConditionalGeneration, model type gemma3) is a vision tower around a gemma3_text
    model: the refusal said only that gemma3 is not the family's type, not why no family takes it."""
    from transformers import Gemma3Config

    text = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                intermediate_size=32, vocab_size=300)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    Gemma3Config(text_config=text, vision_config=vision).save_pretrained(tmp_path / "gemma3-4b")
    code, _, err = run_cli(capsys, "run", "Gemma", "frameworks", "--torch-dir", tmp_path / "gemma3-4b")
    assert code == 2 and "is a model of type gemma3, not one of the Gemma family's (gemma, gemma2, gemma3_text); it " \
        "reads images and text (a vision encoder beside a gemma3_text language model), which no family here runs " \
        "(the image-to-text family is BLIP); a text-only gemma3_text checkpoint runs as Gemma" in err


def test_a_checkpoint_quantized_for_another_library_is_one_sentence_before_the_load(family_dirs, tmp_path, capsys):
    """A GPTQ (or AWQ, bitsandbytes) folder failed inside the load with transformers' ImportError traceback."""
    folder = tmp_path / "llama-gptq"
    shutil.copytree(family_dirs["Llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "run", "Llama", "frameworks", "onnxrt", "--torch-dir", folder,
                           "--working-dir", tmp_path / "work")
    assert code == 2 and err.strip() == (
        f"error: --torch-dir {folder} holds weights quantized with gptq (its config's quantization_config), which "
        "this harness cannot load or export; give the full-precision checkpoint (the onnxrt-int8 and onnxrt-int4 "
        "backends quantize it for ONNX Runtime)")
    assert not (tmp_path / "work").exists()

def test_a_config_transformers_cannot_read_is_one_sentence(family_dirs, tmp_path, capsys, monkeypatch):
    """Phi-3's early long-context configs name longrope "su" with `original_max_position_embeddings` outside
    rope_scaling, which transformers 5 cannot read: its KeyError was a traceback, from a folder or the hub."""
    folder = tmp_path / "phi3-su"
    shutil.copytree(family_dirs["Phi3"], folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "run", "Phi3", "frameworks", "--torch-dir", folder)
    assert code == 2 and err.startswith(f"error: --torch-dir {folder}: its config.json cannot be read (Missing")
    assert "original_max_position_embeddings" in err and len(err.strip().splitlines()) == 1
    # the same config as an unlisted hub id's (here its cached copy stands in for the hub): the same sentence
    from transformers import AutoConfig

    read = AutoConfig.from_pretrained.__func__
    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(
        lambda cls, name, *a, **k: read(cls, folder if name == "someorg/phi3-su" else name, *a, **k)))
    code, _, err = run_cli(capsys, "run", "Phi3", "frameworks", "--variant", "someorg/phi3-su")
    assert code == 2 and err.startswith("error: --variant someorg/phi3-su: its config.json cannot be read (Missing")
    assert len(err.strip().splitlines()) == 1


def test_an_encoder_folder_points_to_convert(minilm_dir, capsys):
    code, _, err = run_cli(capsys, "export", "GPT2", "onnxrt", "--torch-dir", minilm_dir)
    assert code == 2 and f"--torch-dir {minilm_dir} is a model of type bert, not one of the GPT2 family's" in err
    assert "; an encoder model converts with: python run.py convert -m FOLDER (as transformer-deploy's)" in err


def test_random_weights_of_an_unlisted_hub_id_is_one_sentence(capsys):
    code, _, err = run_cli(capsys, "benchmark", "Llama", "frameworks", "--variant", "someorg/some-llama-finetune",
                           "--random-weights")
    assert code == 2
    assert err.strip() == ("error: --random-weights builds a listed variant from its known config, and "
                           "someorg/some-llama-finetune has none (`run.py list` shows the listed ones): drop "
                           "--random-weights to load it from the hub or its cache, or give a local copy with --torch-dir")
    code, _, err = run_cli(capsys, "benchmark", "Llama", "frameworks", "--variant", "no-org-here")
    assert code == 2 and "or the hub id (org/name) of any Llama checkpoint" in err


def test_building_a_known_config_leaves_the_registry_data_alone():
    """transformers writes `rope_theta` into the rope_scaling dict it is given: the variant's data (and so the
    weights id that names its exports) must not change when its config is built."""
    variant = get_spec("Llama").variant("Llama-3.1-8B")
    before = repr(sorted(variant.config.items()))
    known_config(variant)
    assert repr(sorted(variant.config.items())) == before


@needs_shared(TOKENIZER_DIR)
def test_a_tokenizer_larger_than_the_vocabulary_is_refused_when_it_loads(family_dirs, capsys):
    """GPT-2's tokenizer (50257 tokens) on a 1000-token Llama: words whose ids run past the vocabulary failed in the
    middle of a chat or an accuracy run, after others had passed."""
    code, _, err = run_cli(capsys, "run", "Llama", "frameworks", "--torch-dir", family_dirs["Llama"],
                           "--tokenizer-dir", TOKENIZER_DIR)
    assert code == 2 and (f"the tokenizer of {TOKENIZER_DIR} has 50257 tokens, more than the 1000 of Llama's "
                          "vocabulary; is it this model's tokenizer (--tokenizer-dir, tokenizer_dir=)?") in err
