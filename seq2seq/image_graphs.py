"""An image-to-text model (BLIP) as the same three graphs as T5 and BART, with a vision encoder swapped in.

- encoder: `pixel_values -> encoder_hidden_states` (the vision transformer's last hidden state: one row per patch
  plus the class token, a fixed length for the model's fixed image size);
- cross: `encoder_hidden_states -> cross.{i}.key|value` (the text decoder's cross-attention projections, run once
  per image: `CrossCacheWrapper` with the text decoder's own call);
- decoder: `input_ids, attention_mask, position_ids, logits_to_keep, cross..., past... -> logits, present...`: a
  causal text decoder as decoder-only models have it (a prompt, its mask and positions), plus the cross keys and
  values as fixed inputs. Images have no padding, so there is no encoder mask.

All three call the Hugging Face modules the family's hooks name (`encoder_module`, `decoder_module`), never a copy
of their layers. `ImageToTextHooks` holds the defaults for models whose config nests a `vision_config` and a
`text_config`, as BLIP's does.
"""

from __future__ import annotations

import torch

from nndf.export.wrapper import StepWrapper, with_cache
from nndf.kvcache import past_names, present_names
from nndf.seq2seq.wrappers import (CrossCacheWrapper, cross_attention_cache, cross_io, cross_names,
                                   self_attention_part)
from nndf.spec import FamilyHooks

ENCODER_IO = (("pixel_values",), ("encoder_hidden_states",))


class ImageToTextHooks(FamilyHooks):
    """Sizes of a model whose config nests `vision_config` (the encoder) and `text_config` (the decoder)."""

    def num_layers(self, config) -> int:
        return int(config.text_config.num_hidden_layers)

    def kv_heads(self, config) -> int:
        return int(config.text_config.num_attention_heads)

    def head_dim(self, config) -> int:
        return int(config.text_config.hidden_size) // self.kv_heads(config)

    def max_positions(self, config) -> int:
        return int(config.text_config.max_position_embeddings)

    def vocab_size(self, config) -> int:
        return int(config.text_config.vocab_size)

    def image_size(self, config) -> int:
        return int(config.vision_config.image_size)

    def encoder_length(self, config) -> int:
        """Positions of the encoder's output: one per image patch, plus the class token."""
        return (self.image_size(config) // int(config.vision_config.patch_size)) ** 2 + 1

    def encoder_hidden_size(self, config) -> int:
        return int(config.vision_config.hidden_size)

    def encoder_module(self, model):
        return model.vision_model

    def decoder_module(self, model):
        return model.text_decoder

    def decoder_prompt(self, input_ids, attention_mask, batch: int, config):
        """The text decoder's first tokens and mask for `batch` images, from what the user gave (None: none)."""
        raise NotImplementedError(f"{type(self).__name__} must say how its text decoder starts")


def decoder_io(num_layers: int, use_cache: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    inputs = ["input_ids", "attention_mask", "position_ids", "logits_to_keep", *cross_names(num_layers)]
    outputs = ["logits"]
    if use_cache:
        inputs += past_names(num_layers)
        outputs += present_names(num_layers)
    return tuple(inputs), tuple(outputs)


class VisionEncoderWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, hooks: ImageToTextHooks) -> None:
        super().__init__()
        self.encoder = hooks.encoder_module(model)
        self.input_names, self.output_names = ENCODER_IO
        self.eval()

    def forward(self, pixel_values):
        return (self.encoder(pixel_values=pixel_values).last_hidden_state,)


class TextDecoderCrossCache(CrossCacheWrapper):
    """The cross-attention cache generator over a text decoder that takes `encoder_hidden_states` itself."""

    def run_decoder(self, input_ids, encoder_hidden_states, cache):
        return self.model(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, use_cache=True,
                          **with_cache(self.model, cache))


class CaptionDecoderWrapper(StepWrapper):
    """One text decoder step with the image's cross keys and values as inputs (never re-projected)."""

    def __init__(self, decoder: torch.nn.Module, num_layers: int, use_cache: bool, static: bool = False) -> None:
        super().__init__(decoder, num_layers, use_cache, static)
        self.input_names, self.output_names = self.step_io(decoder_io(num_layers, use_cache))
        self.eval()

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep, *rest):
        count = 2 * self.num_layers
        self_attention = self.self_attention_cache(rest[count:], input_ids)
        cache = cross_attention_cache(rest[:count], self_attention, self.num_layers)
        # The cross-attention layers run only when encoder states are given; they read the cache, not this.
        placeholder = rest[0].new_zeros(()).expand(input_ids.shape[0], 1, 1)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         encoder_hidden_states=placeholder, use_cache=True, **with_cache(self.model, cache),
                         **self.keep_kwargs(logits_to_keep))
        return self.step_outputs(out, logits_to_keep, self_attention_part)


