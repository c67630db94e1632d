"""The data that describes a model family, a build, and the tensor shapes that follow from both.

Generic code reads these dataclasses and never a family's name: every difference between families is a field
here or a method of `FamilyHooks` that the family's package overrides. Shapes live in one `ShapeSpec`, from
which flag validation, `--info`, TensorRT optimization profiles and the trtexec command are all derived.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch

from nndf.errors import UsageError
from nndf.measure import format_bytes


@dataclass(frozen=True)
class Variant:
    """One checkpoint of a family: its short name, its hub id, and its known config for `--random-weights`."""

    name: str
    hub_id: str
    config: Mapping[str, object]
    params: str = ""  # human-readable size for `list`, e.g. "124M"
    # The hub's generation_config.json of this checkpoint (beams, no-repeat n-grams, forced tokens, ...), so that
    # random weights generate under the same rules as the real checkpoint; empty: defaults from the config.
    generation: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, hub_id: str, params: str, base: Mapping[str, object], generation: Mapping[str, object] | None = None,
           **overrides) -> "Variant":
        """A variant named after its hub id's last part, with `base` config updated by `overrides`."""
        return cls(name=hub_id.split("/")[-1], hub_id=hub_id, config=dict(base, **overrides), params=params,
                   generation=dict(generation or {}))

    @classmethod
    def from_hub(cls, hub_id: str) -> "Variant":
        """Any checkpoint of a family's architecture by its hub id (`--variant someorg/some-llama-finetune`): its
        config comes from the hub or its cache, or with --torch-dir from a folder; there is no known one."""
        return cls(name=hub_id.split("/")[-1], hub_id=hub_id, config={})

    @property
    def has_known_config(self) -> bool:
        return bool(self.config)


def looks_like_hub_id(name: str) -> bool:
    """`org/name` as the Hugging Face hub spells repositories: two non-empty parts, no spaces."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not any(c.isspace() for c in name) and not name.startswith(".")


class FamilyHooks:
    """Per-family behaviour with sensible defaults; a family subclasses this only for its real quirks."""

    def position_ids(self, attention_mask: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Position ids as Hugging Face `generate()` derives them: count real tokens, padding gets 0; those of the
        columns from `start` on. A decode step's one new column is its row's count of real tokens less one (or 0
        when it is padding), in a few ops rather than a cumulative sum over the row: a step's host time goes by ops."""
        if 0 < start == attention_mask.shape[-1] - 1:
            return (attention_mask.sum(-1, keepdim=True) - 1) * attention_mask[:, start:]
        positions = attention_mask.long().cumsum(-1) - 1
        return positions.masked_fill(attention_mask == 0, 0)[:, start:]

    def generating_config(self, config):
        """The config of the module whose generate() makes the tokens (BLIP's text decoder's): its
        `max_position_embeddings` caps generate()'s default length."""
        return config

    def max_positions(self, config) -> int:
        """The longest sequence the model can attend over."""
        return int(config.max_position_embeddings)

    def num_layers(self, config) -> int:
        return int(config.num_hidden_layers)

    def kv_heads(self, config) -> int:
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    def head_dim(self, config) -> int:
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def vocab_size(self, config) -> int:
        return int(config.vocab_size)

    def cache_restart_length(self, config) -> int | None:
        """A length at which the model's own `generate()` drops its KV cache once and recomputes the whole sequence:
        the first step whose sequence is longer than this, with at most this many positions cached, runs without
        a cache (None, the default: never). The loop does the same, so that its tokens stay `generate()`'s."""
        return None

    def encoder_module(self, model):
        """The module that encodes the input of an encoder-decoder model (timed on its own in benchmarks)."""
        return model.get_encoder()

    def decoder_module(self, model):
        """The module whose steps the generation loop runs (the model itself unless a family nests it)."""
        return model

    def static_cache_refusal(self, model) -> str | None:
        """Why the decoder cannot step over a static KV cache (None: it can). transformers marks the models whose
        decode step compiles as one graph (`_can_compile_fullgraph`), which is what a static cache needs."""
        decoder = self.decoder_module(model)
        if getattr(decoder, "_can_compile_fullgraph", False):
            return None
        return (f"{type(decoder).__name__} cannot step over a static KV cache (transformers does not mark it as "
                "compilable as one graph)")

    def generation_defaults(self, config) -> dict:
        """Generation settings the model's own `generate()` passes beside its generation config (BLIP ends captions
        at [SEP], not at the config's EOS); empty for most families."""
        return {}

    def offline_tokenizer(self):
        """A tokenizer to fall back on when neither the hub nor --tokenizer-dir gives one (None: no fallback)."""
        return None

    def build_processor(self, config, tokenizer):
        """The model's processor when no folder or hub id gives one: text models' is their tokenizer."""
        return tokenizer

    def language_token_id(self, code: str, tokenizer=None, config=None) -> int:
        """The token that makes a multilingual model generate in language `code` (`--tgt-lang`)."""
        raise UsageError(f"--tgt-lang {code} applies to multilingual translation models (BART's mbart-large-50); "
                         "this family has no target languages")

    def decoder_input_ids(self, labels: list[int], start_token_id: int, config) -> list[int]:
        """An encoder-decoder model's teacher-forced decoder inputs for target `labels`, as its forward builds
        them when given labels (lm-eval scores these models through `model(labels=...)`): the decoder's start token,
        then the labels shifted right."""
        return [start_token_id, *labels[:-1]]

    def pre_attention(self, layer):
        """The function from a decoder layer's input to what the layer hands its self-attention, or None where it is
        not known (the export then runs that layer on every row: nndf.export.kept_rows). In transformers' pre-norm
        layers it is the layer's first norm: `input_layernorm`, GPT-2's and GPT-J's `ln_1`."""
        for name in ("input_layernorm", "ln_1"):
            norm = getattr(layer, name, None)
            if norm is not None:
                return norm
        return None

    def fp32_modules(self) -> tuple[str, ...]:
        """Module names (dotted suffixes, e.g. "DenseReluDense.wo") whose layers must stay in fp32 when a backend
        builds in fp16, because their activations overflow fp16's range (T5's feed-forward output)."""
        return ()


