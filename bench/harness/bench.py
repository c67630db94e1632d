"""What a benchmark script tells the shared harness about itself: its engines, goals, tables and worker runners."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
class Bench:
    """One benchmark script.

    goals: (engine, batch, metric, reference, op, target) tuples; batch None for peak_rss.
    ratio_metrics(batch): the metrics whose ratios to hf and optimum the RATIOS section shows for that batch.
    input_word: what the input tokens are called in the header ("prompt", "encoder").
    check_lengths(config, args): a sentence when the lengths do not fit the model's config, else None.
    make_runner(args): the worker-side runner of args.worker (see harness.worker).
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

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self.engine_help)
