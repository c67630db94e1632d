"""OPT (Meta): learned positions with an offset of 2, which the model applies itself to the position ids it is
given; opt-350m projects embeddings from 512 to 1024 dimensions and normalises after attention. Both are config
data here, not code, but for the one hook that says what its layers hand their attention."""

from __future__ import annotations

from pathlib import Path

from nndf.spec import FamilyHooks, ModelSpec, Variant


class OPTHooks(FamilyHooks):
    def pre_attention(self, layer):
        """`self_attn_layer_norm` comes before the attention where `do_layer_norm_before`, else after it (opt-350m):
        the attention then gets the layer's input itself."""
        return layer.self_attn_layer_norm if layer.do_layer_norm_before else (lambda hidden: hidden)


_BASE = {"model_type": "opt", "vocab_size": 50272, "max_position_embeddings": 2048, "bos_token_id": 2,
         "eos_token_id": 2, "pad_token_id": 1}


def _size(name: str, layers: int, heads: int, width: int, **extra) -> Variant:
    return Variant.of(f"facebook/opt-{name}", name.upper(), _BASE, num_hidden_layers=layers,
                      num_attention_heads=heads, hidden_size=width, ffn_dim=4 * width,
                      word_embed_proj_dim=extra.pop("word_embed_proj_dim", width), **extra)


SPEC = ModelSpec(
    family="OPT",
    description="Meta OPT",
    variants=(
        _size("125m", 12, 12, 768),
        _size("350m", 24, 16, 1024, word_embed_proj_dim=512, do_layer_norm_before=False),
        _size("1.3b", 24, 32, 2048),
        _size("2.7b", 32, 32, 2560),
        _size("6.7b", 32, 32, 4096),
        _size("13b", 40, 40, 5120),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="facebook/opt-125m",
    hooks=OPTHooks(),
)
