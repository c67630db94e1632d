"""What a benchmark script tells the shared harness about itself: its engines, goals, tables and worker runners."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Mapping

# Metric name -> (label, lower is better, digits shown). step_ms: median gap between token ticks of one generation;
# ttft_ms: start to first tick (for an encoder-decoder model, encoder included); tok_s: batch * new tokens / whole
# generate call; encoder_ms: time inside the encoder's forward; peak_rss: the worker's peak memory (any batch).
METRICS = {
    "encoder_ms": ("encoder ms", True, 2),
    "step_ms": ("decode ms/step", True, 2),
    "ttft_ms": ("first token ms", True, 1),
    "tok_s": ("tok/s", False, 1),
    "peak_rss": ("peak memory", True, 0),
}
METRIC_LABELS = {name: label for name, (label, _, _) in METRICS.items()}
REFERENCES = ("hf", "optimum")
BUSY_CORES = 0.25  # foreign CPU use (in cores) during the measurement above which the report warns


@dataclass(frozen=True)
class Family:
    """What a model family changes in a script: None keeps the script's own (its Bench's `family`).

    variant, engines, output_len, goals: the defaults of --variant, --engines and --output-len, and the goals;
    inputs: how the inputs are made (harness.inputs: "tokens", seeded random ids of --input-len; "pixels", seeded
    random images of the model's image size);
    hf_class: the transformers auto class a plain-transformers hf worker loads the weights folder with;
    hf_encoder(model): the module whose forward that worker times as the encoder;
    hf_pad: whether that worker passes pad_token_id to generate() (BLIP's generate() passes its own);
    generation(config): the generation entries the family's own generate() passes over the weights' generation
    config (BLIP: eos [SEP], pad [PAD]), for the header;
    note: why its engines differ, for the help ("Optimum does not export BLIP");
    refused: engines that cannot run the family, refused with the note before anything is built.
    """

    variant: str | None = None
    engines: tuple[str, ...] | None = None
    output_len: int | None = None
    goals: tuple | None = None
    inputs: str | None = None
    hf_class: str | None = None
    hf_encoder: Callable | None = None
    hf_pad: bool | None = None
    generation: Callable | None = None
    note: str | None = None
    refused: tuple[str, ...] | None = None


def family_key(name: str) -> str:
    """Family names match as nndf's registry matches them: ignoring case, '-' and '_'."""
    return name.lower().replace("-", "").replace("_", "")


@dataclass(frozen=True)
class Bench:
    """One benchmark script.

    goals: (engine, batch, metric, reference, op, target) tuples; batch None for peak_rss.
    ratio_metrics(batch): the metrics whose ratios to hf and optimum the RATIOS section shows for that batch.
    input_word: what the input tokens are called in the header ("prompt", "encoder").
    check_lengths(config, args): a sentence when the lengths do not fit the model's config, else None.
    make_runner(args): the worker-side runner of args.worker (see harness.worker).
    peers: (ours, peer) pairs whose ratios the report shows side by side (same weights, same precision);
    setups: engine -> setup(engine, args, weights, working_dir, logs, env_info) returning the worker's python and
    its extra arguments, for engines with an environment or files of their own (Optimum's is built in).
    table_notes: what an engine's row measured, said under each batch's table (harness.floor.note).
    family: the script's own family data (inputs "tokens" unless it says otherwise); families: the families that
    change it (name -> Family), applied by for_family().
    """

    name: str
    script: Path
    description: str
    engine_help: dict  # every engine the script knows, in its order -> one line of help
    default_engines: tuple[str, ...]
    goals: tuple
    table_metrics: tuple[str, ...]
    ratio_metrics: Callable[[int], tuple[str, ...]]
    make_runner: Callable
    check_lengths: Callable[[dict, object], str | None]
    default_family: str
    default_variant: str
    quantize: dict
    input_word: str = "prompt"
    exact_engines: tuple[str, ...] = ("nndf-frameworks", "onnxrt")  # must give hf's tokens exactly (fp32)
    unprepared: tuple[str, ...] = ("hf", "nndf-frameworks")  # engines with nothing to export or quantize first
    generation_keys: tuple[str, ...] = ()  # entries of the weights' generation_config.json the header shows
    default_output_len: int = 64
    peers: tuple[tuple[str, str], ...] = ()  # (our engine, a peer at its precision), for the RATIOS against peers
    setups: Mapping[str, Callable] = field(default_factory=dict)  # engine -> its setup (harness.engines.start_engine)
    table_notes: tuple[Callable, ...] = ()  # (report, batch) -> a line under that batch's table, or None
    family: Family = Family(inputs="tokens")
    families: Mapping[str, Family] = field(default_factory=dict)

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self.engine_help)

    def for_family(self, name: str) -> Bench:
        """This script as it runs `name`: that family's defaults, goals and data over the script's own."""
        own = next((f for n, f in self.families.items() if family_key(n) == family_key(name)), None)
        if own is None:
            return self
        given = {f.name: getattr(own, f.name) for f in fields(own) if getattr(own, f.name) is not None}
        return replace(self, family=replace(self.family, **given), default_variant=own.variant or self.default_variant,
                       default_engines=own.engines or self.default_engines,
                       goals=self.goals if own.goals is None else own.goals,
                       default_output_len=own.output_len or self.default_output_len)

    def family_defaults(self, what: str) -> str:
        """'; BLIP: 20' for each family that changes `what` (a Family field; engines with the note), for the help."""
        parts = []
        for name, own in self.families.items():
            value = getattr(own, what)
            if value is not None:
                shown = " ".join(value) if isinstance(value, tuple) else value
                parts.append(f"; {name}: {shown}" + (f", as {own.note}" if own.note and what == "engines" else ""))
        return "".join(parts)
