"""GPT-2 (OpenAI): learned absolute positions, so the default hooks fit as they are."""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_BASE = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "bos_token_id": 50256, "eos_token_id": 50256}

SPEC = ModelSpec(
    family="GPT2",
    description="OpenAI GPT-2 decoder-only language models",
    variants=(
        Variant.of("openai-community/gpt2", "124M", _BASE, n_layer=12, n_head=12, n_embd=768),
        Variant.of("openai-community/gpt2-medium", "355M", _BASE, n_layer=24, n_head=16, n_embd=1024),
        Variant.of("openai-community/gpt2-large", "774M", _BASE, n_layer=36, n_head=20, n_embd=1280),
        Variant.of("openai-community/gpt2-xl", "1.5B", _BASE, n_layer=48, n_head=25, n_embd=1600),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="openai-community/gpt2",
)
