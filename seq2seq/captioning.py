"""The image-to-text strategy of `nndf.architectures` (BLIP): a vision encoder swapped into the encoder-decoder
pieces, and a text decoder that starts from a prompt as a decoder-only model does.

Hugging Face's BLIP `generate(pixel_values, input_ids=None, attention_mask=None)` runs the vision model once, then
the text decoder's `generate()` from a prompt (the family's `decoder_prompt` hook says which) with the image
embeddings as cross-attention input, and returns prompt + caption tokens. Here the vision encoder and the
cross-attention cache generator run once per batch of images (`CaptionDecoder.start`), their keys and values are
repeated for the beams and ride along every step as fixed inputs, and the one loop generates from the prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nndf.decoder import TokenState
from nndf.errors import UsageError
from nndf.reference import seeded_prompts
from nndf.seq2seq.architecture import EncoderDecoder
from nndf.seq2seq.decoder import Seq2SeqDecoder
from nndf.seq2seq.image_graphs import ImageGraphs
from nndf.seq2seq.shapes import profile_ranges
from nndf.spec import Dim, ShapeSpec


@dataclass(frozen=True)
class CaptionShapeSpec(ShapeSpec):
    """The text decoder's shapes as a decoder-only model has them (`prompt` is the text prompt), plus the image:
    `batch` images of `image_size` squared pixels, encoded to `encoder_length` positions of `encoder_hidden` each."""

    batch: Dim = Dim(1, 1, 1)
    image_size: int = 0
    encoder_length: int = 0
    encoder_hidden: int = 0

    @classmethod
    def derive(cls, settings, spec, config) -> "CaptionShapeSpec":
        hooks = spec.hooks
        shapes = super().derive(settings, spec, config)
        lo, hi = settings.batch_range
        return dataclasses.replace(
            shapes,
            rows=Dim(lo, shapes.rows.opt, shapes.rows.max),  # scoring (the fp16 check) runs one row per image
            batch=Dim(lo, settings.batch_size, hi),
            image_size=hooks.image_size(config),
            encoder_length=hooks.encoder_length(config),
            encoder_hidden=hooks.encoder_hidden_size(config),
        )

    def graph_profiles(self, graph: str, input_names: tuple[str, ...]) -> list[dict]:
        """TensorRT profiles: the image size fixed, the batch dynamic; the decoder's as a decoder-only model's
        (a prompt profile and a one-token profile), with the cross keys and values of every image row."""
        b, size = self.batch, self.image_size
        if graph == "encoder":
            return [{name: profile_ranges(b, 3, size, size) for name in input_names}]
        if graph == "cross":
            return [{name: profile_ranges(b, self.encoder_length, self.encoder_hidden) for name in input_names}]
        cross = [name for name in input_names if name.startswith("cross.")]
        text = tuple(name for name in input_names if name not in cross)
        cross_range = profile_ranges(self.rows, self.kv_heads, self.encoder_length, self.head_dim)
        return [{**profile, **{name: cross_range for name in cross}} for profile in self.profiles(text)]

    def describe(self) -> list[tuple[str, str]]:
        span = (lambda d: str(d.max) if d.min == d.max else f"{d.min}..{d.max}")
        b, r, last = span(self.batch), span(self.rows), self.num_layers - 1
        return [
            ("encoder: pixel_values", f"[{b}, 3, {self.image_size}, {self.image_size}] float"),
            ("encoder: encoder_hidden_states", f"[{b}, {self.encoder_length}, {self.encoder_hidden}] float"),
            (f"decoder: cross.{{0..{last}}}.key|value",
             f"[{r}, {self.kv_heads}, {self.encoder_length}, {self.head_dim}] float"),
            *[(f"decoder: {name}", shape) for name, shape in super().describe()],
        ]


class CaptionDecoder(Seq2SeqDecoder):
    """Vision encoder and cross-attention cache generator once per batch of images; the text decoder from the
    prompt, step by step."""

    def encode(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.cross_feeds({"pixel_values": pixel_values.to(self.encoder.device)})

    def start(self, input_ids: torch.Tensor, mask: torch.Tensor, beams: int,
              pixel_values: torch.Tensor | None = None) -> TokenState:
        fixed = self._fixed_feeds(self.encode(pixel_values), beams)
        return TokenState(input_ids.repeat_interleave(beams, dim=0), mask.repeat_interleave(beams, dim=0), fixed)

    def logits(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Float logits of every position of the text `input_ids` (unpadded, teacher-forced) given the images."""
        with torch.inference_mode(), self.host_threads():
            return self.teacher_forced(self.encode(pixel_values), input_ids.to(self.device))


