"""`run`: the family's sample prompts from checkpoint.toml on each backend, scored against the labels.

Accuracy is the share of the label's new tokens that the backend reproduces at the same position (greedy, beam
search with --num-beams, or sampling with the sampling flags: every backend draws with the same seed); runtimes
are the --percentile (default: the median) of the full generation and the median of one decode step, each over
a sample's timed runs, then the median over samples. A second table shows what each backend generated for
each sample. An image-to-text family (BLIP) captions the checkpoint's photos,
or the files given with `--image`.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path

from nndf.actions.common import (
    add_image_argument, decoding_flags, decoding_note, describe, encode_prompts, generation_inputs,
    given_images, open_models, say, timing_settings, weights_and_cache,
)
from nndf.actions.runners import runners_for, time_generation
from nndf.checkpoint import DEFAULT_NEW_TOKENS, Sample, read_samples
from nndf.architectures import architecture
from nndf.errors import HarnessError, UsageError
from nndf.images import image_files
from nndf.interrupt import KeepOnInterrupt
from nndf.registry import resolve
from nndf.results import Column, Result

TIMED = True
SAMPLES = True
RUN_UNUSED_FLAGS = {  # nndf.cli.check_unused_flags
    "batch_size": "it generates each of the family's sample prompts on its own (models/<family>/checkpoint.toml); "
                  "benchmark --batch-size times batches",
    "input_seq_len": "its prompts are the family's sample prompts (models/<family>/checkpoint.toml)",
}
UNUSED_FLAGS = RUN_UNUSED_FLAGS
# --output-seq-len's default in --help (nndf.cli): a sample's own, so the parser holds none
OUTPUT_LEN_DEFAULT = f"each sample's label length, or {DEFAULT_NEW_TOKENS} for a sample without a label"


def add_arguments(parser) -> None:
    add_image_argument(parser, "image-to-text families (BLIP): caption these PNG/JPEG files or folders instead of "
                       "the checkpoint's photos (no text prefix, no labels)")
    parser.set_defaults(warmup=1, iterations=3)


def checkpoint_samples(args) -> list[Sample]:
    """The samples to run, checked before any model loads: the given images, or the checkpoint's inputs (whose
    images must exist); the timing flags too. Their lengths are checked once the model's config and tokenizer are
    at hand (`sample_length_check`)."""
    timing_settings(args)  # --iterations 0, --percentile 101: refused here, not after the load and an export
    spec, variant = resolve(args.model, args.variant)
    given = given_images(args, spec)
    if given is not None:
        return [Sample("", None, path) for path in given]
    samples = read_samples(spec, variant)
    for sample in samples:
        if sample.image is not None and not sample.image.exists():
            raise UsageError(f"the {spec.family} checkpoint's image {sample.image} does not exist (../shared/data "
                             "is not beside this checkout?); give images with --image PATH...")
        if sample.image is not None:
            image_files([sample.image], flag="checkpoint image")
    return samples


def _describe_sample(sample: Sample) -> str:
    if sample.image is None:
        return sample.prompt
    return f"{sample.image.name}" + (f" + '{sample.prompt}'" if sample.prompt else "")


def _shown(sample: Sample) -> str:
    return textwrap.shorten(_describe_sample(sample), 48, placeholder=" ...")  # whole words


def _label_and_new_tokens(args, arch, tokenizer, sample: Sample, ids) -> tuple[list[int] | None, int]:
    """A sample's label tokens (cut to --output-seq-len: scored over the tokens asked for) and how many new tokens
    it is generated for: --output-seq-len when given, past a shorter label too (the table's note and --help say the
    flag sets the new tokens; a label is scored over its own tokens, the rest shows what the model goes on with),
    else the label's length, else DEFAULT_NEW_TOKENS."""
    label = arch.label_ids(tokenizer, ids, sample.label) if sample.label else None
    if args.output_seq_len is not None:
        return (label[:args.output_seq_len] if label else label), args.output_seq_len
    return label, len(label) if label else DEFAULT_NEW_TOKENS


