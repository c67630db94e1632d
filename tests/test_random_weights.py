"""`--random-weights` draws each weight once (nndf.random_weights), with transformers' own distributions.

Checked against `from_config` on the same config: the same parameters, dtypes, buffers and ties; norms, biases,
padding rows and other constants exactly equal; every drawn tensor with the std of transformers' draw (within 10%,
more for tensors too small to tell) and its mean. Reproducible for a seed, other for another seed, and an identity that says so.
"""

from __future__ import annotations

import pytest
import torch

from family_examples import FAMILY_EXAMPLES
from nndf.loading import known_config, load_model
from nndf.random_weights import build_random_model
from nndf.registry import get_spec
from nndf.spec import Variant

# Families whose initialisation differs from GPT-2's in ways these tiny transformers configs show, beyond the
# registered families' examples: Llama's RMSNorm weights are ones and its rotary frequencies a buffer (llama3
# scaling), Gemma's RMSNorm weights zeros (it scales by 1 + w), and its embedding scale a buffer.
EXAMPLES = FAMILY_EXAMPLES  # every family's tiny example (Llama: llama3 rope, Gemma: zero-centred norms)


def _auto(name: str):
    import transformers

    return getattr(transformers, get_spec(name).auto_class)


def _config(example: dict):
    return known_config(Variant("example", "none/example", example))


def _ties(model: torch.nn.Module) -> list[set[str]]:
    """Groups of parameter names that are one tensor."""
    groups: dict[int, set[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), set()).add(name)
    return sorted((g for g in groups.values() if len(g) > 1), key=sorted)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_drawn_as_transformers_draws_them(name):
    auto, config = _auto(name), _config(EXAMPLES[name])
    torch.manual_seed(0)
    expected = auto.from_config(config)
    got = build_random_model(auto, config, dtype=torch.float32, device="cpu", seed=0)
    assert [(k, v.shape, v.dtype) for k, v in got.state_dict().items()] == \
        [(k, v.shape, v.dtype) for k, v in expected.state_dict().items()]
    buffers = dict(got.named_buffers())
    for key, buffer in expected.named_buffers():  # rotary frequencies, causal masks, position ids, scales
        assert torch.equal(buffers[key], buffer), key
    assert _ties(got) == _ties(expected)
    parameters = dict(got.named_parameters(remove_duplicate=False))
    for key, reference in expected.named_parameters(remove_duplicate=False):
        drawn = parameters[key].detach()
        if bool((reference == reference.flatten()[0]).all()):  # norms, biases, scales: exactly transformers' value
            assert torch.equal(drawn, reference), key
            continue
        reference = reference.detach()
        assert int((drawn == 0).sum()) == int((reference == 0).sum()), key  # padding rows zeroed, nothing else
        # two samples of n draws: their stds differ by about std / sqrt(n), their means by std * sqrt(2 / n)
        n, std = reference.numel(), float(reference.std())
        assert float(drawn.std()) == pytest.approx(std, rel=max(0.10, 4 / n ** 0.5)), key
        assert abs(float(drawn.mean()) - float(reference.mean())) < 4 * std * (2 / n) ** 0.5, key


