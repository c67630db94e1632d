"""Cerebras-GPT: the GPT-2 architecture (model_type gpt2) at other sizes, 2048 positions, trained Chinchilla-style."""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_BASE = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 2048, "bos_token_id": 50256,
         "eos_token_id": 50256}


def _size(name: str, params: str, layers: int, heads: int, width: int) -> Variant:
    return Variant.of(f"cerebras/Cerebras-GPT-{name}", params, _BASE, n_layer=layers, n_head=heads, n_embd=width,
                      n_inner=4 * width)


SPEC = ModelSpec(
    family="CerebrasGPT",
    description="Cerebras-GPT (GPT-2 architecture)",
    variants=(
        _size("111M", "111M", 10, 12, 768),
        _size("256M", "256M", 14, 17, 1088),
        _size("590M", "590M", 18, 12, 1536),
        _size("1.3B", "1.3B", 24, 16, 2048),
        _size("2.7B", "2.7B", 32, 32, 2560),
        _size("6.7B", "6.7B", 32, 32, 4096),
        _size("13B", "13B", 40, 40, 5120),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="cerebras/Cerebras-GPT-111M",
)
