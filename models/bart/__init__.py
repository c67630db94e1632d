"""BART and mBART-50 (Meta): encoder-decoder with learned positions (BART's offset of 2 is the model's own code).

Data only, plus hooks for the decoder's own layer and head counts, for mBART-50's target language (generation
starts from `</s>` and the language code is forced as the first generated token (`forced_bos_token_id`), which
`--tgt-lang` sets) and for mBART's own way of building teacher-forced decoder inputs from labels. mBART's pre-norm
layers, final layer norms and scaled embeddings are config fields.
bart-large-cnn carries its hub generation config (4 beams, no repeated 3-grams, 56 to 142 tokens, length penalty
2, early stopping, forced BOS/EOS) so random weights generate under the same rules as the real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from nndf.errors import UsageError
from nndf.spec import FamilyHooks, ModelSpec, Variant

_BART = {"model_type": "bart", "vocab_size": 50265, "max_position_embeddings": 1024, "activation_function": "gelu",
         "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
         "forced_eos_token_id": 2}
_MBART = dict(_BART, model_type="mbart", vocab_size=250054, normalize_before=True, add_final_layer_norm=True,
              scale_embedding=True)
_CNN_GENERATION = {"num_beams": 4, "no_repeat_ngram_size": 3, "min_length": 56, "max_length": 142,
                   "length_penalty": 2.0, "early_stopping": True, "bos_token_id": 0, "pad_token_id": 1,
                   "eos_token_id": 2, "decoder_start_token_id": 2, "forced_bos_token_id": 0, "forced_eos_token_id": 2}

# mBART-50's language codes follow its 250,000 SentencePiece pieces (+1 fairseq offset), in this order
# (transformers' tokenization_mbart50.FAIRSEQ_LANGUAGE_CODES): ar_AR is 250001, en_XX 250004.
MBART50_FIRST_LANGUAGE_ID = 250001


class BartHooks(FamilyHooks):
    def num_layers(self, config) -> int:
        return int(config.decoder_layers)

    def kv_heads(self, config) -> int:
        return int(config.decoder_attention_heads)

    def head_dim(self, config) -> int:
        return int(config.d_model) // int(config.decoder_attention_heads)

    def language_token_id(self, code: str, tokenizer=None, config=None) -> int:
        """The token that starts an mBART-50 output in language `code` (e.g. de_DE): the tokenizer's, else the
        position in mBART-50's fixed list of languages."""
        from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES

        if config is not None and config.model_type != "mbart":
            raise UsageError(f"--tgt-lang {code} applies to mBART-50 translation models (mbart-large-50...); this "
                             f"{config.model_type} model has no target languages")
        if code not in FAIRSEQ_LANGUAGE_CODES:
            raise UsageError(f"--tgt-lang {code} is not an mBART-50 language; allowed: "
                             f"{', '.join(FAIRSEQ_LANGUAGE_CODES)}")
        if tokenizer is not None:
            token = tokenizer.convert_tokens_to_ids(code)
            if token is not None and token != tokenizer.unk_token_id:
                return int(token)
        token = MBART50_FIRST_LANGUAGE_ID + FAIRSEQ_LANGUAGE_CODES.index(code)
        if config is not None and token >= int(config.vocab_size):
            raise UsageError(f"--tgt-lang {code} needs the mBART-50 vocabulary, and this model has "
                             f"{config.vocab_size} tokens; give its tokenizer with --tokenizer-dir")
        return token


    def decoder_input_ids(self, labels: list[int], start_token_id: int, config) -> list[int]:
        """mBART's forward builds its decoder inputs from labels with its own `shift_tokens_right`, which puts the
        last label first (mBART's training targets end with the language code); BART's shifts behind its start
        token. transformers' own function, so that teacher-forced scores equal lm-eval's `hf` model's."""
        if config.model_type != "mbart":
            return super().decoder_input_ids(labels, start_token_id, config)
        import torch
        from transformers.models.mbart.modeling_mbart import shift_tokens_right

        return shift_tokens_right(torch.tensor([labels]), config.pad_token_id)[0].tolist()


def _size(hub_id: str, params: str, base: dict, d_model: int, layers: int, heads: int, **extra) -> Variant:
    return Variant.of(hub_id, params, base, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                      encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=4 * d_model,
                      decoder_ffn_dim=4 * d_model, **extra)


SPEC = ModelSpec(
    family="BART",
    description="Meta BART and mBART-50 encoder-decoder models",
    variants=(
        _size("facebook/bart-base", "139M", _BART, 768, 6, 12),
        _size("facebook/bart-large", "406M", _BART, 1024, 12, 16),
        _size("facebook/bart-large-cnn", "406M", _BART, 1024, 12, 16, vocab_size=50264,
              generation=_CNN_GENERATION),
        _size("facebook/mbart-large-50", "611M", _MBART, 1024, 12, 16),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    auto_class="AutoModelForSeq2SeqLM",
    architecture="encoder-decoder",
    hooks=BartHooks(),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="facebook/bart-base",
)