class ImageGraphs:
    """The three graphs of an image-to-text model: names, wrappers and tracing examples."""

    kind = "image2text"  # names the export folder
    encoder_role = "vision encoder"

    def io(self, hooks: ImageToTextHooks, config, use_cache: bool) -> dict:
        layers = hooks.num_layers(config)
        return {"encoder": ENCODER_IO, "cross": cross_io(layers), "decoder": decoder_io(layers, use_cache)}

    def wrappers(self, model, hooks: ImageToTextHooks, use_cache: bool, static: bool = False) -> dict:
        layers, decoder = hooks.num_layers(model.config), hooks.decoder_module(model)
        return {"encoder": VisionEncoderWrapper(model, hooks), "cross": TextDecoderCrossCache(decoder, layers),
                "decoder": CaptionDecoderWrapper(decoder, layers, use_cache, static)}

    def examples(self, model, hooks: ImageToTextHooks, use_cache: bool) -> dict[str, tuple[tuple, dict]]:
        """Batch 2 of images, 3 new decoder tokens after 4 past ones; the image size and so the encoder length are
        fixed, the batch and the decoder lengths dynamic (ranges within the decoder's positions)."""
        from torch.export import Dim

        from nndf.export.onnx import dynamic_dims

        config = model.config
        layers, heads, head_dim = hooks.num_layers(config), hooks.kv_heads(config), hooks.head_dim(config)
        dims = dynamic_dims(hooks.max_positions(config), use_cache)
        batch_dim, new_dim = dims["batch"], dims["sequence"]
        batch, new, past = 2, 3, 4 if use_cache else 0
        size, length = hooks.image_size(config), hooks.encoder_length(config)
        pixels = torch.randn(batch, 3, size, size)
        hidden = torch.randn(batch, length, hooks.encoder_hidden_size(config))
        cross = [torch.randn(batch, heads, length, head_dim) for _ in range(2 * layers)]
        pasts = [torch.randn(batch, heads, past, head_dim) for _ in range(2 * layers)] if use_cache else []
        decoder_args = (torch.randint(0, hooks.vocab_size(config), (batch, new)),
                        torch.ones(batch, past + new, dtype=torch.long),
                        torch.arange(past, past + new).expand(batch, new).contiguous(), torch.arange(new),
                        *cross, *pasts)
        rest = tuple([{0: batch_dim}] * len(cross) + [{0: batch_dim, 2: dims["past_sequence"]}] * len(pasts))
        return {
            "encoder": ((pixels,), {"pixel_values": {0: Dim("batch")}}),
            "cross": ((hidden,), {"encoder_hidden_states": {0: batch_dim}}),
            "decoder": (decoder_args, {"input_ids": {0: batch_dim, 1: new_dim},
                                       "attention_mask": {0: batch_dim, 1: dims["total_sequence"]},
                                       "position_ids": {0: batch_dim, 1: new_dim},
                                       "logits_to_keep": {0: dims["kept"]}, "rest": rest}),
        }
