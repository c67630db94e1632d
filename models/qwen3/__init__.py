"""Qwen3 (Alibaba): Qwen2's architecture without the q/k/v biases and with an RMSNorm over each query and key head
before the rotary embedding (q/k norms), and a head size of its own (`head_dim` 128 whatever the width, so the
query projection is wider than the hidden state on the small checkpoints). Config data to transformers'
`Qwen3ForCausalLM`; `FamilyHooks.head_dim` reads `head_dim` for the KV cache. No hooks.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_BASE = {"model_type": "qwen3", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8, "max_position_embeddings": 40960,
         "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False, "use_sliding_window": False}


def _size(name: str, params: str, layers: int, width: int, heads: int, mlp: int, tied: bool) -> Variant:
    return Variant.of(f"Qwen/Qwen3-{name}", params, _BASE, num_hidden_layers=layers, hidden_size=width,
                      num_attention_heads=heads, intermediate_size=mlp, tie_word_embeddings=tied,
                      max_window_layers=layers)


SPEC = ModelSpec(
    family="Qwen3",
    description="Alibaba Qwen3 (dense)",
    variants=(
        _size("0.6B", "596M", 28, 1024, 16, 3072, True),
        _size("1.7B", "1.7B", 28, 2048, 16, 6144, True),
        _size("4B", "4.0B", 36, 2560, 32, 9728, True),
        _size("8B", "8.2B", 36, 4096, 32, 12288, False),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="Qwen/Qwen3-0.6B",
)
