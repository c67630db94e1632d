"""How a kind of model is driven: one small strategy object per `ModelSpec.architecture`, never a family's name.

A decoder-only model keeps its prompt in the KV cache and returns prompt + new tokens; an encoder-decoder model
runs its encoder and cross-attention cache generator once, starts the decoder from its start token and returns the
decoder's tokens; an image-to-text model (BLIP) does the same with a vision encoder, and its text decoder starts
from a text prompt, as a decoder-only model does. Everything else (the generation loop, the KV caches, the measurement, the actions) is shared.
The strategy answers the few questions where the two differ:

- `derive_shapes`: the build's tensor shapes (and so the validation of the length flags);
- `open_decoder`: the backend's sessions wrapped in the object the generation loop drives;
- `prompt` / `hf_inputs`: what the loop and Hugging Face `generate()` take from a caller's input ids, mask and
  images (an image-to-text model's vision encoder reads the images, its text decoder starts from a prompt);
- `new_tokens` / `label_ids`: which tokens of an output are generated, and a label's tokens in the same terms;
- `lambada` / `fidelities` / `lambada_note`: how LAMBADA is scored (and said to be scored) for this kind of model
  (`fidelities`: every judged backend against one PyTorch pass);
- `lm_eval_backend` / `loglikelihoods`: how lm-evaluation-harness encodes and scores its requests for it (None:
  lm-eval's text tasks do not apply);
- `pad_side`: where a batch of prompts is padded (decoder-only: left, so every row ends at the same position).
"""

from __future__ import annotations

import importlib

import torch

from nndf.errors import UsageError
from nndf.reference import pytorch_logits, seeded_prompts
from nndf.spec import BuildSettings, ModelSpec, ShapeSpec

# ModelSpec.architecture -> "module:class" of its strategy (imported on first use).
ARCHITECTURES: dict[str, str] = {
    "decoder-only": "nndf.architectures:DecoderOnly",
    "encoder-decoder": "nndf.seq2seq.architecture:EncoderDecoder",
    "image-to-text": "nndf.seq2seq.captioning:ImageToText",
}


class TextInputs:
    """What models with text in share: `generate()` takes token ids and a mask, and no images."""

    takes_images = False
    has_encoder = False  # a module of its own that reads the input first (timed apart in benchmarks)
    reply_continues_prompt = True  # generated text continues the prompt's (a chat's turn is prompt + reply)
    # LAMBADA's NVIDIA-demo metrics score the passage's last --tokens-to-generate tokens (else the target word's)
    lambada_tokens_to_generate = True

    def prompt(self, loaded, input_ids, attention_mask, pixel_values):
        """The loop's `(input_ids, attention_mask, encoder inputs)` from what a caller of `generate()` gave."""
        if pixel_values is not None:
            raise UsageError(f"{loaded.spec.family} reads text, not images: pixel_values (--image) apply to "
                             "image-to-text families such as BLIP")
        if input_ids is None:
            raise UsageError(f"{loaded.spec.family} generates from text: give input_ids")
        return input_ids, attention_mask, {}

    def hf_inputs(self, input_ids, attention_mask, encoder_inputs: dict, pad_token_id) -> dict:
        """What Hugging Face `generate()` takes for the same inputs."""
        return {"inputs": input_ids, "attention_mask": attention_mask, "pad_token_id": pad_token_id}

    def new_tokens(self, output: torch.Tensor, input_ids: torch.Tensor | None, loaded) -> torch.Tensor:
        """The generated part of a `generate()` output for these inputs: what follows the loop's prompt."""
        return output[:, self.prompt_length(input_ids, loaded):]

    def check_lambada(self, spec) -> None:
        """LAMBADA scores text; every text model can be scored."""

    def fidelity(self, texts, model, batch_size: int = 1):
        """`fidelities` of one model."""
        return self.fidelities(texts, [model], batch_size)[0]

    @staticmethod
    def reference_logits(model, *inputs) -> torch.Tensor:
        """The PyTorch model's float logits for what `decoder.logits(*inputs)` scores (the fp16 check)."""
        return pytorch_logits(model, *inputs)

    def check_token_ids(self, input_ids: torch.Tensor, shapes) -> None:
        """Every prompt id indexes this model's vocabulary. An id beyond it (a tokenizer of another model, given
        with --tokenizer-dir) would otherwise stop the embedding lookup deep inside a backend, with that backend's
        own message and a traceback."""
        if input_ids.numel() == 0:
            return
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= shapes.vocab_size:
            raise UsageError(f"token id {high if high >= shapes.vocab_size else low} is outside this model's "
                             f"vocabulary (ids 0 to {shapes.vocab_size - 1}); is the tokenizer "
                             "(--tokenizer-dir, tokenizer_dir=) this model's?")


