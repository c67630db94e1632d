"""One decoding loop for every backend: greedy search, sampling and beam search over a `Decoder`.

The algorithms follow Hugging Face `generate()` (transformers 5.x) step for step, so that any backend that
computes the same logits produces the same tokens: greedy search pads finished rows with the pad token, sampling is
greedy search with `generate()`'s warpers and draw (nndf.sampling), and beam search is the vectorised version with
2 x beams candidates per step, length penalty and the same early-stopping heuristic. A streamer (Hugging Face's
`put`/`end` protocol) receives what `generate()` gives it. Backends differ only in how `Decoder.step` executes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from nndf.decoder import Decoder, TokenState
from nndf.errors import UsageError
from nndf.generate_arguments import check_streamer
from nndf.processors import FastMinLength, FastMinNewTokensLength, PlainProcessors, head_screen
from nndf.sampling import Sampling, check_repetition_penalty


@functools.cache
def penalty_skips_padding() -> bool:
    """Whether this transformers' `generate()` spares each row's left padding from the repetition penalty: from
    5.23 on, `RepetitionPenaltyLogitsProcessor` takes per-row lengths (`prompt_ignore_length` as a tensor) and
    `generate()` passes them; before, it penalises every token of the prompt, padding included, and the processor
    refuses a tensor. The loop does what the installed `generate()` does."""
    import inspect

    from transformers import RepetitionPenaltyLogitsProcessor

    parameter = inspect.signature(RepetitionPenaltyLogitsProcessor).parameters.get("prompt_ignore_length")
    return parameter is not None and "Tensor" in str(parameter.annotation)


BEAMS_WITH_SAMPLING = ("sampling with beam search is not built: sample with num_beams=1 (--num-beams 1), or search "
                       "beams with do_sample=False (--no-do-sample)")
BEAMS_WITH_STOPPING = ("stopping criteria (stop strings) apply to greedy search and sampling; beam search ends at EOS "
                       "or max_new_tokens")


@dataclass(frozen=True)
class GenerationOptions:
    """What to generate; the defaults are those of Hugging Face `generate()`.

    Lengths count the loop's own sequences: the prompt for a decoder-only model, the decoder's tokens (from its
    start token) for an encoder-decoder model, as in `generate()`. `min_new_tokens` None leaves `min_length` (the
    model's generation config) in charge; a number overrides it, as `generate(min_new_tokens=...)` does.
    `repetition_penalty` is `generate()`'s (any search); `sampling` says whether and how tokens are drawn
    (nndf.sampling.Sampling: greedy by default).
    """

    max_new_tokens: int = 32
    min_new_tokens: int | None = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    eos_token_id: int | tuple[int, ...] | None = None  # several: a row ends at any of them (instruct checkpoints)
    pad_token_id: int | None = None
    min_length: int = 0
    repetition_penalty: float = 1.0  # instruct generation configs set it (Qwen2.5-Instruct: 1.05 to 1.1)
    no_repeat_ngram_size: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | tuple[int, ...] | None = None  # several: any of them at the last position
    sampling: Sampling = Sampling()

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "num_beams"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise UsageError(f"{name} must be a whole number, got {value!r}")
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.min_new_tokens is not None and not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise UsageError(f"min_new_tokens must lie in 0..max_new_tokens, got {self.min_new_tokens}")
        if self.num_beams < 1:
            raise UsageError(f"num_beams must be at least 1, got {self.num_beams}")
        check_repetition_penalty(self.repetition_penalty)
        if self.num_beams > 1 and self.sampling.samples:
            raise UsageError(BEAMS_WITH_SAMPLING)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every token that ends a row (a generation config may list several)."""
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def eos_tensor(self, device) -> torch.Tensor | None:
        """The EOS ids as `is_eos` takes them: a 0-d tensor for one id (one comparison per step), a vector for
        several."""
        if not self.eos_ids:
            return None
        return torch.tensor(self.eos_ids[0] if len(self.eos_ids) == 1 else self.eos_ids, device=device)

    @property
    def first_eos(self) -> int | None:
        """The EOS `generate()` pads with when there is no pad token: the first one listed."""
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def pad(self) -> int | None:
        return self.pad_token_id if self.pad_token_id is not None else self.first_eos

    def processors(self, prompt_len: int, prompt_mask: torch.Tensor | None = None):
        """The logits processors `generate()` would apply, built from transformers' own classes in its order, with
        its sampling warpers last when sampling.

        They are pure functions of (tokens so far, scores), so reusing them keeps parity exact as transformers
        changes. `prompt_len` is the length of the loop's sequences before the first new token; `prompt_mask`
        their mask, whose left padding the repetition penalty skips as `generate()`'s does.
        """
        from transformers import (
            ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
        )

        eos = list(self.eos_ids) or None
        max_length = prompt_len + self.max_new_tokens
        min_length = self.min_length if self.min_new_tokens is None else prompt_len + self.min_new_tokens
        processors = []
        if self.repetition_penalty != 1.0:
            skips = prompt_mask is not None and penalty_skips_padding()
            padding = (prompt_mask != 0).int().argmax(dim=1) if skips else None
            processors.append(RepetitionPenaltyLogitsProcessor(float(self.repetition_penalty),
                                                               prompt_ignore_length=padding))
        if self.no_repeat_ngram_size > 0:
            processors.append(NoRepeatNGramLogitsProcessor(self.no_repeat_ngram_size))
        if eos is not None and min_length > 0 and self.min_new_tokens is None:
            # generate() adds this beside MinNewTokens when min_new_tokens is given, with min_length = prompt +
            # min_new_tokens: the same EOS ban twice. Once is exact and saves a pass over the vocabulary per step.
            processors.append(FastMinLength(min_length, eos))
        if eos is not None and self.min_new_tokens:
            processors.append(FastMinNewTokensLength(prompt_len, self.min_new_tokens, eos))
        if self.forced_bos_token_id is not None:
            processors.append(ForcedBOSTokenLogitsProcessor(self.forced_bos_token_id))
        if self.forced_eos_token_id is not None:
            processors.append(ForcedEOSTokenLogitsProcessor(max_length, self.forced_eos_token_id))
        processors.extend(self.sampling.warpers())
        return PlainProcessors(processors)


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Which tokens are one of the few `eos` ids: `torch.isin` sorts its inputs and costs several times more per
    step than comparing against each id (and one id is one comparison)."""
    if eos.dim() == 0:
        return tokens == eos
    return (tokens.unsqueeze(-1) == eos).any(dim=-1)


def generate(
    decoder: Decoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    options: GenerationOptions = GenerationOptions(),
    on_token: Callable[[], None] | None = None,
    on_encoded: Callable[[], None] | None = None,
    encoder_inputs: dict | None = None,
    stopping: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
    streamer=None,
) -> torch.Tensor:
    """Whole sequences, as Hugging Face `generate()` returns them: prompt + new tokens for a decoder-only model,
    the decoder's tokens from its start token for an encoder-decoder one (`decoder.start` prepares either), the
    text prompt + caption for an image-to-text one (`encoder_inputs`: its `pixel_values`).

    `on_token` is called once per generated position (after the token is chosen), for time-to-first-token and
    per-step timing; `on_encoded` once the first state is ready (an encoder-decoder's encoder and cross-attention
    cache generator have run), for the encoder's time. `stopping` is what `generate(stopping_criteria=...)` takes (a
    transformers `StoppingCriteria(List)`: (sequences so far, scores) -> True per row that is done, or one bool for
    all rows), asked after each token of greedy search; a row it ends gets pad tokens after, as in `generate()`.
    `streamer` is what `generate(streamer=...)` takes (`put(tokens)`, `end()`: transformers' `TextStreamer`,
    `TextIteratorStreamer`): it gets the loop's starting sequences (the prompt; an encoder-decoder's start token),
    then each step's new token of every row (pad for a finished row), then `end()`, as from `generate()`; like
    `generate()`, beam search does not stream.
    """
    input_ids = input_ids.to(decoder.device)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(decoder.device).long()
    if mask.shape != input_ids.shape:
        raise UsageError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(input_ids.shape)}")
    if options.num_beams > 1 and stopping is not None:
        raise UsageError(BEAMS_WITH_STOPPING)
    if options.num_beams > 1 and streamer is not None:
        raise UsageError("a streamer follows one sequence per prompt, as generate()'s does; beam search "
                         "(num_beams > 1) cannot stream")
    check_streamer(streamer)
    with torch.inference_mode(), decoder.host_threads():
        state = decoder.start(input_ids, mask, options.num_beams, **(encoder_inputs or {}))
        if on_encoded is not None:
            on_encoded()
        if options.num_beams > 1:
            return beam_search(decoder, state, input_ids.shape[0], options, on_token)
        if streamer is not None:
            streamer.put(state.tokens.cpu())
        tokens = greedy_search(decoder, state, options, on_token, stopping, streamer)
    if streamer is not None:
        streamer.end()
    return tokens


# How often greedy search on a GPU asks whether every row has ended: reading the answer waits for the GPU, and a
# wait per token leaves the GPU idle while the host prepares the next step. Steps past the end are cut off after.
GPU_STOP_CHECK_EVERY = 8


def stop_check_interval(device: torch.device) -> int:
    """Every how many tokens greedy search reads whether all rows have ended (on the CPU reading costs nothing)."""
    return 1 if device.type == "cpu" else GPU_STOP_CHECK_EVERY


def greedy_search(decoder, state: TokenState, options, on_token=None, stopping=None, streamer=None) -> torch.Tensor:
    """Greedy search, or sampling when `options.sampling` samples: the same loop, another way to pick a token."""
    rows, prompt_len = state.tokens.shape
    processors = options.processors(prompt_len, state.mask)
    screen = head_screen(options, processors, stopping)
    choose = options.sampling.chooser()
    # a screened head's candidates spare top-k a pass over the vocabulary (read only where something reads them)
    reads_candidates = choose.reads_candidates or processors.reads_candidates
    cache = decoder.new_cache(rows, prompt_len + options.max_new_tokens, reads_candidates)
    state.reserve(prompt_len + options.max_new_tokens)
    eos = options.eos_tensor(state.tokens.device)
    eos_ids = frozenset(options.eos_ids)
    ends = eos is not None or stopping is not None  # rows can end before max_new_tokens
    device = state.tokens.device
    # A streamer reads every token on the host anyway, and must not see steps past the end (generate() stops there)
    check_every = 1 if streamer is not None else stop_check_interval(device)
    unfinished = torch.ones(rows, dtype=torch.bool, device=device)
    running_steps = torch.zeros((), dtype=torch.long, device=device)  # steps after which a row was still running
    # Where the host reads every step (check_every 1), it knows while no row has ended, and skips the pad and the
    # bookkeeping of ended rows: each PyTorch op right after a step costs tens of microseconds (cold caches).
    all_running = True
    logits = decoder.step(state, cache, screen=screen(state.tokens))
    for generated in range(options.max_new_tokens):
        last = logits.select(1, -1)
        candidates = decoder.candidates if reads_candidates else None
        scores = processors(state.tokens, last if last.dtype == torch.float32 else last.float(), candidates)
        next_tokens = choose(scores, candidates) if choose.reads_candidates else choose(scores)
        if ends and options.pad is not None and not all_running:
            next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, options.pad))
        if eos is not None:
            # (where the host reads every step and no row has ended yet, it asks of the tokens as Python ints)
            if check_every > 1 or not all_running or not eos_ids.isdisjoint(next_tokens.tolist()):
                unfinished &= ~is_eos(next_tokens, eos)
                all_running = False
        state.append(next_tokens)
        if stopping is not None:
            # generate() gives stopping criteria the scores its warpers left: top-k too, which the draw applied
            done = torch.as_tensor(stopping(state.tokens, choose.warped(scores)), dtype=torch.bool, device=device)
            unfinished &= ~done
            all_running = False
        if on_token is not None:
            on_token()
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        if generated + 1 == options.max_new_tokens:
            break
        if ends:
            if check_every == 1:  # the host reads it at every step: no count of running steps needed
                if not all_running and not bool(unfinished.any()):
                    break
            else:
                running_steps += unfinished.any()
                if (generated + 1) % check_every == 0 and not bool(unfinished.any()):
                    break
        logits = decoder.step(state, cache, screen=screen(state.tokens))
    if ends and check_every > 1 and not bool(unfinished.any()):
        # generate() stops at the step that ended the last row: the steps run after it are cut off.
        return state.tokens[:, : prompt_len + int(running_steps) + 1]
    return state.tokens


def _gather_beams(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tensor[b, indices[b, k], ...] for every batch item b (beam dimension 1)."""
    while indices.dim() < tensor.dim():
        indices = indices.unsqueeze(-1)
    return torch.take_along_dim(tensor, indices, dim=1)


