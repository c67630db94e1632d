"""GPT-Neo (EleutherAI): alternating global and local (windowed) attention layers.

The local layers need nothing of ours: the model builds their windowed mask itself, and the KV cache keeps every
position (a window-sized cache would be an optimisation, not a difference in results).
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_BASE = {"model_type": "gpt_neo", "vocab_size": 50257, "max_position_embeddings": 2048, "window_size": 256,
         "bos_token_id": 50256, "eos_token_id": 50256}


def _size(name: str, params: str, layers: int, heads: int, width: int) -> Variant:
    return Variant.of(f"EleutherAI/gpt-neo-{name}", params, _BASE, num_layers=layers, num_heads=heads,
                      hidden_size=width, attention_types=[[["global", "local"], layers // 2]])


SPEC = ModelSpec(
    family="GPTNeo",
    description="EleutherAI GPT-Neo",
    variants=(_size("125m", "125M", 12, 12, 768), _size("1.3B", "1.3B", 24, 16, 2048),
              _size("2.7B", "2.7B", 32, 20, 2560)),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="EleutherAI/gpt-neo-125m",
)
