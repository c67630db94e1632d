"""Mistral (Mistral AI): the Llama architecture with grouped-query attention and, in 7B v0.1, a sliding window of
4096 positions over every layer (v0.3 drops the window and grows the vocabulary to 32768).

The window is config data: the model masks keys older than `sliding_window` itself. Our caches keep every
position (`nndf.export.wrapper.past_as_cache` gives the model full-length layers, so a step's presents are its
pasts plus its new positions on every backend), and the model's own sliding-window mask hides what its windowed
cache would have dropped: the same attention, hence the same tokens as `generate()` past the window.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import ModelSpec, Variant

_BASE = {"model_type": "mistral", "hidden_act": "silu", "rms_norm_eps": 1e-5, "num_hidden_layers": 32,
         "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
         "max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}

SPEC = ModelSpec(
    family="Mistral",
    description="Mistral AI Mistral 7B (v0.1 with its 4096-position sliding window, v0.3)",
    variants=(
        Variant.of("mistralai/Mistral-7B-v0.1", "7.2B", _BASE, vocab_size=32000, rope_theta=10000.0,
                   sliding_window=4096),
        Variant.of("mistralai/Mistral-7B-v0.3", "7.2B", _BASE, vocab_size=32768, rope_theta=1000000.0,
                   sliding_window=None),
        Variant.of("mistralai/Mistral-7B-Instruct-v0.3", "7.2B", _BASE, vocab_size=32768, rope_theta=1000000.0,
                   sliding_window=None),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="mistralai/Mistral-7B-v0.3",
)
