"""Llama (Meta) and the checkpoints built on its architecture: Llama 2, Llama 3 / 3.1 / 3.2, CodeLlama, TinyLlama,
SmolLM and SmolLM2 (Hugging Face). Rotary positions, RMSNorm, a gated SiLU MLP and grouped-query attention are all
config data to transformers' `LlamaForCausalLM`: `num_key_value_heads` sizes the KV cache, `rope_scaling` (Llama 3.1
and 3.2: `llama3`) and `rope_theta` are read by the model's own rotary module, which the export traces. No hooks.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False,
          "mlp_bias": False}
_LLAMA2 = dict(_LLAMA, vocab_size=32000, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
               tie_word_embeddings=False)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, bos_token_id=128000, eos_token_id=128001, rope_theta=500000.0)
_SMOL = dict(_LLAMA, vocab_size=49152, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)


def _llama3_scaling(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _shape(layers: int, width: int, heads: int, kv_heads: int, mlp: int, positions: int) -> dict:
    return {"num_hidden_layers": layers, "hidden_size": width, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": mlp, "max_position_embeddings": positions}


SPEC = ModelSpec(
    family="Llama",
    description="Meta Llama 2 / 3.x and Llama-architecture models (CodeLlama, TinyLlama, SmolLM)",
    variants=(
        Variant.of("HuggingFaceTB/SmolLM2-135M", "135M", _SMOL, rope_theta=100000.0,
                   initializer_range=0.041666666666666664, **_shape(30, 576, 9, 3, 1536, 8192)),
        Variant.of("HuggingFaceTB/SmolLM2-360M", "362M", _SMOL, rope_theta=100000.0,
                   **_shape(32, 960, 15, 5, 2560, 8192)),
        Variant.of("HuggingFaceTB/SmolLM2-1.7B", "1.7B", _SMOL, rope_theta=130000.0,
                   **_shape(24, 2048, 32, 32, 8192, 8192)),
        Variant.of("HuggingFaceTB/SmolLM-135M", "135M", _SMOL, rope_theta=10000.0,
                   initializer_range=0.041666666666666664, **_shape(30, 576, 9, 3, 1536, 2048)),
        Variant.of("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "1.1B", _LLAMA2, **_shape(22, 2048, 32, 4, 5632, 2048)),
        Variant.of("meta-llama/Llama-3.2-1B", "1.2B", _LLAMA3, head_dim=64, tie_word_embeddings=True,
                   rope_scaling=_llama3_scaling(32.0), **_shape(16, 2048, 32, 8, 8192, 131072)),
        Variant.of("meta-llama/Llama-3.2-3B", "3.2B", _LLAMA3, head_dim=128, tie_word_embeddings=True,
                   rope_scaling=_llama3_scaling(32.0), **_shape(28, 3072, 24, 8, 8192, 131072)),
        Variant.of("meta-llama/Llama-3.1-8B", "8.0B", _LLAMA3, tie_word_embeddings=False,
                   rope_scaling=_llama3_scaling(8.0), **_shape(32, 4096, 32, 8, 14336, 131072)),
        Variant.of("meta-llama/Meta-Llama-3-8B", "8.0B", _LLAMA3, tie_word_embeddings=False,
                   **_shape(32, 4096, 32, 8, 14336, 8192)),
        Variant.of("meta-llama/Llama-2-7b-hf", "6.7B", _LLAMA2, **_shape(32, 4096, 32, 32, 11008, 4096)),
        Variant.of("codellama/CodeLlama-7b-hf", "6.7B", _LLAMA2, vocab_size=32016, rope_theta=1000000.0,
                   **_shape(32, 4096, 32, 32, 11008, 16384)),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="HuggingFaceTB/SmolLM2-135M",
)
