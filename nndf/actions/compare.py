"""`compare`: the checkpoint samples on every backend given, in one table with speed relative to the first."""

from __future__ import annotations

from nndf.actions.common import (add_image_argument, compared_backends, decoding_flags, decoding_note, describe,
                                 open_models, weights_and_cache)
from nndf.actions.run import (
    NO_DECODE_STEP, OUTPUT_LEN_DEFAULT as RUN_OUTPUT_LEN, RUN_UNUSED_FLAGS, checkpoint_columns, checkpoint_rows,
    checkpoint_samples, outputs_result, sample_length_check, sample_notes,
)
from nndf.interrupt import KeepOnInterrupt
from nndf.plots import Panel, check_plotting, plot_bars
from nndf.results import Column, Result

TIMED = True
SAMPLES = True
COMPARES = True  # backends as positionals and/or --compare (nndf.cli)
UNUSED_FLAGS = RUN_UNUSED_FLAGS  # the samples are run's, so are the flags they have no use for
OUTPUT_LEN_DEFAULT = RUN_OUTPUT_LEN  # and the new tokens of each


def add_arguments(parser) -> None:
    add_image_argument(parser, "image-to-text families (BLIP): caption these PNG/JPEG files or folders instead of "
                       "the checkpoint's photos")
    parser.output_group.add_argument("--plot", metavar="FILE.png", help="also draw full generation and decode ms/step "
                                     "per backend into this PNG (needs the plot extra: matplotlib)")
    parser.set_defaults(warmup=1, iterations=3)


def run(args) -> list[Result]:
    compared_backends(args)
    check_plotting(args.plot)
    samples = checkpoint_samples(args)
    models = open_models(args, needs_text=True, check_inputs=sample_length_check(args, samples))
    first = models[0]
    picked = decoding_note(first, decoding_flags(args), args.num_beams)  # refuses beams with sampling up front
    keep = KeepOnInterrupt()
    rows, outputs = checkpoint_rows(args, models, samples, keep)
    base = rows[0]["generation_ms"]
    for row in rows:
        row["speedup"] = base / row["generation_ms"]
    columns = checkpoint_columns(args) + [Column("speedup", f"speed vs {rows[0]['backend']}", "{:.2f}", "x")]
    title = (f"compare {first.spec.family} {first.loaded.name}: {', '.join(r['backend'] for r in rows)}; "
             f"{picked}, {weights_and_cache(args)}")
    notes = ["speed: full-generation time of the first row divided by each row's (higher is faster).",
             *sample_notes(args, rows), *keep.notes()]
    if args.plot:
        plot_bars(args.plot, title, rows, [Panel("generation_ms", "full generation (ms)"),
                                           Panel("decode_ms", "decode step (ms)", missing=NO_DECODE_STEP)])
        notes.append(f"plot written to {args.plot}")
    return keep.finish([Result("compare", title, columns, rows, describe(*models), notes),
                        outputs_result(first, outputs)])
