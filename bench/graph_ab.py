#!/usr/bin/env python
"""Decode speed of several decoder graphs of one model, side by side in our loop (alternating rounds).

    HF_HUB_OFFLINE=1 python bench/graph_ab.py --family Llama --torch-dir DIR OLD/decoder.onnx NEW/decoder.onnx
    HF_HUB_OFFLINE=1 python bench/graph_ab.py --family GPT2 --torch-dir DIR --processes 4 --batch 4 OLD NEW

For a change to the exported graph (a fusion, an exporter revision): every graph runs through `nndf.load(...,
decoder_onnx=GRAPH)` on the same weights and prompt, greedy, each round timing a 2-token and a (2 + steps)-token
generation per graph in turn, so the difference over `--steps` decode steps is the step's time without the prompt.
Prints each graph's median ms/step over the rounds, with every round's figure, its ratio to the first graph's
median, and the paired ratio: the median over rounds of its figure over the first graph's in the same round (the
machine's drift cancels within a round).

`--processes N` runs N processes one after another, the graphs loaded in a turned order in each, and pools their
rounds. Why: in one process two sessions can differ by 5-10% whatever their graphs (measured 2026-11-29 on the
Xeon: the same pair of graphs 1.11x in one process and 0.93-1.05x in four others), so a difference smaller than
that shows only across processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # its harness package, also where the script is loaded as a module (the tests)
    sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

import nndf  # noqa: E402
from harness.cli import parse_checked, positive, run_script  # noqa: E402

RESULT = "graph_ab result: "  # the line a child process reports its rounds on


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", help="decoder graphs (.onnx) exported for the same model")
    parser.add_argument("--family", required=True, help="the model's family, e.g. GPT2 or Llama")
    parser.add_argument("--torch-dir", required=True, help="the model's Hugging Face folder (weights, config)")
    parser.add_argument("--rounds", type=positive, default=5, help="rounds per process")
    parser.add_argument("--steps", type=positive, default=32, help="decode steps timed per generation")
    parser.add_argument("--prompt-len", type=positive, default=64)
    parser.add_argument("--batch", type=positive, default=1, help="prompts per generation")
    parser.add_argument("--processes", type=positive, default=1,
                        help="processes run one after another, each loading the graphs in a turned order")
    parser.add_argument("--working-dir", default="temp")
    parser.add_argument("--report", action="store_true", help=argparse.SUPPRESS)  # a child: one result line
    args = parse_checked(parser, argv)
    if len(set(args.graphs)) != len(args.graphs):
        parser.error("each graph may be given once (to time a graph against itself, give a copy of it)")
    return args


def measure(args) -> dict[str, list[float]]:
    """{graph: decode ms/step of each round}, the graphs loaded and timed in the order given."""
    models, loaded = {}, None
    for graph in args.graphs:
        models[graph] = nndf.load(args.family, backend="onnxrt", torch_dir=args.torch_dir, decoder_onnx=graph,
                                  working_dir=args.working_dir, device="cpu", loaded=loaded)
        loaded = models[graph].loaded
    ids = torch.randint(0, 1000, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    timed = {graph: [] for graph in args.graphs}

    def seconds(model, new: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new)
        return time.perf_counter() - start

    for model in models.values():  # warm-up
        seconds(model, 8)
    for _ in range(args.rounds):
        for graph, model in models.items():
            timed[graph].append((seconds(model, 2 + args.steps) - seconds(model, 2)) / args.steps * 1e3)
    return timed


def in_processes(args) -> list[dict[str, list[float]]]:
    """Each child's rounds; child i loads the graphs turned by i places."""
    results = []
    for index in range(args.processes):
        turn = index % len(args.graphs)
        order = args.graphs[turn:] + args.graphs[:turn]
        command = [sys.executable, __file__, *order, "--family", args.family, "--torch-dir", args.torch_dir,
                   "--rounds", str(args.rounds), "--steps", str(args.steps), "--prompt-len", str(args.prompt_len),
                   "--batch", str(args.batch), "--working-dir", args.working_dir, "--report"]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
        if done.returncode != 0 or not lines:
            sys.stderr.write(done.stderr)
            raise SystemExit(f"graph_ab.py: process {index + 1} of {args.processes} failed (exit {done.returncode})")
        results.append(json.loads(lines[-1][len(RESULT):]))
        print(f"process {index + 1}: " + ", ".join(f"{statistics.median(results[-1][g]):.2f}" for g in args.graphs)
              + " ms/step (graphs in the order given)", flush=True)
    return results


def report(graphs: list[str], results: list[dict[str, list[float]]]) -> None:
    pooled = {graph: [t for result in results for t in result[graph]] for graph in graphs}
    first = pooled[graphs[0]]
    for graph in graphs:
        median = statistics.median(pooled[graph])
        paired = [t / reference for t, reference in zip(pooled[graph], first)]
        faster = sum(ratio < 1 for ratio in paired)
        print(f"{median:8.2f} ms/step  {median / statistics.median(first):5.2f}x  paired "
              f"{statistics.median(paired):5.3f}x (faster in {faster} of {len(paired)} rounds)  {graph}")
        if len(results) == 1:
            print(f"          rounds: {[round(t, 2) for t in pooled[graph]]}")


def main() -> None:
    args = parse_args()
    if args.report:
        print(RESULT + json.dumps(measure(args)))
        return
    results = in_processes(args) if args.processes > 1 else [measure(args)]
    report(args.graphs, results)


if __name__ == "__main__":
    sys.exit(run_script("graph_ab.py", main))
