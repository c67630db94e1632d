#!/usr/bin/env python
"""Sampling's cost per decode step and how soon streamed text shows, side by side in one process on the CPU.

    HF_HUB_OFFLINE=1 python bench/sampling_cpu.py                    # GPT-2 small, random weights, b1 and b4
    HF_HUB_OFFLINE=1 python bench/sampling_cpu.py --engines onnxrt --rounds 9 --json out.json

Engines: `frameworks` and `onnxrt` are our loop on PyTorch and ONNX Runtime; `hf` is Hugging Face `generate()` on
the same PyTorch model, for comparison (its own sampling costs what it costs). Every round runs, per engine and
batch size, the same seeded random prompt (`--input-len` tokens, exactly `--output-len` new ones, EOS suppressed)
greedily, then sampled as `generate(do_sample=True)` samples by default (temperature 1, top-k 50), then sampled with
`--top-p 0.9` as well (its warper sorts the whole vocabulary), then by default again on our own random stream
(`--sampling-stream fast`, our engines only), in an order that turns from round to round.

- overhead: per round, a mode's decode ms/step (the median step of that run) over greedy's from the same round,
  minus 1; the report shows the median over rounds. Goal: default sampling within 3% of greedy.
- where it goes, onnxrt: each step split into its ONNX Runtime run and the rest (the host's processors, warpers
  and draw, and the loop), as bench/onnxrt_io.py splits it: sampling with top-k asks the screened LM head for more
  exact scores (inside the run), the draw and the warpers cost on the host (outside it).
- streamed first text, batch 1, our engines: a text prompt through `ReplyStreamer` (what `chat` prints with),
  from before tokenizing the prompt to the first text written, over the first-token time of a plain run of the same
  prompt in the same round (what `benchmark` reports as "first token"; made before the streamed run in odd rounds,
  after it in even ones). Goal: within 1.2x. Also shown: over the streamed run's own first-token time (the cost of
  tokenizing, decoding and writing alone).

The report ends with how many cores other processes used meanwhile (from /proc): on this 2-core machine a busy
foreign process moves every figure, so compare rounds and trust a quiet run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import nndf  # noqa: E402
from harness.render import format_table  # noqa: E402
from harness.stats import CpuWatch, machine_cpu  # noqa: E402
from nndf.actions.common import random_input_ids  # noqa: E402
from nndf.measure import StepTimer  # noqa: E402
from nndf.streaming import ReplyStreamer  # noqa: E402
from harness.cli import parse_checked, positive, run_script  # noqa: E402
from harness.worker import CallTimer  # noqa: E402

MODES = {"greedy": {}, "sample": dict(do_sample=True), "sample top-p 0.9": dict(do_sample=True, top_p=0.9),
         "sample, fast stream": dict(do_sample=True, sampling_stream="fast")}
GOAL_OVERHEAD = 0.03  # default sampling, per decode step, against greedy
GOAL_FIRST_TEXT = 1.2  # streamed first text against the first-token time
PROMPT = ("The harbour was quiet that morning, and the fishermen who usually crowded the quay had not yet come down "
          "from the village. A single boat rocked against the stones, its sail furled, its deck still wet from the "
          "night's rain. Nobody could remember who had left it there, or why.")
DEFAULT_TOKENIZER = BENCH.parent.parent / "shared" / "data" / "gpt2-tokenizer"


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="GPT2")
    p.add_argument("--variant", default="gpt2")
    p.add_argument("--torch-dir", help="a local Hugging Face folder (default: random weights of --variant)")
    p.add_argument("--tokenizer-dir", default=str(DEFAULT_TOKENIZER) if DEFAULT_TOKENIZER.is_dir() else None,
                   help="for the streamed text (default: ../shared/data/gpt2-tokenizer when present)")
    p.add_argument("--engines", nargs="+", default=["frameworks", "onnxrt", "hf"],
                   choices=["frameworks", "onnxrt", "hf"])
    p.add_argument("--batch-sizes", nargs="+", type=positive, default=[1, 4])
    p.add_argument("--input-len", type=positive, default=64)
    p.add_argument("--output-len", type=positive, default=64)
    p.add_argument("--rounds", type=positive, default=5)
    p.add_argument("--threads", type=positive, help="intra-op threads (default: each runtime's own)")
    p.add_argument("--working-dir", default="temp")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    return parse_checked(p, argv)


def load(args) -> dict:
    common = dict(torch_dir=args.torch_dir, random_weights=args.torch_dir is None, tokenizer_dir=args.tokenizer_dir,
                  working_dir=args.working_dir, threads=args.threads, device="cpu")
    frameworks = nndf.load(args.family, args.variant, backend="frameworks", **common)
    models = {"frameworks": frameworks, "hf": frameworks}
    if "onnxrt" in args.engines:
        models["onnxrt"] = nndf.load(args.family, args.variant, backend="onnxrt", loaded=frameworks.loaded,
                                     working_dir=args.working_dir, threads=args.threads)
    return {name: models[name] for name in args.engines}


def timed_run(engine: str, model, ids, new_tokens: int, mode: dict, runtime: CallTimer | None = None
              ) -> tuple[float, float, float | None]:
    """(decode ms/step median, first token ms, and where `runtime` times the model's ONNX Runtime runs the median
    ms of a decode step's run, else None) of one generation of exactly `new_tokens` tokens."""
    generate = model.hf_generate if engine == "hf" else model.generate
    timer = StepTimer()
    if runtime is not None:
        runtime.reset()
    timer.start()
    generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, on_token=timer.mark,
             **(dict(mode, seed=0) if mode else {}))
    calls = runtime.calls[1:] if runtime is not None else []  # calls[0]: the prompt's
    inside = statistics.median(calls) * 1e3 if calls else None
    return timer.decode_step_median * 1e3, timer.time_to_first_token * 1e3, inside


