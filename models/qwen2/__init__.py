"""Qwen2 and Qwen2.5 (Alibaba): the Llama architecture with biases on the query, key and value projections, a
large vocabulary whose embedding the small checkpoints tie to the LM head, and a RoPE base of 10^6. All of it is
config data to transformers' `Qwen2ForCausalLM`; the checkpoints ship `use_sliding_window: false`, so every layer
attends over the whole sequence. No hooks.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_BASE = {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643, "use_sliding_window": False}


def _size(hub_id: str, params: str, layers: int, width: int, heads: int, kv_heads: int, mlp: int,
          positions: int, tied: bool, **extra) -> Variant:
    return Variant.of(hub_id, params, _BASE, num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=mlp, max_position_embeddings=positions,
                      sliding_window=positions, max_window_layers=layers, tie_word_embeddings=tied, **extra)


SPEC = ModelSpec(
    family="Qwen2",
    description="Alibaba Qwen2 and Qwen2.5",
    variants=(
        _size("Qwen/Qwen2.5-0.5B", "494M", 24, 896, 14, 2, 4864, 32768, True),
        _size("Qwen/Qwen2.5-1.5B", "1.5B", 28, 1536, 12, 2, 8960, 131072, True),
        _size("Qwen/Qwen2.5-7B", "7.6B", 28, 3584, 28, 4, 18944, 131072, False, vocab_size=152064),
        _size("Qwen/Qwen2.5-0.5B-Instruct", "494M", 24, 896, 14, 2, 4864, 32768, True, eos_token_id=151645),
        _size("Qwen/Qwen2-0.5B", "494M", 24, 896, 14, 2, 4864, 131072, True),
        _size("Qwen/Qwen2-1.5B", "1.5B", 28, 1536, 12, 2, 8960, 131072, True),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="Qwen/Qwen2.5-0.5B",
)