def _sample_error(args, spec, sample: Sample, exc: UsageError) -> UsageError:
    """A refusal of one sample's inputs (a model with fewer positions than the family's samples), naming it."""
    source = "given image" if getattr(args, "image", None) else \
        f"sample of {'/'.join(Path(spec.checkpoint_file).parts[-3:])}"
    return UsageError(f"the {source} '{_shown(sample)}': {exc} (--output-seq-len sets the new tokens)")


def sample_length_check(args, samples: list[Sample]):
    """`open_models`' `check_inputs` for run and compare: each text sample's prompt and new tokens against the
    model's positions, from its config and tokenizer alone, so that this usage error (exit 2) comes before what this
    machine lacks (trt without a GPU, exit 1) and before the weights load or an export runs, as every other flag's
    does (nndf.actions.plans). The tokenizer loaded here is the one the run uses; where none can be had (offline, no
    --tokenizer-dir), `open_models` says so in its own order. An image's (BLIP) text prefix is counted as the
    decoder's prompt (`prompt_length`: the family's start token for none); the image goes to the vision encoder."""
    spec, _ = resolve(args.model, args.variant)
    arch = architecture(spec)

    def check(loaded, shapes) -> None:
        try:
            tokenizer = loaded.tokenizer
        except HarnessError:  # said by open_models, after the machine's checks
            return
        for sample in samples:
            if arch.takes_images:  # the processor's text ids, as `caption_inputs` makes them
                ids = tokenizer([sample.prompt], return_tensors="pt")["input_ids"] if sample.prompt else None
                prompt_len = arch.prompt_length(ids, loaded)
            else:
                ids, _ = encode_prompts(tokenizer, [sample.prompt], args.use_mask, arch.pad_side)
                prompt_len = ids.shape[1]
            _, new_tokens = _label_and_new_tokens(args, arch, tokenizer, sample, ids)
            try:
                arch.check_length(prompt_len, new_tokens, shapes)
            except UsageError as exc:
                raise _sample_error(args, spec, sample, exc) from None

    return check


def checkpoint_rows(args, models, samples: list[Sample], keep: KeepOnInterrupt) -> tuple[list[dict], list[dict]]:
    """One row per runner (token accuracy against the labels, median runtimes over all samples), and one row per
    runner and sample with the generated text; Ctrl-C (`keep`) keeps the runners done before it, whole."""
    runs = keep.each(runners_for(models), "running the samples on", "not run",
                     lambda runner: _runner_rows(args, models[0], runner, samples), name=lambda runner: runner.label)
    return [row for row, _ in runs], [output for _, outputs in runs for output in outputs]


def _runner_rows(args, first, runner, samples: list[Sample]) -> tuple[dict, list[dict]]:
    """Run every sample on `runner`: its row, and each sample's output."""
    outputs = []
    timing = timing_settings(args)
    decoding = decoding_flags(args)
    tokenizer = first.tokenizer
    known = len(tokenizer)  # ids from here on (a vocabulary padded past its tokenizer) decode to no text
    matched = total = 0
    full, step = [], []
    for sample in samples:
        inputs = generation_inputs(first, sample.prompt, sample.image, args.use_mask)
        ids = inputs.get("input_ids")
        label, new_tokens = _label_and_new_tokens(args, first.architecture, tokenizer, sample, ids)
        say(f"{runner.label}: '{_shown(sample)}' + up to {new_tokens} tokens")
        try:
            t = time_generation(runner, inputs, new_tokens, None, args.num_beams, timing, progress=False,
                                decoding=decoding)
        except UsageError as exc:  # a model with fewer positions than the family's samples: say which sample
            raise _sample_error(args, first.spec, sample, exc) from None
        new = first.new_tokens(t.output, ids)[0].tolist()
        if label:
            matched += sum(a == b for a, b in zip(new, label))
            total += len(label)
        full.append(t.latency.percentile(timing.percentile))  # --percentile of each sample's runs
        if t.decode_step_median is not None:
            step.append(t.decode_step_median)
        outputs.append({"backend": runner.label, "input": _describe_sample(sample),
                        "output": tokenizer.decode(new, skip_special_tokens=True).strip(),
                        "textless_ids": sum(i >= known for i in new)})
    return {
        "backend": runner.label,
        "samples": len(samples),
        "accuracy": matched / total if total else None,
        "generation_ms": statistics.median(full) * 1e3,
        "decode_ms": statistics.median(step) * 1e3 if step else None,
    }, outputs


