"""`benchmark`: fixed input and output lengths, seeded random prompts, early stopping off.

EOS is suppressed until the last token (min new tokens = max new tokens, as NVIDIA's demo does), so every
backend generates exactly `--output-seq-len` tokens and the figures compare like with like. Tokens are picked as
the model's generation config and the sampling flags say (the title says which); sampling's cost per step shows in
the decode column, and every backend draws with the same seed.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from nndf.actions.common import (
    add_image_argument, data_seed, decoding_flags, decoding_note, describe, given_images, open_models,
    random_input_ids, say, timing_settings, weights_and_cache,
)
from nndf.actions.runners import runners_for, time_generation
from nndf.architectures import architecture
from nndf.errors import UsageError
from nndf.images import caption_inputs
from nndf.interrupt import KeepOnInterrupt
from nndf.measure import format_bytes
from nndf.plots import Panel, check_plotting, plot_bars
from nndf.registry import resolve
from nndf.results import Column, Result

TIMED = True
SAMPLES = True
DEFAULT_INPUT_LEN = 64
DEFAULT_OUTPUT_LEN = 64


# --input-seq-len's default is set in `run`: an image-to-text model's is no text prefix (cli.py says it in --help)
INPUT_LEN_DEFAULT = f"{DEFAULT_INPUT_LEN}; image-to-text families: none, no text prefix"


def add_arguments(parser) -> None:
    parser.output_group.add_argument("--plot", metavar="FILE.png", help="also draw decode ms/step (with its spread) "
                                     "and tokens/s per backend into this PNG (needs the plot extra: matplotlib)")
    add_image_argument(parser, "image-to-text families (BLIP): these PNG/JPEG files instead of random pixels (their "
                       "count is the batch)")
    parser.set_defaults(output_seq_len=DEFAULT_OUTPUT_LEN)


def image_inputs(args, model, images) -> dict:
    """An image-to-text model's inputs: seeded random pixels of its image size (or the given images), and with
    --input-seq-len a text prefix of that many seeded random tokens (else none: unconditional captioning)."""
    shapes = model.shapes
    if images is not None:
        inputs = caption_inputs(model.processor, images)
    else:
        generator = torch.Generator().manual_seed(data_seed(args))
        size = shapes.image_size
        inputs = {"pixel_values": torch.randn(args.batch_size, 3, size, size, generator=generator)}
    if args.input_seq_len:  # the processor's [CLS] ... [SEP] form: the text decoder gets --input-seq-len tokens
        rows = inputs["pixel_values"].shape[0]
        inputs["input_ids"] = random_input_ids(rows, args.input_seq_len + 1, shapes.vocab_size, data_seed(args))
    return inputs


def run(args) -> list[Result]:
    timing = timing_settings(args)
    check_plotting(args.plot)
    spec, _ = resolve(args.model, args.variant)
    images = given_images(args, spec)
    takes_images = architecture(spec).takes_images
    if args.input_seq_len is None and not takes_images:
        args.input_seq_len = DEFAULT_INPUT_LEN
    if images is not None:
        if args.batch_size not in (1, len(images)):  # 1: the default, left as it is
            raise UsageError(f"--image gave {len(images)} image(s), and they are the batch; --batch-size "
                             f"{args.batch_size} cannot apply (leave it out, or give {args.batch_size} images)")
        args.batch_size = len(images)
    models = open_models(args)
    first = models[0]
    prompt_len, new_tokens = args.input_seq_len or 0, args.output_seq_len
    if takes_images:
        inputs = image_inputs(args, first, images)
    else:
        input_ids = random_input_ids(args.batch_size, prompt_len, first.shapes.vocab_size, data_seed(args))
        inputs = {"input_ids": input_ids, "attention_mask": input_ids.new_ones(input_ids.shape) if args.use_mask
                  else None}
    batch = args.batch_size
    pct = timing.percentile
    decoding = decoding_flags(args)
    picked = decoding_note(first, decoding, args.num_beams)
    runners, keep = runners_for(models), KeepOnInterrupt()
    rows = keep.each(runners, "benchmarking", "not measured",
                     lambda runner: _measure(runner, args, timing, inputs, first, decoding, picked),
                     name=lambda runner: runner.label)
    hf_row = next((row for row, runner in zip(rows, runners) if runner.is_hf_generate), None)
    if hf_row is not None:  # the speed-up users come for, against the generate() they know
        for row in rows:
            row["vs_hf"] = row["tokens_per_s"] / hf_row["tokens_per_s"]
    columns = [
        Column("backend", "backend"),
        Column("latency_ms", f"p{pct:g} latency", "{:.1f}", "ms"),
        *([Column("encoder_ms", "encoder", "{:.1f}", "ms")] if any(r["encoder_ms"] is not None for r in rows) else []),
        Column("first_token_ms", "first token", "{:.1f}", "ms"),
        Column("decode_ms", "decode step", "{:.2f}", "ms"),
        Column("tokens_per_s", "throughput", "{:.1f}", "tok/s"),
        *([Column("vs_hf", "vs HF generate", "{:.2f}x")] if hf_row is not None else []),
        Column("spread_pct", "stdev", "{:.1f}", "%"),
        Column("peak_memory", "peak memory"),
    ]
    context = dict(describe(*models), timing=dataclasses.asdict(timing), decoding=picked, input_seed=data_seed(args),
                   input_seq_len=prompt_len, output_seq_len=new_tokens)
    notes = [runs_note(rows, timing)]
    if hf_row is not None:
        notes.append(f"vs HF generate: throughput over that of {hf_row['backend']} (Hugging Face generate() on the "
                     "same PyTorch model).")
    if any(r["encoder_ms"] is not None for r in rows):
        notes.append("encoder: the encoder's run (a vision encoder's for images), and for our loop the "
                     "cross-attention cache generator's too (Hugging Face computes the cross-attention keys and "
                     "values inside its first decoder step); first token includes it.")
    if new_tokens == 1:
        notes.append(f"decode step: '-': {ONE_TOKEN}.")
    notes += noisy_note(rows) + keep.notes()
    inputs = first.architecture.benchmark_inputs(prompt_len)
    title = (f"benchmark {first.spec.family} {first.loaded.name}: batch {batch}, {inputs} + "
             f"{_count(new_tokens, 'new token')}, {picked}, {weights_and_cache(args)}")
    if args.plot:
        plot_bars(args.plot, title, rows, [Panel("decode_ms", "decode step (ms, +- stdev over runs)",
                                                 "decode_spread_ms", missing=ONE_TOKEN),
                                           Panel("tokens_per_s", "throughput (tok/s)")])
        notes.append(f"plot written to {args.plot}")
    return keep.finish([Result("benchmark", title, columns, rows, context, notes)])


def _measure(runner, args, timing, inputs: dict, first, decoding, picked: str) -> dict:
    """Time one backend's generations: its row."""
    batch, prompt_len, new_tokens = args.batch_size, args.input_seq_len or 0, args.output_seq_len
    say(f"benchmarking {runner.label}: batch {batch}, {first.architecture.benchmark_inputs(prompt_len)} + "
        f"{_count(new_tokens, 'token')}, {picked}")
    t = time_generation(runner, inputs, new_tokens, new_tokens, args.num_beams, timing, decoding=decoding)
    latency = t.latency.percentile(timing.percentile)
    return {
        "backend": runner.label,
        "runs": len(t.latency.samples),
        "latency_ms": latency * 1e3,
        "encoder_ms": None if t.encoder_median is None else t.encoder_median * 1e3,
        "first_token_ms": t.first_token_median * 1e3,
        "decode_ms": None if t.decode_step_median is None else t.decode_step_median * 1e3,
        "tokens_per_s": batch * new_tokens / latency,
        "spread_pct": 100 * t.latency.stdev / t.latency.mean,
        "decode_spread_ms": 1e3 * statistics.stdev(t.decode_steps) if len(t.decode_steps) > 1 else None,
        "peak_memory": format_bytes(t.peak_bytes),
        "peak_bytes": t.peak_bytes,
    }


