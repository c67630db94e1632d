"""`run`: the family's sample prompts from checkpoint.toml on each backend, scored against the labels.

Accuracy is the share of the label's new tokens that the backend reproduces at the same position (greedy, or
beam search with --num-beams); runtimes are medians of the full generation and of one decode step.
"""

from __future__ import annotations

import statistics

from nndf.actions.common import describe, encode_prompts, open_models, say, timing_settings
from nndf.actions.runners import runners_for, time_generation
from nndf.checkpoint import DEFAULT_NEW_TOKENS, read_samples
from nndf.results import Column, Result

TIMED = True


def add_arguments(parser) -> None:
    parser.set_defaults(warmup=1, iterations=3)


def checkpoint_rows(args, models) -> list[dict]:
    """One row per runner: token accuracy against the labels and median runtimes over all samples."""
    timing = timing_settings(args)
    first = models[0]
    tokenizer = first.tokenizer
    samples = read_samples(first.spec, first.variant)
    rows = []
    for runner in runners_for(models):
        matched = total = 0
        full, step = [], []
        for sample in samples:
            ids, mask = encode_prompts(tokenizer, [sample.prompt], args.use_mask, first.architecture.pad_side)
            label = first.label_ids(ids, sample.label) if sample.label else None
            new_tokens = len(label) if label else args.output_seq_len or DEFAULT_NEW_TOKENS
            say(f"{runner.label}: '{sample.prompt[:40]}' + {new_tokens} tokens")
            t = time_generation(runner, ids, mask, new_tokens, None, args.num_beams, timing, progress=False)
            if label:
                new = first.new_tokens(t.output, ids)[0].tolist()
                matched += sum(a == b for a, b in zip(new, label))
                total += len(label)
            full.append(t.latency.median)
            if t.decode_step_median is not None:
                step.append(t.decode_step_median)
        rows.append({
            "backend": runner.label,
            "samples": len(samples),
            "accuracy": matched / total if total else None,
            "generation_ms": statistics.median(full) * 1e3,
            "decode_ms": statistics.median(step) * 1e3 if step else None,
        })
    return rows


COLUMNS = [
    Column("backend", "backend"),
    Column("samples", "samples"),
    Column("accuracy", "label accuracy", "{:.1%}"),
    Column("generation_ms", "full generation", "{:.1f}", "ms"),
    Column("decode_ms", "decode step", "{:.2f}", "ms"),
]


def run(args) -> list[Result]:
    models = open_models(args)
    first = models[0]
    rows = checkpoint_rows(args, models)
    notes = ["label accuracy: share of the label's new tokens reproduced at the same position; labels are the "
             "real weights' outputs, so random weights score near 0; '-' where checkpoint.toml has no labels for "
             "this variant."]
    title = f"run {first.spec.family} {first.variant.name}: checkpoint samples"
    return [Result("run", title, COLUMNS, rows, describe(first), notes)]