@dataclass(frozen=True)
class ModelSpec:
    """Everything the harness knows about a family, as data; `registry` maps a family name to one of these."""

    family: str
    description: str
    variants: tuple[Variant, ...]
    backends: tuple[str, ...]
    auto_class: str = "AutoModelForCausalLM"
    # How the model generates: "decoder-only" (one graph, the prompt in the cache) or "encoder-decoder" (encoder,
    # cross-attention cache generator and decoder); `nndf.architectures` maps it to the code that drives it.
    architecture: str = "decoder-only"
    hooks: FamilyHooks = field(default_factory=FamilyHooks)
    checkpoint_file: str = ""  # path of the family's checkpoint.toml for the `run` action
    default_tokenizer: str = ""  # hub id of a tokenizer to try when the weights come from elsewhere

    @property
    def default_variant(self) -> Variant:
        return self.variants[0]

    @property
    def model_types(self) -> tuple[str, ...]:
        """The transformers `model_type`s of the family's known variants (what a hub id of it must have)."""
        return tuple(dict.fromkeys(str(v.config["model_type"]) for v in self.variants if "model_type" in v.config))

    def known_variant(self, name: str) -> Variant | None:
        """The listed variant called `name` (its short name or hub id, any case), or None."""
        wanted = name.lower()
        return next((v for v in self.variants if wanted in (v.name.lower(), v.hub_id.lower())), None)

    def variant(self, name: str | None) -> Variant:
        """The variant called `name`: a listed one, else any hub id (org/name) of the family's architecture (no
        known config); anything else is a UsageError listing the allowed."""
        if name is None:
            return self.default_variant
        known = self.known_variant(name)
        if known is not None:
            return known
        if looks_like_hub_id(name):
            return Variant.from_hub(name)
        import difflib

        allowed = ", ".join(v.name for v in self.variants)
        close = difflib.get_close_matches(name.lower(), [v.name.lower() for v in self.variants], n=1)
        guess = f" (did you mean {next(v.name for v in self.variants if v.name.lower() == close[0])}?)" if close else ""
        raise UsageError(f"unknown --variant '{name}' for {self.family}{guess}; allowed: {allowed}, or the hub id "
                         f"(org/name) of any {self.family} checkpoint")


