"""GPT-NeoX (EleutherAI): rotary embeddings on part of each head and parallel residual; positions as GPT-2."""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

SPEC = ModelSpec(
    family="GPTNeoX",
    description="EleutherAI GPT-NeoX",
    variants=(
        # Pythia (same architecture and tokenizer, trained on the Pile): the sizes that run on a laptop
        Variant.of("EleutherAI/pythia-70m", "70M", {"model_type": "gpt_neox"}, vocab_size=50304,
                   max_position_embeddings=2048, num_hidden_layers=6, num_attention_heads=8, hidden_size=512,
                   intermediate_size=2048, rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0,
                   eos_token_id=0),
        Variant.of("EleutherAI/pythia-160m", "160M", {"model_type": "gpt_neox"}, vocab_size=50304,
                   max_position_embeddings=2048, num_hidden_layers=12, num_attention_heads=12, hidden_size=768,
                   intermediate_size=3072, rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0,
                   eos_token_id=0),
        Variant.of("EleutherAI/gpt-neox-20b", "20B", {"model_type": "gpt_neox"}, vocab_size=50432,
                   max_position_embeddings=2048, num_hidden_layers=44, num_attention_heads=64, hidden_size=6144,
                   intermediate_size=24576, rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0,
                   eos_token_id=0),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="EleutherAI/gpt-neox-20b",
)
