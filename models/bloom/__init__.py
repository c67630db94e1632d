"""BLOOM (BigScience): ALiBi attention biases instead of position embeddings.

ALiBi takes no position ids (the decoder graph simply has no such input: `DecoderWrapper` asks the model class)
and sets no maximum length in the config, so the one hook here gives the length BLOOM was trained on.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import FamilyHooks, ModelSpec, Variant

TRAINED_LENGTH = 2048

_BASE = {"model_type": "bloom", "vocab_size": 250880, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


class BloomHooks(FamilyHooks):
    def max_positions(self, config) -> int:
        """ALiBi has no position table, so the config has no maximum: use the trained sequence length."""
        return int(getattr(config, "seq_length", None) or TRAINED_LENGTH)


def _sizes(prefix: str) -> tuple[Variant, ...]:
    sizes = (("560m", "560M", 24, 16, 1024), ("1b1", "1.1B", 24, 16, 1536), ("1b7", "1.7B", 24, 16, 2048),
             ("3b", "3B", 30, 32, 2560), ("7b1", "7.1B", 30, 32, 4096))
    return tuple(Variant.of(f"bigscience/{prefix}-{name}", params, _BASE, n_layer=layers, n_head=heads,
                            hidden_size=width) for name, params, layers, heads, width in sizes)


SPEC = ModelSpec(
    family="BLOOM",
    description="BigScience BLOOM and BLOOMZ",
    variants=_sizes("bloom") + _sizes("bloomz"),
    backends=("frameworks", "onnxrt", "trt"),
    hooks=BloomHooks(),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="bigscience/bloom-560m",
)