def beam_search(decoder, state: TokenState, batch: int, options, on_token=None) -> torch.Tensor:
    """Hugging Face's vectorised beam search (transformers 5.x `_beam_search`), one hypothesis per prompt.

    `state` holds `batch` x `num_beams` rows, each prompt repeated for its beams."""
    rows, prompt_len = state.tokens.shape
    beams = options.num_beams
    device = state.tokens.device
    processors = options.processors(prompt_len, state.mask)
    max_length = prompt_len + options.max_new_tokens
    eos = options.eos_tensor(device)
    penalty = options.length_penalty
    early_stopping = options.early_stopping

    # Keep (EOS tokens + 1) x beams candidates (at least 2 x), so that beams that end with an EOS still leave `beams`
    # running ones.
    keep = max(2, 1 + len(options.eos_ids)) * beams
    top_beam_mask = torch.cat([torch.ones(beams, dtype=torch.bool), torch.zeros(keep - beams, dtype=torch.bool)])
    top_beam_mask = top_beam_mask.to(device)

    # The same fill value as transformers (`pad or eos if eos is set else -1`): it shows in shorter hypotheses.
    fill = (options.pad_token_id or options.first_eos) if eos is not None else -1
    running = torch.full((batch, beams, max_length), fill, dtype=torch.int64, device=device)
    running[:, :, :prompt_len] = state.tokens.view(batch, beams, prompt_len)
    finished = running.clone()
    running_scores = torch.zeros((batch, beams), dtype=torch.float, device=device)
    running_scores[:, 1:] = -1e9
    finished_scores = torch.full((batch, beams), -1e9, dtype=torch.float, device=device)
    is_finished = torch.zeros((batch, beams), dtype=torch.bool, device=device)
    may_improve = torch.ones((batch, 1), dtype=torch.bool, device=device)
    running_origin = torch.full((batch, beams, max_length - prompt_len), -1, dtype=torch.int32, device=device)
    finished_origin = running_origin.clone()

    cache = decoder.new_cache(rows, max_length)
    cur_len = prompt_len
    logits = decoder.step(state, cache)
    while True:
        log_probs = processors(state.tokens, torch.log_softmax(logits[:, -1, :].float(), dim=-1))
        vocab = log_probs.shape[-1]
        log_probs = log_probs.view(batch, beams, vocab) + running_scores[:, :, None]
        topk_scores, topk_indices = torch.topk(log_probs.view(batch, beams * vocab), k=keep)
        topk_beam = topk_indices // vocab
        topk_tokens = topk_indices % vocab
        topk_sequences = _gather_beams(running, topk_beam)
        topk_sequences[:, :, cur_len] = topk_tokens
        topk_origin = _gather_beams(running_origin, topk_beam)
        batch_offset = torch.arange(batch, device=device).view(-1, 1) * beams
        topk_origin[:, :, cur_len - prompt_len] = (topk_beam + batch_offset).to(torch.int32)

        hits_stop = torch.full_like(topk_tokens, cur_len + 1 >= max_length, dtype=torch.bool)
        if eos is not None:
            hits_stop |= is_eos(topk_tokens, eos)

        # The best `beams` candidates that did not stop go on running.
        running_candidates = topk_scores + hits_stop.float() * -1e9
        next_index = torch.topk(running_candidates, k=beams)[1]
        running = _gather_beams(topk_sequences, next_index)
        running_scores = _gather_beams(running_candidates, next_index)
        running_origin = _gather_beams(topk_origin, next_index)

        # Candidates among the top `beams` that stopped join the finished hypotheses if they score higher.
        just_finished = hits_stop & top_beam_mask[None, :]
        scored = topk_scores / ((cur_len + 1 - prompt_len) ** penalty)
        all_full = torch.all(is_finished, dim=-1, keepdim=True) & (early_stopping is True)
        scored = scored + all_full.float() * -1e9 + (~may_improve).float() * -1e9 + (~just_finished).float() * -1e9
        merged_index = torch.topk(torch.cat([finished_scores, scored], dim=1), k=beams)[1]
        finished = _gather_beams(torch.cat([finished, topk_sequences], dim=1), merged_index)
        finished_scores = _gather_beams(torch.cat([finished_scores, scored], dim=1), merged_index)
        finished_origin = _gather_beams(torch.cat([finished_origin, topk_origin], dim=1), merged_index)
        is_finished = _gather_beams(torch.cat([is_finished, just_finished], dim=1), merged_index)

        if cache is not None:
            cache.reorder(running_origin[..., cur_len - prompt_len].reshape(rows).long())
        cur_len += 1
        if on_token is not None:
            on_token()
        may_improve = _may_still_improve(
            may_improve, running_scores, finished_scores, is_finished, cur_len, max_length, prompt_len, options
        )
        stop = ~may_improve.any() | torch.all(hits_stop)
        if early_stopping is True:
            stop |= torch.all(is_finished)
        if bool(stop):  # one wait for the device per step, where the loop truly needs the answer
            break
        state.replace_tokens(running[:, :, :cur_len].reshape(rows, cur_len))
        logits = decoder.step(state, cache)

    best = finished[:, 0, :]
    generated = int(((finished_origin[:, 0, :] + 1) != 0).sum(dim=1).max())
    return best[:, : prompt_len + generated]


def _may_still_improve(may_improve, running_scores, finished_scores, is_finished, cur_len, max_length, prompt_len,
                       options) -> torch.Tensor:
    """transformers' early-stop heuristic: can the best running beam still beat the worst finished one?"""
    penalty = options.length_penalty
    if options.early_stopping == "never" and penalty > 0.0:
        best_length = max_length - prompt_len
    else:
        best_length = cur_len - prompt_len
    best_running = running_scores[:, :1] / (best_length**penalty)
    worst_finished = torch.where(is_finished, torch.min(finished_scores, dim=1, keepdim=True)[0], -1.0e9)
    return may_improve & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