class DecoderOnly(TextInputs):
    """One graph: the prompt goes through the decoder first, then one token per step."""

    name = "decoder-only"

    def derive_shapes(self, settings: BuildSettings, spec: ModelSpec, config) -> ShapeSpec:
        return ShapeSpec.derive(settings, spec, config)

    def open_decoder(self, loaded, backend: str, settings: BuildSettings, options, shapes):
        from nndf.backends import backend_module
        from nndf.decoder import Decoder

        session = backend_module(backend).open_session(loaded, settings, options)
        hooks = loaded.spec.hooks
        return Decoder(session, shapes, hooks, hooks.cache_restart_length(loaded.config))

    def check_length(self, prompt_len: int, max_new_tokens: int, shapes) -> None:
        total = prompt_len + max_new_tokens
        if total > shapes.max_positions:
            raise UsageError(f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens is {total}, "
                             f"more than the {shapes.max_positions} positions of this model")

    def prompt_length(self, input_ids, loaded) -> int:
        return 1 if input_ids is None else input_ids.shape[1]  # None: generate() started from one BOS token

    def check_batches(self, shapes, loaded) -> list[tuple[torch.Tensor, ...]]:
        """Seeded prompts for the fp16 check, scored through `decoder.logits`."""
        return [(ids,) for ids in seeded_prompts(shapes.rows.min, shapes.prompt.max, shapes.vocab_size)]

    def label_ids(self, tokenizer, prompt_ids: torch.Tensor, label: str) -> list[int]:
        """A label is the whole expected text (prompt included); its new tokens follow the prompt's."""
        return list(tokenizer(label)["input_ids"][prompt_ids.shape[1]:])

    pad_side = "left"

    def benchmark_inputs(self, length: int) -> str:
        return f"{length} prompt"

    def lambada(self, texts, model, tokens_to_generate: int, top_n: int, batch_size: int = 1):
        from nndf.evaluation import evaluate_lambada

        return evaluate_lambada(texts, model.tokenizer, lambda ids, mask: model.logits(ids, attention_mask=mask),
                                tokens_to_generate=tokens_to_generate, top_n=top_n, max_positions=model.max_positions,
                                **batching(model, batch_size, 4))

    lm_eval_backend = "causal"  # lm-eval encodes context + continuation as one string (nndf.loglikelihood)

    def loglikelihoods(self, model, pairs, batch_size: int = 1, progress: bool = True) -> list[tuple[float, bool]]:
        """lm-eval's loglikelihood of (context ids, continuation ids) pairs: one forward pass over context +
        continuation cut from the left to the model's positions."""
        from nndf.loglikelihood import causal_scores

        return causal_scores(lambda ids, mask: model.logits(ids, attention_mask=mask), pairs,
                             max_positions=model.max_positions, progress=progress, **batching(model, batch_size, 4))

    def fidelities(self, texts, models, batch_size: int = 1) -> list:
        """Each model's fidelity against one PyTorch pass (the models share their PyTorch model: `open_models`),
        compared batch by batch, so that the reference is not computed again for every backend."""
        from nndf.evaluation import logit_fidelities

        first = models[0]
        return logit_fidelities(texts, first.tokenizer, scorer(first.reference_logits),
                                [scorer(model.logits) for model in models], max_positions=first.max_positions,
                                **batching(first, batch_size, FIDELITY_BYTES_PER_LOGIT))

    def lambada_note(self, tokens_to_generate: int) -> str:
        return (f"top-N and token ppl as NVIDIA's demo defines them, over each passage's last {tokens_to_generate} "
                "token(s), and seq ppl over the whole passage; lm-eval columns as lm-evaluation-harness 0.4.13's hf "
                "model computes lambada_openai (target = last word, encoded with the tokenizer's own special tokens; "
                "acc = every target token greedy; ppl per passage).")


# What fidelity holds per logit of a batch: the reference's float64 log-probabilities and probabilities (kept while
# every candidate is compared, `nndf.evaluation.ReferenceLogits`) and a candidate's float32 logits.
FIDELITY_BYTES_PER_LOGIT = 20


def scorer(score):
    """`score` (a Model's `logits` or `reference_logits`) as the scoring loops call it: with (ids, mask) for a
    decoder-only model, (ids, mask, decoder ids) for an encoder-decoder one."""
    return lambda ids, mask, *decoder_ids: score(ids, *decoder_ids, attention_mask=mask)


def batching(model, batch_size: int, bytes_per_logit: int) -> dict:
    """Scoring's batch keywords: `batch_size` rows, as many positions as keep one batch's logits in budget."""
    from nndf.batching import token_budget

    return {"batch_size": batch_size, "max_batch_tokens": token_budget(model.shapes.vocab_size, bytes_per_logit)}


def architecture(spec: ModelSpec):
    """The strategy object for `spec.architecture`, or a UsageError naming the known ones."""
    target = ARCHITECTURES.get(spec.architecture)
    if target is None:
        raise UsageError(f"{spec.family} declares architecture '{spec.architecture}'; known: "
                         f"{', '.join(ARCHITECTURES)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()
