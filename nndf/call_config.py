"""The generation settings of one `Model.generate` call, merged as transformers 5's `generate()` merges them
(`GenerationMixin._prepare_generation_config`), and the `GenerationOptions` the one loop runs with.

`generate()` starts from a `generation_config=` object when the call passes one (a copy), fills the fields it leaves
unset (None) from the model's own generation config, and lets the call's keywords override both; fields neither sets
take transformers' defaults. A passed config may hold settings this loop does not build (several sequences per
prompt, scores, banned words...): one that would change the result from what the model's own config gives is refused
in one sentence, never ignored. Settings that change how `generate()` computes but not its tokens (cache, compile)
are left aside.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import fields

from nndf.errors import UsageError
from nndf.generate_arguments import RULE_KEYWORDS, check_decoding
from nndf.generation import GenerationOptions
from nndf.sampling import SAMPLING_KEYWORDS, Sampling


# generate()'s settings this loop takes from a (merged) generation config: lengths, beams, the sampling settings,
# the repetition penalty, special tokens and the rules (nndf.generation.GenerationOptions, nndf.sampling.Sampling)
HONOURED = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "num_beams", "repetition_penalty",
    "length_penalty", "early_stopping", "no_repeat_ngram_size", "forced_bos_token_id", "forced_eos_token_id",
    "eos_token_id", "pad_token_id", *(f.name for f in fields(Sampling) if f.name not in ("seed", "stream")),
})
# Settings that choose how generate() computes (cache, compilation, an assistant model's schedule: this loop takes
# no assistant model), or what else it returns with return_dict_in_generate: the same tokens whatever they hold.
SAME_TOKENS = frozenset({
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "prefill_chunk_size", "continuous_batching_config", "low_memory", "transformers_version", "_from_model_config",
    "output_attentions", "output_hidden_states", "is_assistant", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
})
# Where a refused setting of a passed config has a way here
UNBUILT_HINTS = {
    **dict.fromkeys(("num_return_sequences", "output_scores", "output_logits", "return_dict_in_generate"),
                    "the result is generate()'s token tensor, one sequence per prompt"),
    "stop_strings": "give stop_strings= to generate() itself (it uses the model's tokenizer)",
}
BUILT = ("lengths, num_beams, the sampling settings, repetition_penalty, eos/pad tokens, no_repeat_ngram_size, "
         "min_length, length_penalty, early_stopping and forced BOS/EOS tokens")


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:  # objects (a watermarking config, tensors) that do not compare as one bool
        return True


def check_unbuilt(passed, model_config) -> None:
    """One sentence for the first setting of `passed` this loop does not build whose value differs from what
    `generate()` would use without it (the model's own, else transformers' default)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig._get_default_generation_params()
    known = vars(GenerationConfig())  # generate()'s settings; a custom entry is no setting of generate()'s
    for name, value in vars(passed).items():
        if value is None or name not in known or name in HONOURED or name in SAME_TOKENS:
            continue
        own = getattr(model_config, name, None)
        if _differs(value, defaults.get(name) if own is None else own):
            hint = UNBUILT_HINTS.get(name, f"it builds {BUILT}")
            raise UsageError(f"generate() got a generation_config with {name}={value!r}, which this loop does not "
                             f"build ({hint}); leave it unset")


def call_generation_config(model_config, passed):
    """The generation config `generate(generation_config=passed)` runs with before its keywords: the model's own
    when none is passed; else a copy of `passed` whose unset fields the model's fill (transformers' defaults stay
    unfilled: the readers here fall back on them, and the default length needs to know nothing set one)."""
    if passed is None:
        return model_config
    from transformers import GenerationConfig

    if not isinstance(passed, GenerationConfig):
        raise UsageError(f"generation_config must be a transformers GenerationConfig, as generate() takes it; got a "
                         f"{type(passed).__name__} (GenerationConfig(num_beams=4, ...) makes one; or give the "
                         "settings as keywords)")
    check_unbuilt(passed, model_config)
    merged = copy.deepcopy(passed)
    merged.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    return merged