class ImageToText(EncoderDecoder):
    name = "image-to-text"
    graphs = ImageGraphs()
    takes_images = True
    pad_side = "right"  # BLIP's BERT tokenizer pads on the right

    def derive_shapes(self, settings, spec, config) -> CaptionShapeSpec:
        return CaptionShapeSpec.derive(settings, spec, config)

    def decoder_over(self, sessions: dict, shapes, loaded) -> CaptionDecoder:
        return CaptionDecoder(sessions["encoder"], sessions["cross"], sessions["decoder"], shapes, loaded.spec.hooks)

    def prompt(self, loaded, input_ids, attention_mask, pixel_values):
        """The text decoder's prompt from the caller's ids (the processor's, with its [CLS] ... [SEP]; None:
        unconditional captioning), as the family's `generate()` makes it; the images go to the vision encoder."""
        if pixel_values is None:
            raise UsageError(f"{loaded.spec.family} captions images: give pixel_values (the processor's output; "
                             "--image PATH on the command line)")
        hooks, config = loaded.spec.hooks, loaded.config
        size = hooks.image_size(config)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, size, size):
            raise UsageError(f"pixel_values of shape {tuple(pixel_values.shape)} do not fit {loaded.name}, "
                             f"which reads (batch, 3, {size}, {size}) images: use its processor")
        batch = pixel_values.shape[0]
        if input_ids is not None and input_ids.shape[0] != batch:
            raise UsageError(f"{input_ids.shape[0]} text prompts for {batch} images; give one prompt per image")
        ids, mask = hooks.decoder_prompt(input_ids, attention_mask, batch, config)
        return ids, mask, {"pixel_values": pixel_values}

    def hf_inputs(self, input_ids, attention_mask, encoder_inputs: dict, pad_token_id) -> dict:
        """BLIP's `generate()` takes the images and the caller's ids (it rewrites them in place: a copy goes)."""
        ids = None if input_ids is None else input_ids.clone()
        return {"pixel_values": encoder_inputs["pixel_values"], "input_ids": ids, "attention_mask": attention_mask}

    def prompt_length(self, input_ids, loaded) -> int:
        ids, _ = loaded.spec.hooks.decoder_prompt(input_ids, None, 1 if input_ids is None else input_ids.shape[0],
                                                  loaded.config)
        return ids.shape[1]

    def check_length(self, prompt_len: int, max_new_tokens: int, shapes) -> None:
        total = prompt_len + max_new_tokens
        if total > shapes.max_positions:
            raise UsageError(f"a text prompt of {prompt_len} token{'s' if prompt_len != 1 else ''} plus "
                             f"{max_new_tokens} new tokens is {total}, "
                             f"more than the {shapes.max_positions} positions of this model's text decoder")

    def label_ids(self, tokenizer, prompt_ids, label: str) -> list[int]:
        """A label is the caption after the prompt; its tokens as the text decoder generates them."""
        return list(tokenizer(label, add_special_tokens=False)["input_ids"])

    def check_batches(self, shapes, loaded) -> list[tuple[torch.Tensor, ...]]:
        """Seeded images and text for the fp16 check, scored teacher-forced through all three graphs."""
        generator = torch.Generator().manual_seed(1)
        batches = []
        for ids in seeded_prompts(shapes.batch.min, shapes.prompt.max, shapes.vocab_size):
            pixels = torch.randn(ids.shape[0], 3, shapes.image_size, shapes.image_size, generator=generator)
            batches.append((pixels, ids))
        return batches

    @staticmethod
    def reference_logits(model, pixel_values, input_ids) -> torch.Tensor:
        device = next(model.parameters()).device
        with torch.inference_mode():
            return model(pixel_values=pixel_values.to(device), input_ids=input_ids.to(device)).logits.float().cpu()

    def benchmark_inputs(self, length: int) -> str:
        return "images + " + (f"{length}-token text prefix" if length else "no text prefix")

    lm_eval_backend = None  # lm-eval's text tasks do not apply to an image captioner

    def check_lambada(self, spec) -> None:
        raise UsageError(f"LAMBADA is a text benchmark and {spec.family} captions images, so accuracy does not apply "
                         "to it; use run or compare, which caption the family's checkpoint photos")

    def lambada(self, texts, model, tokens_to_generate: int, top_n: int):
        self.check_lambada(model.spec)

    def fidelities(self, texts, models, batch_size: int = 1):
        self.check_lambada(models[0].spec)
