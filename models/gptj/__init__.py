"""GPT-J (EleutherAI): rotary embeddings on the first `rotary_dim` dimensions of each head; an untied LM head."""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

SPEC = ModelSpec(
    family="GPTJ",
    description="EleutherAI GPT-J",
    variants=(
        Variant.of("EleutherAI/gpt-j-6B", "6B", {"model_type": "gptj"}, vocab_size=50400, n_positions=2048,
                   n_layer=28, n_head=16, n_embd=4096, rotary_dim=64, tie_word_embeddings=False,
                   bos_token_id=50256, eos_token_id=50256),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="EleutherAI/gpt-j-6B",
)