def test_the_distributions_each_family_asks_for():
    """What the comparison above stands on, spelled out: GPT-2 scales its residual projections by 1/sqrt(2 n_layer),
    OPT zeroes its padding row, Llama's norms are ones and Gemma's zeros, tied heads are the embedding."""
    gpt2 = build_random_model(_auto("GPT2"), _config(dict(FAMILY_EXAMPLES["GPT2"], n_embd=64)),
                              dtype=torch.float32, device="cpu", seed=0)
    block = gpt2.transformer.h[0]
    assert float(block.attn.c_attn.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
    assert float(block.mlp.c_proj.weight.detach().std()) == pytest.approx(0.02 / (2 * 2) ** 0.5, rel=0.05)
    assert gpt2.get_output_embeddings().weight is gpt2.get_input_embeddings().weight
    opt = build_random_model(_auto("OPT"), _config(FAMILY_EXAMPLES["OPT"]), dtype=torch.float32, device="cpu", seed=0)
    assert not opt.model.decoder.embed_tokens.weight[1].any() and opt.model.decoder.embed_tokens.weight[0].all()
    llama = build_random_model(_auto("Llama"), _config(FAMILY_EXAMPLES["Llama"]), dtype=torch.float32,
                               device="cpu", seed=0)
    assert torch.equal(llama.model.norm.weight, torch.ones(FAMILY_EXAMPLES["Llama"]["hidden_size"]))
    gemma = build_random_model(_auto("Gemma"), _config(FAMILY_EXAMPLES["Gemma"]), dtype=torch.float32,
                               device="cpu", seed=0)
    assert torch.equal(gemma.model.norm.weight, torch.zeros(FAMILY_EXAMPLES["Gemma"]["hidden_size"]))
    ids = torch.tensor([[1, 5, 9, 300]])
    for model in (gpt2, opt, llama, gemma):
        assert torch.isfinite(model(ids).logits).all()


def test_seeded_reproducible_and_named_by_seed_and_draw():
    """The same seed gives bit-identical weights and the same identity (so a later run reuses its exports);
    another seed other weights and another identity; and the identity is not the one weights drawn by
    `from_config` had before, so an export of those is never taken for an export of these."""
    spec = get_spec("GPT2")
    tiny = Variant.of("test/tiny-gpt2", "0.1M", FAMILY_EXAMPLES["GPT2"])
    first, again, other = (load_model(spec, tiny, random_weights=True, seed=seed) for seed in (3, 3, 4))
    assert first.weights_id == again.weights_id != other.weights_id
    assert first.weights_id != f"random:{tiny.name}:seed=3:{sorted(tiny.config.items())}"
    a, b, c = (loaded.model.state_dict() for loaded in (first, again, other))
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(a["transformer.h.0.attn.c_attn.weight"], c["transformer.h.0.attn.c_attn.weight"])
    half = load_model(spec, tiny, random_weights=True, seed=3, dtype=torch.float16)
    assert half.weights_id == first.weights_id + ":float16"
    assert {p.dtype for p in half.model.parameters()} == {torch.float16}


def test_weights_that_cannot_fit_are_refused_before_any_is_drawn(monkeypatch):
    """gpt-neox-20b's random weights (77 GiB in fp32) on a machine with less memory: one sentence, not the kernel's
    OOM kill; the size is the real model's parameters (tied ones once), counted without allocating them."""
    from transformers import AutoModelForCausalLM as auto

    from nndf import measure
    from nndf.errors import HarnessError
    from nndf.random_weights import weight_bytes

    spec = get_spec("GPT2")
    tiny = Variant.of("test/tiny-gpt2", "0.1M", FAMILY_EXAMPLES["GPT2"])
    model = load_model(spec, tiny, random_weights=True).model
    assert weight_bytes(auto, known_config(tiny), torch.float32) == sum(p.numel() * 4 for p in model.parameters())
    assert weight_bytes(auto, known_config(tiny), torch.float16) == sum(p.numel() * 2 for p in model.parameters())
    monkeypatch.setattr(measure, "available_host_memory", lambda: 2 * 1024**3)
    neox = get_spec("GPTNeoX").variant("gpt-neox-20b")
    with pytest.raises(HarnessError, match=r"the random weights of gpt-neox-20b take 7\d\.\d GiB and 2\.0 GiB is "
                                           r"available on this machine; choose a smaller --variant"):
        load_model(get_spec("GPTNeoX"), neox, random_weights=True).model


@pytest.mark.gpu
def test_gpu_random_weights_are_drawn_on_the_gpu_reproducibly():
    """On CUDA the weights are drawn there (a CUDA generator) in the final dtype, the same for a seed, with the
    buffers and distributions of a CPU from_config build."""
    auto, config = _auto("Llama"), _config(FAMILY_EXAMPLES["Llama"])
    first, again = (build_random_model(auto, config, dtype=torch.float16, device="cuda", seed=5) for _ in range(2))
    assert {p.device.type for p in first.parameters()} == {"cuda"}
    assert all(torch.equal(x, y) for x, y in zip(first.state_dict().values(), again.state_dict().values()))
    torch.manual_seed(0)
    expected = auto.from_config(config)
    buffers = dict(first.named_buffers())
    for key, buffer in expected.named_buffers():
        assert torch.equal(buffers[key].cpu().to(buffer.dtype), buffer), key
    weight = first.model.layers[0].mlp.up_proj.weight.detach().float()
    assert float(weight.std()) == pytest.approx(config.initializer_range, rel=0.05)


def _bench_script():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_random_weights", REPO / "bench" / "random_weights.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_models_are_what_they_claim(capsys):
    """bench/random_weights.py's 1B model is the registry's Llama-3.2-1B (1.24 G parameters, tied), registry names
    resolve to their known configs, and a model that is not one is refused naming the flag (exit 2)."""
    bench = _bench_script()
    auto, config = bench.model_config("Llama:Llama-3.2-1B")
    with torch.device("meta"):
        model = auto.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.236e9, rel=0.01)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    _, gpt2 = bench.model_config("GPT2:gpt2-large")
    assert (gpt2.n_layer, gpt2.n_embd) == (36, 1280)
    assert bench.parse_args([]).models == ["GPT2:gpt2-large", "GPT2:gpt2-xl", "Llama:Llama-3.2-1B"]
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--models", "gpt2-large"])
    assert info.value.code == 2 and "--models gpt2-large: give FAMILY:VARIANT" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--models", "GPT2:gpt2-huge"])
    assert info.value.code == 2 and "unknown --variant 'gpt2-huge' for GPT2" in capsys.readouterr().err