@dataclass(frozen=True)
class BuildSettings:
    """Every user setting that shapes a session or an artifact (and so goes into an artifact's hash)."""

    batch_size: int = 1
    num_beams: int = 1
    input_seq_len: int | None = None
    output_seq_len: int | None = None
    use_cache: bool = True
    use_mask: bool = False
    fp16: bool = False
    dynamic_batch: bool = False
    min_dynamic_batch: int | None = None
    max_dynamic_batch: int | None = None
    preview_dynamic_shapes: bool = True
    engine_postfix: str = ""

    def __post_init__(self) -> None:
        """Refuse settings no build can have, in the fields' own names (`batch_size must be at least 1`): a Python
        user builds these directly; the command line's `build_settings` rewrites the names into its flags."""
        for name in ("batch_size", "num_beams"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("input_seq_len", "output_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        lo, hi = self.batch_range
        if lo < 1:
            raise UsageError(f"min_dynamic_batch must be at least 1, got {lo}")
        if lo > hi:
            raise UsageError(f"min_dynamic_batch ({lo}) must not exceed max_dynamic_batch ({hi})")
        if self.dynamic_batch and not lo <= self.batch_size <= hi:
            raise UsageError(
                f"batch_size={self.batch_size} must lie within min_dynamic_batch={lo} and max_dynamic_batch={hi}"
            )

    @property
    def batch_range(self) -> tuple[int, int]:
        """(min, max) batch the build must accept: the batch size itself unless --dynamic-batch is on."""
        if not self.dynamic_batch:
            return self.batch_size, self.batch_size
        lo = self.min_dynamic_batch if self.min_dynamic_batch is not None else 1
        hi = self.max_dynamic_batch if self.max_dynamic_batch is not None else max(self.batch_size, lo)
        return lo, hi

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Dim:
    """A (min, opt, max) range for one tensor dimension, as TensorRT profiles want it."""

    min: int
    opt: int
    max: int


def cache_dims(hooks: FamilyHooks, config) -> dict[str, int]:
    """The model's sizes every ShapeSpec carries: decoder layers, KV heads, head size and vocabulary."""
    return {"num_layers": hooks.num_layers(config), "kv_heads": hooks.kv_heads(config),
            "head_dim": hooks.head_dim(config), "vocab_size": hooks.vocab_size(config)}


@dataclass(frozen=True)
class ShapeSpec:
    """The tensor shapes of one decoder build, derived once from the model's config and the user's settings.

    Rows are sequences in flight: batch x beams. `prompt` is the context length the build accepts and `total`
    the context plus generated tokens, bounded by the model's positions.
    """

    rows: Dim
    prompt: Dim
    total: Dim
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    use_cache: bool

    @classmethod
    def derive(cls, settings: BuildSettings, spec: ModelSpec, config) -> "ShapeSpec":
        """Validate the settings against the model and derive every shape; a UsageError names the bad flag."""
        hooks = spec.hooks
        max_positions = hooks.max_positions(config)
        prompt_len = settings.input_seq_len
        new_len = settings.output_seq_len
        if prompt_len is not None and new_len is not None and prompt_len + new_len > max_positions:
            raise UsageError(
                f"--input-seq-len {prompt_len} plus --output-seq-len {new_len} is {prompt_len + new_len} tokens, "
                f"more than the {max_positions} positions of this model"
            )
        if prompt_len is not None and prompt_len > max_positions:
            raise UsageError(f"--input-seq-len {prompt_len} exceeds the {max_positions} positions of this model")
        if new_len is not None and new_len >= max_positions:  # chat and triton, whose prompts come later
            raise UsageError(f"--output-seq-len {new_len} leaves no position for a prompt: this model has "
                             f"{max_positions} positions")
        lo, hi = settings.batch_range
        beams = settings.num_beams
        opt_prompt = prompt_len or max(1, max_positions // 2)
        max_prompt = prompt_len or max_positions
        max_total = min(max_positions, (prompt_len + new_len) if prompt_len and new_len else max_positions)
        restart = hooks.cache_restart_length(config)
        if restart is not None and max_prompt <= restart < max_total:
            max_prompt = restart + 1  # the step that restarts the cache feeds the whole sequence so far
        return cls(
            rows=Dim(lo * beams, settings.batch_size * beams, hi * beams),
            prompt=Dim(1, opt_prompt, max_prompt),
            total=Dim(1, min(max_total, opt_prompt + (new_len or 1)), max_total),
            max_positions=max_positions,
            use_cache=settings.use_cache,
            **cache_dims(hooks, config),
        )

    def profiles(self, input_names: tuple[str, ...]) -> list[dict[str, tuple[tuple[int, ...], ...]]]:
        """TensorRT optimization profiles: {input name: (min shape, opt shape, max shape)} for each profile.

        With cache, as in NVIDIA's demo: a context profile (the whole prompt, empty past) and a generation profile
        (one new token, past of 1 .. total-1 positions). Without cache, one profile over the whole sequence.
        Inputs the graph does not have (position ids of ALiBi models) are left out.
        """
        r, kv = self.rows, (self.kv_heads, self.head_dim)

        def shapes(seq: Dim, mask: Dim, keep: Dim, past: Dim | None) -> dict:
            dims = {
                "input_ids": seq, "attention_mask": mask, "position_ids": seq,
            }
            profile = {name: tuple((getattr(r, a), getattr(d, a)) for a in ("min", "opt", "max"))
                       for name, d in dims.items()}
            profile["logits_to_keep"] = tuple((getattr(keep, a),) for a in ("min", "opt", "max"))
            if past is not None:
                for name in input_names:
                    if name.startswith("past_key_values."):
                        profile[name] = tuple((getattr(r, a), kv[0], getattr(past, a), kv[1])
                                              for a in ("min", "opt", "max"))
            return {name: profile[name] for name in input_names}

        if not self.use_cache:
            return [shapes(self.total, self.total, Dim(1, 1, self.total.max), None)]
        context = shapes(self.prompt, self.prompt, Dim(1, 1, self.prompt.max), Dim(0, 0, 0))
        past = Dim(1, max(1, self.total.opt - 1), max(1, self.total.max - 1))
        generation = shapes(Dim(1, 1, 1), Dim(2, self.total.opt, self.total.max), Dim(1, 1, 1), past)
        return [context, generation]

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        """Bytes the (self-attention) KV cache holds per token of one sequence: a key and a value per layer, each
        KV heads x head size. Grouped- and multi-query attention keep only their KV heads (Llama 3.1 8B: 8 of 32)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * bytes_per_value

    def kv_cache_note(self, bytes_per_value: int) -> str:
        """The `--info` line on the KV cache's size, per token and at the build's largest shapes."""
        per_token = self.kv_bytes_per_token(bytes_per_value)
        whole = per_token * self.rows.max * self.total.max
        return (f"KV cache: {per_token:,} bytes per token and sequence (2 x {self.num_layers} layers x "
                f"{self.kv_heads} KV heads x {self.head_dim} head size x {bytes_per_value} bytes); "
                f"{format_bytes(whole)} at {self.rows.max} rows x {self.total.max} positions")

    def kv_shape(self, rows: int, length: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key or value cache: (rows, kv heads, length, head dim)."""
        return rows, self.kv_heads, length, self.head_dim

    def describe(self) -> list[tuple[str, str]]:
        """(name, shape) lines for `--info`: inputs and outputs of the decoder with their ranges."""
        rows = f"{self.rows.min}..{self.rows.max}" if self.rows.min != self.rows.max else str(self.rows.max)
        seq = f"1..{self.total.max}"
        lines = [
            ("input_ids", f"[{rows}, {seq}] int64"),
            ("attention_mask", f"[{rows}, {seq}] int64"),
            ("position_ids", f"[{rows}, {seq}] int64"),
            ("logits_to_keep", f"[{seq}] int64"),
            ("logits", f"[{rows}, {seq}, {self.vocab_size}] float"),
        ]
        if self.use_cache:
            past = f"[{rows}, {self.kv_heads}, 0..{self.total.max - 1}, {self.head_dim}]"
            lines.append((f"past_key_values.{{0..{self.num_layers - 1}}}.key|value", past))
            lines.append((f"present.{{0..{self.num_layers - 1}}}.key|value", f"[{rows}, {self.kv_heads}, 1..{self.total.max}, {self.head_dim}]"))
        return lines