def streamed_first_text(model, new_tokens: int, plain_first: bool) -> tuple[float, float, float]:
    """(ms to the first text a streamed reply writes, counted from before tokenizing the prompt; ms to that run's
    first token; ms to the first token of a plain run of the same prompt, made before or after it)."""
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids

    def plain() -> float:
        timer = StepTimer()
        timer.start()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, on_token=timer.mark)
        return timer.time_to_first_token * 1e3

    first = plain() if plain_first else None
    with open(os.devnull, "w", encoding="utf-8") as terminal:  # written and flushed as chat writes to stdout
        timer = StepTimer()
        started = time.perf_counter()
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        streamer = ReplyStreamer(model.tokenizer, lambda text: (terminal.write(text), terminal.flush()))
        timer.start()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer,
                       on_token=timer.mark)
    shown = (streamer.first_text_at - started) * 1e3
    return shown, timer.time_to_first_token * 1e3, first if plain_first else plain()


def runs(engine: str, mode: str) -> bool:
    """Whether the engine runs the mode: generate() (hf) draws its own stream only."""
    return engine != "hf" or "sampling_stream" not in MODES[mode]


def measure(args, models: dict) -> dict:
    prompts = {b: random_input_ids(b, args.input_len, next(iter(models.values())).shapes.vocab_size, 0)
               for b in args.batch_sizes}
    cases = [(engine, b, mode) for engine in models for b in args.batch_sizes for mode in MODES
             if runs(engine, mode)]
    steps = {case: [] for case in cases}
    inside: dict[tuple, list[float]] = {case: [] for case in cases if case[0] == "onnxrt"}
    runtime = None
    if "onnxrt" in models:  # its steps split into ONNX Runtime's run and the rest, as bench/onnxrt_io.py splits them
        runtime = CallTimer()
        runtime.wrap(models["onnxrt"].decoder.session.session, "run_with_iobinding")
    firsts: dict[str, list[tuple[float, float, float]]] = {e: [] for e in models if e != "hf" and args.tokenizer_dir}
    watch = CpuWatch()
    for round_ in range(args.rounds + 1):  # round 0 warms every path up
        if round_ == 1:
            watch.start([os.getpid()])
        turn = round_ % len(MODES)
        order = [(engine, b, mode) for engine in models for b in args.batch_sizes
                 for mode in list(MODES)[turn:] + list(MODES)[:turn] if runs(engine, mode)]
        for engine, b, mode in order:
            step, _, in_runtime = timed_run(engine, models[engine], prompts[b], args.output_len, MODES[mode],
                                            runtime if engine == "onnxrt" else None)
            if round_:
                steps[(engine, b, mode)].append(step)
                if in_runtime is not None:
                    inside[(engine, b, mode)].append(in_runtime)
        for engine in firsts:
            shown = streamed_first_text(models[engine], args.output_len, plain_first=bool(round_ % 2))
            if round_:
                firsts[engine].append(shown)
        print(f"round {round_}/{args.rounds} done", file=sys.stderr, flush=True)
    return {"steps": steps, "inside": inside, "firsts": firsts, "foreign_cores": watch.foreign_cores()}