# A labelled sample is scored over its label's tokens, or over the first --output-seq-len of them when given.
LENGTH_NOTE = (f"new tokens: --output-seq-len when given (a longer label is then scored over its first that many "
               f"tokens); else a label's length, or {DEFAULT_NEW_TOKENS} for a sample without one.")


NO_DECODE_STEP = "every generation ended at its first token (EOS at once): no step to time"


def sample_notes(args, rows: list[dict]) -> list[str]:
    """What `run`'s and `compare`'s columns mean: label accuracy (and why a row has none), the new tokens, and a
    decode step that could not be timed."""
    missing = ("'-': the given images carry no labels." if getattr(args, "image", None)
               else "'-' where checkpoint.toml has no labels for this variant.")
    notes = ["label accuracy: share of the label's new tokens reproduced at the same position; labels are the "
             "variant's real weights' outputs, so random weights, or other weights (--torch-dir), score near 0; "
             + missing, LENGTH_NOTE]
    if any(row["decode_ms"] is None for row in rows):
        notes.append(f"decode step: '-' where {NO_DECODE_STEP}.")
    return notes


def checkpoint_columns(args) -> list[Column]:
    """The table's columns; the full generation is the --percentile of each sample's runs (p50: the median)."""
    pct = timing_settings(args).percentile
    full = "full generation" if pct == 50 else f"p{pct:g} full generation"
    return [
        Column("backend", "backend"),
        Column("samples", "samples"),
        Column("accuracy", "label accuracy", "{:.1%}"),
        Column("generation_ms", full, "{:.1f}", "ms"),
        Column("decode_ms", "decode step", "{:.2f}", "ms"),
    ]


def outputs_notes(outputs: list[dict], tokenizer) -> list[str]:
    """What the outputs column shows, and, when some generated ids lie past the tokenizer's last entry (a model
    whose vocabulary is padded past its tokenizer, as Qwen2.5's and Phi-3's are, given random weights), how many:
    those ids have no text, so an output can be empty or short without a special token in it."""
    notes = ["output: the generated tokens after the prompt (a caption after its text prefix), decoded without "
             "special tokens: empty where the model made only special tokens (EOS at once, or pad tokens, as random "
             "weights often do); inputs cut to 60 characters here and outputs to 80, whole in --json."]
    textless = sum(row["textless_ids"] for row in outputs)
    if textless:
        hit = sum(row["textless_ids"] > 0 for row in outputs)
        notes.append(f"{textless} generated token(s) in {hit} of {len(outputs)} outputs have ids at or past "
                     f"{len(tokenizer)}, the tokenizer's size (the model's vocabulary is larger): they have no text "
                     "(textless_ids in --json).")
    return notes


def outputs_result(first, outputs: list[dict]) -> Result:
    """The second table of `run` and `compare`: what each backend generated for each sample."""
    columns = [Column("backend", "backend"), Column("input", "input", width=60), Column("output", "output", width=80)]
    return Result("outputs", f"outputs {first.spec.family} {first.loaded.name}", columns, outputs, describe(first),
                  outputs_notes(outputs, first.tokenizer))


def run(args) -> list[Result]:
    samples = checkpoint_samples(args)
    models = open_models(args, needs_text=True, check_inputs=sample_length_check(args, samples))
    first = models[0]
    picked = decoding_note(first, decoding_flags(args), args.num_beams)  # refuses beams with sampling up front
    keep = KeepOnInterrupt()
    rows, outputs = checkpoint_rows(args, models, samples, keep)
    notes = sample_notes(args, rows) + keep.notes()
    source = "the given images" if getattr(args, "image", None) else "checkpoint samples"
    title = f"run {first.spec.family} {first.loaded.name}: {source}, {picked}, {weights_and_cache(args)}"
    return keep.finish([Result("run", title, checkpoint_columns(args), rows, describe(*models), notes),
                        outputs_result(first, outputs)])
