"""What `Model.generate` and `Model.hf_generate` take besides the backend's work: `generate()`'s keywords, checked
(one sentence for a keyword it does not know, or a prompt it cannot read), and how many new tokens a call asks for
by `generate()`'s own rule (`max_new_tokens`, else `max_length` counted with the output's prompt part, else the
generation config's)."""

from __future__ import annotations

import warnings

import torch

from nndf.errors import UsageError
from nndf.sampling import SAMPLING_KEYWORDS

# generate()'s keywords (and the seed) that choose how tokens are picked: Model.generate's `**decoding`.
DECODING_KEYWORDS = (*SAMPLING_KEYWORDS, "repetition_penalty", "seed", "sampling_stream")
# generate()'s keywords for lengths and special tokens, with its meanings (they override the generation config)
LENGTH_AND_TOKEN_KEYWORDS = ("max_length", "eos_token_id", "pad_token_id")
# generate()'s generation-config rules, per call (they override the generation config: nndf.call_config)
RULE_KEYWORDS = ("no_repeat_ngram_size", "min_length", "length_penalty", "early_stopping", "forced_eos_token_id")


# generate() keywords that live elsewhere here: where to give them instead
ELSEWHERE = {
    "use_cache": "the cache is the build's: nndf.load(..., use_cache=False)",
    "inputs": "give the prompt as input_ids (the first argument)",
    "tokenizer": "stop_strings use the model's own tokenizer (m.tokenizer)",
}


def check_decoding(decoding: dict) -> None:
    unknown = sorted(set(decoding) - {*DECODING_KEYWORDS, *LENGTH_AND_TOKEN_KEYWORDS, *RULE_KEYWORDS,
                                      "generation_config"})
    placed = [key for key in unknown if key in ELSEWHERE]
    if placed:
        raise UsageError(f"generate() got {placed[0]}=, which this loop does not take: {ELSEWHERE[placed[0]]}")
    if unknown:
        raise UsageError(f"generate() got unknown keyword(s) {', '.join(unknown)}; besides input_ids, "
                         "attention_mask, pixel_values, max_new_tokens, min_new_tokens, num_beams, streamer, "
                         f"stop_strings, generation_config, {', '.join(LENGTH_AND_TOKEN_KEYWORDS)}, "
                         f"{', '.join(RULE_KEYWORDS)}, it takes the decoding keywords "
                         f"{', '.join(DECODING_KEYWORDS)} (num_return_sequences, output_scores and "
                         "return_dict_in_generate are not built: the result is generate()'s token tensor)")


GENERATE_DEFAULT_NEW_TOKENS = 20  # generate()'s new tokens when nothing sets a length


def new_token_budget(architecture, loaded, input_ids, max_new_tokens: int | None, max_length: int | None,
                     generation_config=None) -> int:
    """How many new tokens `generate()` (transformers 5) would produce at most: `max_new_tokens` when given; else
    the generation config's `max_new_tokens` (it wins over a `max_length` keyword, as in generate(), which warns);
    else a `max_length` (the call's, else the config's) less the part of the output before the new tokens (the
    prompt of a decoder-only model, the start token of an encoder-decoder one), refused as generate() refuses it
    when that part already fills it; else 20 new tokens, fewer where the model's `max_position_embeddings` ends
    sooner. `generation_config`: the call's (nndf.call_config), else the model's."""
    if max_new_tokens is not None:
        return max_new_tokens
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise UsageError(f"max_length must be a whole number of at least 1, got {max_length!r}")
    gen = loaded.generation_config if generation_config is None else generation_config
    if getattr(gen, "max_new_tokens", None) is not None:
        if max_length is not None:  # generate() says so too (in its log)
            warnings.warn(f"Both max_new_tokens (={gen.max_new_tokens}, the generation config's) and max_length "
                          f"(={max_length}) are set; max_new_tokens takes precedence, as in generate(). Give "
                          "max_new_tokens=N to set the length", UserWarning, stacklevel=3)
        return int(gen.max_new_tokens)
    before = architecture.prompt_length(input_ids, loaded)
    total = max_length if max_length is not None else getattr(gen, "max_length", None)
    if total is None:  # generate()'s default: 20 new tokens, within the model's positions
        total = before + GENERATE_DEFAULT_NEW_TOKENS
        positions = getattr(loaded.spec.hooks.generating_config(loaded.config), "max_position_embeddings", None)
        if positions is not None:
            total = min(total, int(positions))
    if before >= total:
        source = "max_length" if max_length is not None else "the generation config's max_length" \
            if getattr(gen, "max_length", None) is not None else "the model's max_position_embeddings"
        raise UsageError(f"the prompt is {before} tokens long and {source} is {int(total)}, so no token is left "
                         "to generate (generate() refuses this too); give max_new_tokens=N")
    return int(total) - before