def report(args, figures: dict) -> tuple[str, dict]:
    steps, inside, lines, goals = figures["steps"], figures.get("inside", {}), [], []
    rows, raw = [], {"steps": {}, "inside_runtime": {}, "first_text": {}}
    for engine, b, mode in steps:
        case = (engine, b, mode)
        greedy = steps[(engine, b, "greedy")]
        ratios = [s / g - 1 for s, g in zip(steps[case], greedy)]
        overhead = statistics.median(ratios)
        split = ["-", "-"]
        if inside.get(case):  # the step's ONNX Runtime run, and the rest: the host's share
            split = [f"{statistics.median(inside[case]):.2f}",
                     f"{statistics.median(s - i for s, i in zip(steps[case], inside[case])):.2f}"]
            raw["inside_runtime"][f"{engine} b{b} {mode}"] = inside[case]
        rows.append([engine, str(b), mode, f"{statistics.median(steps[case]):.2f}", *split,
                     "-" if mode == "greedy" else f"{overhead:+.1%}",
                     "-" if mode == "greedy" else f"{min(ratios):+.1%} .. {max(ratios):+.1%}"])
        raw["steps"][f"{engine} b{b} {mode}"] = steps[case]
        if mode in ("sample", "sample, fast stream") and engine != "hf":
            what = "default sampling" + (", fast stream," if mode != "sample" else "")
            goals.append((f"{engine} b{b}: {what} overhead {overhead:+.1%} per decode step",
                          overhead <= GOAL_OVERHEAD, f"<= {GOAL_OVERHEAD:.0%}"))
    lines.append(format_table(["engine", "batch", "mode", "decode ms/step", "in the runtime", "outside", "overhead",
                               "rounds"], rows))
    if inside:
        lines.append("in the runtime: the median of a decode step's ONNX Runtime run; outside: the step less that "
                     "(the host's processors, warpers and draw, and the loop), medians over rounds")
    if figures["firsts"]:
        lines.append("")
        rows = []
        for engine, runs in figures["firsts"].items():
            ratio = statistics.median(shown / plain for shown, _, plain in runs)
            same_run = statistics.median(shown / first for shown, first, _ in runs)
            rows.append([engine, f"{statistics.median(r[2] for r in runs):.1f}",
                         f"{statistics.median(r[0] for r in runs):.1f}", f"{ratio:.3f}x", f"{same_run:.3f}x"])
            raw["first_text"][engine] = runs
            goals.append((f"{engine} b1: streamed first text {ratio:.3f}x the first-token time",
                          ratio <= GOAL_FIRST_TEXT, f"<= {GOAL_FIRST_TEXT}x"))
        lines.append(format_table(["engine", "first token ms (plain run)", "first text shown ms", "ratio",
                                   "ratio to its own first token"], rows))
    lines.append("")
    foreign, cpu = figures["foreign_cores"], machine_cpu()
    if cpu:
        lines.append(f"cpu: {cpu}")
    if foreign is not None:
        lines.append(f"other processes used {foreign:.2f} of {os.cpu_count()} cores on average while we measured")
    lines += [f"GOAL {'PASS' if ok else 'FAIL'}: {text} (goal {goal})" for text, ok, goal in goals]
    raw["foreign_cores"] = foreign
    return "\n".join(lines), raw


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = load(args)
    figures = measure(args, models)
    text, raw = report(args, figures)
    print(f"{args.family} {args.variant} ({'random weights' if args.torch_dir is None else args.torch_dir}), "
          f"{args.input_len} + {args.output_len} tokens, {args.rounds} rounds, torch {torch.__version__}, "
          f"{torch.get_num_threads()} PyTorch threads")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(vars(args), **raw), indent=1))


if __name__ == "__main__":
    sys.exit(run_script("sampling_cpu.py", main))
