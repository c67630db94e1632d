"""T5 and Flan-T5 (Google): encoder-decoder with relative attention buckets and no position table.

Data only, plus the hooks for what the config names differently: the decoder's own layer count, `d_kv` as the
head size (t5-3b and t5-11b have d_kv x heads != d_model), the nominal 512 positions (relative attention has no
hard limit; 512 is what the checkpoints were trained on), and the feed-forward output projection kept in fp32 in
fp16 builds (its activations overflow fp16: transformers keeps the same module in fp32, `_keep_in_fp32_modules`).
Flan-T5 is T5 v1.1: gated-GELU feed-forward and an untied LM head, both plain config fields.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import FamilyHooks, ModelSpec, Variant

_COMMON = {"model_type": "t5", "vocab_size": 32128, "n_positions": 512, "relative_attention_num_buckets": 32,
           "layer_norm_epsilon": 1e-6, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
_T5 = dict(_COMMON, feed_forward_proj="relu", tie_word_embeddings=True, relative_attention_max_distance=128)
_FLAN = dict(_COMMON, feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_max_distance=128)


class T5Hooks(FamilyHooks):
    def num_layers(self, config) -> int:
        return int(config.num_decoder_layers)

    def kv_heads(self, config) -> int:
        return int(config.num_heads)

    def head_dim(self, config) -> int:
        return int(config.d_kv)

    def max_positions(self, config) -> int:
        return int(getattr(config, "n_positions", None) or 512)

    def fp32_modules(self) -> tuple[str, ...]:
        return ("DenseReluDense.wo",)


def _size(hub_id: str, params: str, base: dict, d_model: int, d_ff: int, d_kv: int, heads: int, layers: int) -> Variant:
    return Variant.of(hub_id, params, base, d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_heads=heads,
                      num_layers=layers, num_decoder_layers=layers)


SPEC = ModelSpec(
    family="T5",
    description="Google T5 and Flan-T5 encoder-decoder models",
    variants=(
        _size("google-t5/t5-small", "60M", _T5, 512, 2048, 64, 8, 6),
        _size("google-t5/t5-base", "223M", _T5, 768, 3072, 64, 12, 12),
        _size("google-t5/t5-large", "738M", _T5, 1024, 4096, 64, 16, 24),
        _size("google-t5/t5-3b", "2.9B", _T5, 1024, 16384, 128, 32, 24),
        _size("google-t5/t5-11b", "11B", _T5, 1024, 65536, 128, 128, 24),
        _size("google/flan-t5-small", "77M", _FLAN, 512, 1024, 64, 6, 8),
        _size("google/flan-t5-base", "248M", _FLAN, 768, 2048, 64, 12, 12),
        _size("google/flan-t5-large", "783M", _FLAN, 1024, 2816, 64, 16, 24),
        _size("google/flan-t5-xl", "2.8B", _FLAN, 2048, 5120, 64, 32, 24),
        _size("google/flan-t5-xxl", "11B", _FLAN, 4096, 10240, 64, 64, 24),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    auto_class="AutoModelForSeq2SeqLM",
    architecture="encoder-decoder",
    hooks=T5Hooks(),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="google-t5/t5-small",
)