def check_prompt_tensors(input_ids, attention_mask, image: bool = False):
    """`generate()`'s prompt as it takes it (a batch x length tensor of token ids, a mask of the same shape), or one
    sentence saying what was given instead; a deep error in the model's forward would say nothing useful. Returns
    the mask as integers: a float mask of 0s and 1s (a tokenizer's, cast) is one that generate() takes too."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.is_floating_point() and \
            bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        attention_mask = attention_mask.long()
    for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"{name} must be a torch tensor (batch x length), as generate() takes it; got a "
                             f"{type(value).__name__} (torch.tensor([[...]]) makes one)")
        if value.dim() != 2:
            raise UsageError(f"{name} must be 2-D (batch x length); got shape {tuple(value.shape)} "
                             "(.unsqueeze(0) makes a batch of one)")
        if value.is_floating_point() or value.is_complex():
            raise UsageError(f"{name} must hold integer token ids or 0/1 flags; got {value.dtype}")
    if input_ids is not None and input_ids.shape[0] == 0:
        raise UsageError(f"input_ids has no rows (shape {tuple(input_ids.shape)}): give at least one prompt")
    if attention_mask is not None and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise UsageError("attention_mask must hold 1 for a token and 0 for a pad, as a tokenizer makes it; got "
                         f"other values ({sorted(set(attention_mask.unique().tolist()) - {0, 1})[:3]})")
    if input_ids is not None and input_ids.shape[1] == 0 and not image:
        raise UsageError("input_ids is empty: a prompt needs at least one token (a BOS token, say)")
    if input_ids is not None and attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise UsageError(f"attention_mask has shape {tuple(attention_mask.shape)} and input_ids "
                         f"{tuple(input_ids.shape)}; they must match")
    return attention_mask


def check_streamer(streamer) -> None:
    """A streamer is what `generate(streamer=...)` takes: an object with `put(tokens)` and `end()`."""
    if streamer is not None and not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end",
                                                                                                     None))):
        raise UsageError(f"streamer must have put(tokens) and end(), as transformers' TextStreamer and "
                         f"TextIteratorStreamer have; got a {type(streamer).__name__}")


def check_stop_strings(stop_strings) -> None:
    """Stop strings are what `generate(stop_strings=...)` takes: a string or a list of strings (None or empty: none)."""
    if stop_strings and not (isinstance(stop_strings, str) or isinstance(stop_strings, (list, tuple))
                             and all(isinstance(text, str) for text in stop_strings)):
        raise UsageError(f"stop_strings must be a string or a list of strings, as generate() takes them; got "
                         f"{stop_strings!r}")


def bos_prompt(input_ids, attention_mask, generation_config, takes_images: bool):
    """The prompt `generate()` starts from when it is given no input_ids (a text model): one row holding the
    generation config's `bos_token_id`, as `generate()` builds it; one sentence where it cannot (no BOS token, or a
    mask without the ids it masks). Given ids, and image-to-text models (their text prefix is optional), pass as
    they are."""
    if input_ids is not None or takes_images:
        return input_ids
    if attention_mask is not None:
        raise UsageError("attention_mask was given without input_ids; give the input_ids it masks (or neither: "
                         "generation then starts from the BOS token, as in generate())")
    bos = getattr(generation_config, "bos_token_id", None)
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if len(bos) == 1 else None
    if bos is None:
        raise UsageError("input_ids is None and this model's generation config names no bos_token_id to start "
                         "from (generate() refuses this too); give input_ids")
    return torch.full((1, 1), int(bos), dtype=torch.long)


def warn_right_padding(architecture, attention_mask) -> None:
    """`generate()`'s warning for a left-padding model (decoder-only) given right-padded rows: their new tokens
    follow the pads, so such a row continues garbage (the tokens are still generate()'s own: `TokenState`'s
    `position_offset` numbers them as it does)."""
    if architecture.pad_side != "left" or attention_mask is None or not attention_mask.shape[1]:
        return
    if bool((attention_mask[:, -1] == 0).any()):
        warnings.warn("A decoder-only architecture is being used, but right-padding was detected! For correct "
                      "generation results, please set `padding_side='left'` when initializing the tokenizer.",
                      UserWarning, stacklevel=3)
