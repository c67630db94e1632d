"""Gemma (Google): Gemma, Gemma 2 and Gemma 3 text models. Quirks, all config data to transformers' own classes:
embeddings scaled by sqrt(width), RMSNorm with (1 + weight), GeGLU MLPs (`gelu_pytorch_tanh`: the hub's gemma-2b
config says "gelu", which transformers reads as this approximation), a head size of 256 whatever the width, tied
embeddings, multi-query attention on gemma-2b; Gemma 2 adds tanh soft-capping of the attention scores
(`attn_logit_softcapping`) and of the final logits (`final_logit_softcapping`) and alternates local layers (a
sliding window of 4096) with global ones (`layer_types`); Gemma 3 has five local layers (window 512) to one global,
each kind with its own RoPE base, and q/k norms instead of soft-capping.

transformers computes Gemma 2's attention eagerly (its SDPA path cannot soft-cap), which is also what the ONNX
export traces; the local layers need nothing of ours (`nndf.export.wrapper.past_as_cache`). No hooks.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_COMMON = {"vocab_size": 256000, "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True}
_GEMMA = dict(_COMMON, model_type="gemma", hidden_act="gelu_pytorch_tanh")
_GEMMA2 = dict(_COMMON, model_type="gemma2", hidden_activation="gelu_pytorch_tanh", sliding_window=4096,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
_GEMMA3 = dict(_COMMON, model_type="gemma3_text", vocab_size=262144, max_position_embeddings=32768,
               hidden_activation="gelu_pytorch_tanh", sliding_window=512, rope_theta=1000000.0,
               rope_local_base_freq=10000.0, query_pre_attn_scalar=256, final_logit_softcapping=None,
               attn_logit_softcapping=None)


def _shape(layers: int, width: int, heads: int, kv_heads: int, mlp: int, **extra) -> dict:
    return dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=mlp, **extra)


SPEC = ModelSpec(
    family="Gemma",
    description="Google Gemma, Gemma 2 and Gemma 3 (text)",
    variants=(
        Variant.of("google/gemma-2b", "2.5B", _GEMMA, **_shape(18, 2048, 8, 1, 16384)),
        Variant.of("google/gemma-7b", "8.5B", _GEMMA, **_shape(28, 3072, 16, 16, 24576)),
        Variant.of("google/gemma-2-2b", "2.6B", _GEMMA2, **_shape(26, 2304, 8, 4, 9216, query_pre_attn_scalar=256)),
        Variant.of("google/gemma-2-9b", "9.2B", _GEMMA2, **_shape(42, 3584, 16, 8, 14336, query_pre_attn_scalar=256)),
        Variant.of("google/gemma-2-27b", "27B", _GEMMA2, head_dim=128,
                   **_shape(46, 4608, 32, 16, 36864, query_pre_attn_scalar=144)),
        Variant.of("google/gemma-3-1b-pt", "1.0B", _GEMMA3, **_shape(26, 1152, 4, 1, 6912)),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="google/gemma-2b",
)
