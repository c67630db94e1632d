"""The encoder-decoder strategy of `nndf.architectures`: three sessions per backend, decoder tokens out."""

from __future__ import annotations

import torch

from nndf.errors import UsageError
from nndf.architectures import TextInputs
from nndf.reference import seeded_prompts
from nndf.seq2seq.decoder import Seq2SeqDecoder
from nndf.seq2seq.shapes import Seq2SeqShapeSpec
from nndf.seq2seq.wrappers import TextGraphs


def start_token_id(loaded) -> int:
    """The decoder's first token, as `generate()` picks it: the generation config's, else the model config's."""
    for source in (loaded.generation_config, loaded.config):
        token = getattr(source, "decoder_start_token_id", None)
        if token is not None:
            return int(token)
    raise UsageError(f"{loaded.name} names no decoder_start_token_id in its config; an encoder-decoder model "
                     "needs one to start generating")


class EncoderDecoder(TextInputs):
    name = "encoder-decoder"
    has_encoder = True
    reply_continues_prompt = False  # the decoder answers the encoder's text (a chat's reply is a turn of its own)
    lambada_tokens_to_generate = False  # the decoder scores the target word's own tokens, as lm-eval does
    graphs = TextGraphs()  # the three graphs' names, wrappers and tracing examples

    def derive_shapes(self, settings, spec, config) -> Seq2SeqShapeSpec:
        return Seq2SeqShapeSpec.derive(settings, spec, config)

    def open_decoder(self, loaded, backend: str, settings, options, shapes) -> Seq2SeqDecoder:
        from nndf.backends import backend_module

        opener = getattr(backend_module(backend), "open_seq2seq", None)
        if opener is None:
            raise UsageError(f"the {backend} backend does not run encoder-decoder models")
        return self.decoder_over(opener(loaded, settings, options), shapes, loaded)

    def decoder_over(self, sessions: dict, shapes, loaded) -> Seq2SeqDecoder:
        """The object the loop drives over a backend's three sessions."""
        return Seq2SeqDecoder(sessions["encoder"], sessions["cross"], sessions["decoder"], shapes,
                              loaded.spec.hooks, start_token_id(loaded))

    def check_batches(self, shapes, loaded) -> list[tuple[torch.Tensor, ...]]:
        """Seeded inputs of `decoder.logits` for the fp16 check: encoder ids and teacher-forced decoder ids."""
        start, generator = start_token_id(loaded), torch.Generator().manual_seed(1)
        batches = []
        for ids in seeded_prompts(shapes.batch.min, shapes.encoder.max, shapes.vocab_size):
            targets = torch.randint(0, shapes.vocab_size, (ids.shape[0], min(ids.shape[1], shapes.total.max)),
                                    generator=generator)
            batches.append((ids, targets.index_fill(1, torch.tensor([0]), start)))  # teacher-forced from the start
        return batches

    def prompt_length(self, input_ids, loaded) -> int:
        return 1  # the decoder's start token

    def check_length(self, prompt_len: int, max_new_tokens: int, shapes) -> None:
        if prompt_len > shapes.max_positions:
            raise UsageError(f"an input of {prompt_len} tokens exceeds the {shapes.max_positions} positions of this "
                             "model's encoder")
        if max_new_tokens + 1 > shapes.max_positions:
            raise UsageError(f"{max_new_tokens} new tokens after the decoder's start token exceed the "
                             f"{shapes.max_positions} positions of this model's decoder")

    def label_ids(self, tokenizer, prompt_ids: torch.Tensor, label: str) -> list[int]:
        """A label is the expected output text; its tokens as the tokenizer encodes a target (with EOS)."""
        return list(tokenizer(text_target=label)["input_ids"])

    pad_side = "right"  # the encoder sees the whole prompt at once; T5 and BART tokenizers pad on the right

    def benchmark_inputs(self, length: int) -> str:
        return f"{length} encoder"

    lm_eval_backend = "seq2seq"  # lm-eval encodes context and continuation apart (nndf.loglikelihood)

    def decoder_inputs(self, model):
        """target ids -> the decoder's teacher-forced inputs, as the model's forward builds them from labels."""
        hooks, config, start = model.spec.hooks, model.loaded.config, model.decoder.start_token_id
        return lambda labels: hooks.decoder_input_ids(labels, start, config)

    def lambada(self, texts, model, tokens_to_generate: int, top_n: int, batch_size: int = 1):
        from nndf.architectures import batching
        from nndf.seq2seq.evaluation import evaluate_lambada_seq2seq

        def scored(ids, mask, decoder_ids):
            return model.logits(ids, decoder_ids, attention_mask=mask)

        return evaluate_lambada_seq2seq(texts, model.tokenizer, scored, top_n=top_n,
                                        decoder_inputs=self.decoder_inputs(model), max_positions=model.max_positions,
                                        **batching(model, batch_size, 4))

    def loglikelihoods(self, model, pairs, batch_size: int = 1, progress: bool = True) -> list[tuple[float, bool]]:
        """lm-eval's loglikelihood of (encoder ids, continuation ids) pairs: each side cut from the left to the
        model's positions, the continuation teacher-forced on the decoder."""
        from nndf.architectures import batching
        from nndf.seq2seq.evaluation import seq2seq_scores

        def scored(ids, mask, decoder_ids):
            return model.logits(ids, decoder_ids, attention_mask=mask)

        cut = [(context[-model.max_positions:], continuation[-model.max_positions:]) for context, continuation in pairs]
        return seq2seq_scores(scored, cut, self.decoder_inputs(model), progress=progress,
                              **batching(model, batch_size, 4))

    def fidelities(self, texts, models, batch_size: int = 1) -> list:
        """Each model's fidelity over the teacher-forced target tokens, against one PyTorch pass shared by all of
        them (the models share their PyTorch model and tokenizer: `open_models`), as `DecoderOnly.fidelities`."""
        from nndf.architectures import FIDELITY_BYTES_PER_LOGIT, batching, scorer
        from nndf.seq2seq.evaluation import logit_fidelities_seq2seq

        first = models[0]
        return logit_fidelities_seq2seq(texts, first.tokenizer, scorer(first.reference_logits),
                                        [scorer(model.logits) for model in models],
                                        decoder_inputs=self.decoder_inputs(first), max_positions=first.max_positions,
                                        **batching(first, batch_size, FIDELITY_BYTES_PER_LOGIT))

    def lambada_note(self, tokens_to_generate: int) -> str:
        return ("encoder-decoder scoring as lm-evaluation-harness's hf model does it: the passage without its last "
                "word goes to the encoder (with the tokenizer's special tokens), the target word's own tokens (no "
                "special tokens: no </s>, <s> or language code) are scored on the decoder, teacher-forced; lm-eval acc "
                "= every target token greedy, ppl per passage; top-N = share of the target tokens among the N highest "
                "logits; token ppl over the same tokens; no sequence ppl (--tokens-to-generate does not apply).")