def _whole(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_rules(rules: dict, vocab_size: int) -> None:
    """The rules' values as `generate()` takes them, or one sentence (generate() would fail deep in a logits
    processor, or silently drop a negative size)."""
    forced = rules["forced_eos_token_id"]
    forced_ids = forced if isinstance(forced, (list, tuple)) and forced else [forced]
    checks = (
        ("no_repeat_ngram_size", _whole(rules["no_repeat_ngram_size"]), "a whole number >= 0 (0: off)"),
        ("min_length", _whole(rules["min_length"]), "a whole number >= 0 (counted with the prompt; 0: off)"),
        ("length_penalty", isinstance(rules["length_penalty"], (int, float))
         and not isinstance(rules["length_penalty"], bool), "a number (1: none; above: longer beams)"),
        ("early_stopping", rules["early_stopping"] is True or rules["early_stopping"] is False
         or rules["early_stopping"] == "never", "True, False or 'never'"),
        ("forced_eos_token_id", forced is None or all(_whole(t) and t < vocab_size for t in forced_ids),
         f"a token id (0 to {vocab_size - 1}) or a list of them"),
    )
    for name, ok, allowed in checks:
        if not ok:
            raise UsageError(f"{name} must be {allowed}, got {rules[name]!r}")


def check_token_id(name: str, value, vocab_size: int, several: bool) -> None:
    """A caller's special token (`eos_token_id=`, `pad_token_id=`) is a token id of this model's vocabulary, or for
    EOS a list of them, as `generate()` takes it; else one sentence (a pad id outside the vocabulary stopped the
    embedding lookup of a finished row's next step with an IndexError, a word ended in int()'s ValueError, and a
    float was cut to a whole number)."""
    ids = list(value) if several and isinstance(value, (list, tuple)) and value else [value]
    if not all(_whole(t) and t < vocab_size for t in ids):
        what = "a token id (0 to {}){}".format(vocab_size - 1, " or a non-empty list of them" if several else "")
        raise UsageError(f"{name} must be {what}, got {value!r}")


def generation_options(model, max_new_tokens: int, min_new_tokens: int | None = None, num_beams: int | None = None,
                       forced_bos_token_id: int | None = None, **decoding) -> GenerationOptions:
    """`Model.generation_options`: the options `generate()` would pick from the call's keywords over a passed
    `generation_config` over the model's own (None: the next one's), then transformers' defaults."""
    gen = call_generation_config(model.loaded.generation_config, decoding.get("generation_config"))
    return options_under(gen, model, max_new_tokens, min_new_tokens, num_beams, forced_bos_token_id, **decoding)


def options_under(gen, model, max_new_tokens: int, min_new_tokens: int | None = None, num_beams: int | None = None,
                  forced_bos_token_id: int | None = None, **decoding) -> GenerationOptions:
    """`generation_options` under `gen`, the call's generation config already merged (`call_generation_config`:
    `generate` merges it once, for its length budget and these options alike)."""
    check_decoding(decoding)
    passed = decoding.pop("generation_config", None)  # merged into `gen`; its own forced token ranks first
    seed = decoding.pop("seed", None)
    stream = decoding.pop("sampling_stream", None)
    penalty = decoding.pop("repetition_penalty", None)
    decoding.pop("max_length", None)  # a length: `new_token_budget` turned it into max_new_tokens
    fallback = {"no_repeat_ngram_size": 0, "min_length": 0, "length_penalty": 1.0, "early_stopping": False}
    rules = {key: next((v for v in (decoding.pop(key, None), getattr(gen, key, None), fallback.get(key))
                        if v is not None), None) for key in RULE_KEYWORDS}
    check_rules(rules, model.shapes.vocab_size)
    if forced_bos_token_id is not None:
        check_token_id("forced_bos_token_id", forced_bos_token_id, model.shapes.vocab_size, several=False)
    rules["length_penalty"] = float(rules["length_penalty"])
    defaults = model.spec.hooks.generation_defaults(model.loaded.config)  # what the model's generate() passes
    for key in ("eos_token_id", "pad_token_id"):  # the caller's, as generate(eos_token_id=...) takes them
        given = decoding.pop(key, None)
        if given is not None:
            check_token_id(key, given, model.shapes.vocab_size, several=key == "eos_token_id")
            defaults = dict(defaults, **{key: given})
    eos = defaults.get("eos_token_id", gen.eos_token_id)
    if isinstance(eos, (list, tuple)):  # instruct checkpoints end at any of several tokens
        eos = tuple(eos) or None
    forced = rules.pop("forced_eos_token_id")
    return GenerationOptions(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens if min_new_tokens is not None else gen.min_new_tokens,
        num_beams=num_beams if num_beams is not None else int(gen.num_beams or 1),
        eos_token_id=eos,
        pad_token_id=defaults.get("pad_token_id", gen.pad_token_id),
        # a call's forced token, a passed config's, the model's target language (tgt_lang=), the model config's
        forced_bos_token_id=next((t for t in (forced_bos_token_id, getattr(passed, "forced_bos_token_id", None),
                                              model.forced_bos_token_id, gen.forced_bos_token_id) if t is not None),
                                 None),
        forced_eos_token_id=tuple(forced) if isinstance(forced, list) else forced,
        repetition_penalty=next(p for p in (penalty, gen.repetition_penalty, 1.0) if p is not None),
        sampling=Sampling.resolve(gen, seed=seed, stream=stream, **decoding),
        **rules,
    )


def warn_unused(decoding: dict, options: GenerationOptions) -> None:
    """generate()'s warning for keywords its search ignores: sampling settings without do_sample, beam settings
    with one beam (the command line refuses the sampling ones)."""
    ignored = [key for key in SAMPLING_KEYWORDS[1:] if decoding.get(key) is not None]
    if ignored and not options.sampling.do_sample:
        warnings.warn(f"the following generation flags are not valid and may be ignored: {ignored} (do_sample is "
                      "off: pass do_sample=True to sample)", UserWarning, stacklevel=3)
    beam_only = [key for key, off in (("length_penalty", 1.0), ("early_stopping", False))
                 if decoding.get(key) is not None and decoding[key] != off]
    if beam_only and options.num_beams == 1:
        warnings.warn(f"the following generation flags are not valid and may be ignored: {beam_only} (num_beams is "
                      "1: they shape beam search; pass num_beams=N)", UserWarning, stacklevel=3)


def warn_unfeasible(options: GenerationOptions, before: int) -> None:
    """generate()'s warning for a `min_length` (counted with the output's prompt part, `before` tokens) longer than
    the longest output the call allows: the search stops at the maximum all the same. (A `min_new_tokens` above
    `max_new_tokens` is refused by GenerationOptions.)"""
    longest = before + options.max_new_tokens
    if options.min_new_tokens is None and options.min_length > longest:
        warnings.warn(f"Unfeasible length constraints: min_length ({options.min_length}) is larger than the maximum "
                      f"possible length ({longest}: {before} prompt tokens + max_new_tokens {options.max_new_tokens})"
                      ". Generation will stop at the maximum length; lower min_length or raise max_new_tokens",
                      UserWarning, stacklevel=3)
