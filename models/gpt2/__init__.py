"""GPT-2 (OpenAI): learned absolute positions, so the default hooks fit as they are."""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_BASE = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "bos_token_id": 50256, "eos_token_id": 50256}


def _variant(name: str, params: str, n_layer: int, n_head: int, n_embd: int) -> Variant:
    return Variant(
        name=name,
        hub_id=f"openai-community/{name}",
        config=dict(_BASE, n_layer=n_layer, n_head=n_head, n_embd=n_embd),
        params=params,
    )


SPEC = ModelSpec(
    family="GPT2",
    description="OpenAI GPT-2 decoder-only language models",
    variants=(
        _variant("gpt2", "124M", 12, 12, 768),
        _variant("gpt2-medium", "355M", 24, 16, 1024),
        _variant("gpt2-large", "774M", 36, 20, 1280),
        _variant("gpt2-xl", "1.5B", 48, 25, 1600),
    ),
    backends=("frameworks", "onnxrt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="openai-community/gpt2",
)
