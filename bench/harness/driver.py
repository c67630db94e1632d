"""A whole benchmark run: flags, the weights, one worker per engine, a warm-up, interleaved timed rounds, memory,
and the report (printed with ratios last, optionally written as JSON)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

from harness.engines import EngineError, Worker, close_all, elapsed, prepare_weights, say, start_engine
from harness.inputs import describe, make_inputs
from harness.cli import check_outputs, positive, run_script, seconds
from harness.render import render_report
from harness.stats import CpuWatch, compute_ratios, evaluate_goals, machine_cpu, peer_ratios, summarize
from harness.worker import versions, worker_main


def build_parser(bench) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{bench.name}.py", description=bench.description,
        epilog="engines: " + "; ".join(f"{k}: {v}" for k, v in bench.engine_help.items()),
    )
    p.add_argument("--family", default=bench.default_family,
                   help=f"registered model family (default {bench.default_family})")
    p.add_argument("--variant", default=None,
                   help=f"variant of the family (default {bench.default_variant}{bench.family_defaults('variant')})")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--random-weights", action="store_true",
                        help="the variant's known config with seeded random weights (the default)")
    source.add_argument("--torch-dir", help="a local Hugging Face model folder to load instead")
    source.add_argument("--hub", action="store_true", help="the variant's hub weights (needs the hub or its cache)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and of the inputs (default 0)")
    p.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 4], metavar="N")
    images = ", ".join(n for n, f in bench.families.items() if f.inputs == "pixels")
    unused = f"; {images}: seeded random pixels of the model's image size instead" if images else ""
    p.add_argument("--input-len", type=positive, default=64, help=f"{bench.input_word} tokens (default 64{unused})")
    p.add_argument("--output-len", type=positive, default=None, help="new tokens, no early stop (default "
                   f"{bench.default_output_len}{bench.family_defaults('output_len')})")
    p.add_argument("--rounds", type=positive, default=5, help="timed rounds after the warm-up (default 5)")
    p.add_argument("--engines", nargs="+", default=None, metavar="ENGINE",
                   help=f"engines to compare, from {', '.join(bench.engines)} "
                        f"(default: {' '.join(bench.default_engines)}{bench.family_defaults('engines')})")
    p.add_argument("--threads", type=positive, default=None,
                   help="intra-op threads of every engine (default: each runtime's own, one per core)")
    p.add_argument("--settle", type=seconds, default=0.5, metavar="SECONDS",
                   help="pause before each run (default 0.5), so that no engine runs while the last one's threads "
                        "still spin: ONNX Runtime's keep spinning about 100 ms after a run by default")
    p.add_argument("--working-dir", default="temp", help="weights, exports, the Optimum venv and logs (default temp)")
    p.add_argument("--json", metavar="FILE", help="also write every figure, raw runs included, as JSON")
    # Worker mode: this same file, started by the main process; not for people.
    p.add_argument("--worker", choices=bench.engines, help=argparse.SUPPRESS)
    p.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--weights-dir", help=argparse.SUPPRESS)
    p.add_argument("--onnx-dir", help=argparse.SUPPRESS)
    p.add_argument("--peer-tool", help=argparse.SUPPRESS)  # a peer's binary (llama.cpp's llama-batched-bench)
    p.add_argument("--peer-model", help=argparse.SUPPRESS)  # a peer's model (a GGUF file, a GenAI build folder)
    return p


def parse_args(bench, argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser(bench)
    args = parser.parse_args(argv)
    own = bench.for_family(args.family)  # the family's defaults where the flags are not given
    args.variant = args.variant or own.default_variant
    args.output_len = args.output_len or own.default_output_len
    args.engines = args.engines or list(own.default_engines)
    if args.worker:
        return args
    unknown = [e for e in args.engines if e not in bench.engines]
    if unknown:
        parser.error(f"argument --engines: unknown engine(s) {', '.join(unknown)}; allowed: {', '.join(bench.engines)}")
    refused = [e for e in args.engines if e in (own.family.refused or ())]
    if refused:
        parser.error(f"argument --engines: {', '.join(refused)} cannot run {args.family}: {own.family.note}")
    args.engines = list(dict.fromkeys(args.engines))
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    if args.torch_dir is None and not args.hub:
        args.random_weights = True
    check_outputs(args)
    return args


def _generation_rules(weights: Path, keys: tuple[str, ...]) -> dict:
    """The generation config entries `keys` of the weights folder (what every engine's generate() applies)."""
    if not keys:
        return {}
    try:
        config = json.loads((weights / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in keys if config.get(k) is not None}


def _rounds(args, workers: dict, generate, warm: dict, runs: dict) -> None:
    """One warm-up per engine and batch size, then each round each batch size on each engine in turn (the
    starting engine rotates each round)."""
    for b in args.batch_sizes:
        for engine in [e for e in args.engines if e in workers]:
            result = generate(engine, b, "warm-up")
            if result is not None:
                warm[b][engine] = result
                runs[b][engine] = []
    for r in range(args.rounds):
        for b in args.batch_sizes:
            live = [e for e in args.engines if e in workers]
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for engine in order:
                result = generate(engine, b, f"round {r + 1}/{args.rounds}")
                if result is not None:
                    runs[b][engine].append(result)


def run_benchmark(args, bench) -> dict:
    working_dir = Path(args.working_dir).resolve()
    logs = working_dir / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    weights, weights_what = prepare_weights(args, working_dir)
    config = json.loads((weights / "config.json").read_text())
    problem = bench.check_lengths(config, args)
    if problem:
        from nndf.errors import UsageError

        raise UsageError(problem)
    env_info = {"main": versions(["torch", "transformers", "onnxruntime", "nndf"])}
    engines: dict[str, dict] = {e: {"status": "pending", "reason": None, "description": bench.engine_help[e]}
                                for e in args.engines}
    workers: dict[str, Worker] = {}

    def fail(engine: str, reason: str) -> None:
        say(f"{engine}: FAILED: {reason}")
        engines[engine].update(status="failed", reason=reason)
        worker = workers.pop(engine, None)
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.close()

    kind = bench.family.inputs
    inputs = {b: make_inputs(kind, config, args, b, working_dir / "bench-inputs") for b in args.batch_sizes}
    warm: dict[int, dict] = {b: {} for b in args.batch_sizes}
    runs: dict[int, dict] = {b: {} for b in args.batch_sizes}

    def generate(engine: str, b: int, what: str) -> dict | None:
        time.sleep(args.settle)
        try:
            command = {"cmd": "generate", **inputs[b], "new_tokens": args.output_len}
            result = workers[engine].request(command)
        except (EngineError, ValueError) as exc:
            fail(engine, f"{what} at batch {b}: {exc}")
            return None
        if result["marks"] != args.output_len:
            say(f"{engine}: warning: {result['marks']} token marks for {args.output_len} new tokens")
        step = result["step_median_s"]
        say(f"{what} batch {b} {engine}: {result['e2e_s']:.2f} s, "
            f"{'-' if step is None else f'{step * 1e3:.1f}'} ms/step")
        return result

    watch = CpuWatch()
    foreign = None
    try:
        for engine in args.engines:
            try:
                workers[engine] = start_engine(bench, engine, args, weights, working_dir, logs, env_info)
                engines[engine].update(status="ok", load_s=workers[engine].ready["load_s"],
                                       pid=workers[engine].ready["pid"], versions=workers[engine].ready["versions"])
            except EngineError as exc:
                fail(engine, str(exc))
        watch.start([os.getpid()] + [w.proc.pid for w in workers.values()])
        _rounds(args, workers, generate, warm, runs)
        foreign = watch.foreign_cores()
        for engine in list(workers):
            try:
                memory = workers[engine].request({"cmd": "memory"})
                engines[engine].update({k: v for k, v in memory.items() if k.endswith("_bytes")})
            except EngineError as exc:
                fail(engine, f"memory query: {exc}")
    finally:
        close_all(list(workers.values()))
    # An engine that failed mid-run keeps the figures it had, but not partial rounds' worth of comparisons.
    for b in args.batch_sizes:
        for engine in list(runs[b]):
            if engines[engine]["status"] != "ok":
                del runs[b][engine]
    report = {
        "settings": {
            # a local folder is named after itself, as run.py names it (the variant only gave it a known config)
            "family": args.family, "variant": Path(args.torch_dir).name if getattr(args, "torch_dir", None)
            else args.variant, "weights": weights_what, "weights_dir": str(weights),
            "inputs": describe(kind, config, args, bench.input_word),
            "input_len": args.input_len if kind == "tokens" else None, "output_len": args.output_len,
            "rounds": args.rounds, "settle_s": args.settle,
            "batch_sizes": args.batch_sizes, "engines": args.engines, "threads": args.threads, "seed": args.seed,
            "working_dir": str(working_dir),
        },
        "machine": {"cores": os.cpu_count(), "foreign_cores": foreign, "cpu": machine_cpu()},
        "environment": env_info,
        "engines": engines,
        "batches": summarize(runs, warm, args),
        "raw": {"warm_up": warm, "rounds": runs},
    }
    rules = _generation_rules(weights, bench.generation_keys)
    if bench.family.generation is not None:
        rules.update(bench.family.generation(config))
    if rules:
        report["settings"]["generation"] = rules
    report["ratios"] = compute_ratios(report, bench)
    report["peer_ratios"] = peer_ratios(report, bench)
    report["goals"] = evaluate_goals(report, bench)
    report["elapsed_s"] = elapsed()
    return report


def write_json(path: str, report: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def main(bench, argv: list[str] | None = None) -> int:
    """The script's entry point: a worker when started with --worker, else the whole run with the report; nndf's
    usage and runtime errors are one line (`harness.cli.run_script`)."""
    return run_script(f"{bench.name}.py", lambda: _main(bench, argv))


def _main(bench, argv: list[str] | None) -> int:
    args = parse_args(bench, argv)
    bench = bench.for_family(args.family)
    if args.worker:
        return worker_main(args, bench.make_runner)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run_benchmark(args, bench)
    print(render_report(report, bench), flush=True)
    if args.json:
        write_json(args.json, report)
        say(f"wrote {args.json}")
    say(f"done in {report['elapsed_s']:.0f} s")
    return 0