ONE_TOKEN = "one new token (--output-seq-len 1) has no decode step to time"


def runs_note(rows: list[dict], timing) -> str:
    """What the figures are over: the timed runs of each backend (with --duration a fast backend has more than a
    slow one in the same seconds, so the counts are each row's), the warm-up, how throughput and stdev are
    computed, and whose memory the peak is."""
    counts = {row["runs"] for row in rows}
    runs = (f"{_count(counts.pop(), 'timed run')} per backend" if len(counts) == 1 else
            "timed runs: " + ", ".join(f"{row['backend']} {row['runs']}" for row in rows)
            + f" (as many as fit in --duration {timing.duration:g} s)")
    return (runs + (f" (each the mean of {timing.number} generations, --number)" if timing.number > 1 else "")
            + f" after {_count(timing.warmup, 'warm-up run')}; throughput is batch x new tokens over the "
            f"p{timing.percentile:g} latency (prompt tokens not counted) and stdev the latency's over the timed runs, "
            "in % of their mean; first token and decode step are medians over the same runs; peak memory is the "
            "whole process's at its highest while that backend ran (resident set on the CPU, so every backend loaded "
            "before it counts too; allocated on CUDA): for one backend's own, run it alone, or bench/decoder_cpu.py "
            "(a process per engine).")


# A run's latency stdev over its mean above which its figures say more about the machine than about the backend
# (quiet runs on the 2-core development machine stay under 10%).
NOISY_SPREAD_PCT = 30


def noisy_note(rows: list[dict]) -> list[str]:
    """A note naming the rows whose runs spread so widely that their figures are the machine's more than theirs."""
    noisy = [r["backend"] for r in rows if r["spread_pct"] is not None and r["spread_pct"] > NOISY_SPREAD_PCT]
    if not noisy:
        return []
    return [f"stdev above {NOISY_SPREAD_PCT}% ({', '.join(noisy)}): other work on this machine was competing for its "
            "cores, so compare those figures with care (more --iterations, fewer --threads than cores, or a quieter "
            "machine)"]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
