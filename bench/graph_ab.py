#!/usr/bin/env python
"""Decode speed of several decoder graphs of one model, side by side in our loop (one process, alternating rounds).

    HF_HUB_OFFLINE=1 python bench/graph_ab.py --family Llama --torch-dir DIR OLD/decoder.onnx NEW/decoder.onnx

For a change to the exported graph (a fusion, an exporter revision): every graph runs through `nndf.load(...,
decoder_onnx=GRAPH)` on the same weights and prompt, greedy, each round timing a 2-token and a (2 + steps)-token
generation per graph in turn, so the difference over `--steps` decode steps is the step's time without the prompt.
Prints each graph's median ms/step over the rounds, with every round's figure, and the ratio to the first graph.
"""

from __future__ import annotations

import sys
import argparse
import statistics
import time

import torch

import nndf
from harness.cli import parse_checked, positive, run_script  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", help="decoder graphs (.onnx) exported for the same model")
    parser.add_argument("--family", required=True, help="the model's family, e.g. GPT2 or Llama")
    parser.add_argument("--torch-dir", required=True, help="the model's Hugging Face folder (weights, config)")
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--steps", type=positive, default=32, help="decode steps timed per generation")
    parser.add_argument("--prompt-len", type=positive, default=64)
    parser.add_argument("--batch", type=positive, default=1, help="prompts per generation")
    parser.add_argument("--working-dir", default="temp")
    args = parse_checked(parser, None)
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
    first = statistics.median(timed[args.graphs[0]])
    for graph in args.graphs:
        median = statistics.median(timed[graph])
        print(f"{median:8.2f} ms/step  {median / first:5.2f}x  {[round(t, 2) for t in timed[graph]]}  {graph}")


if __name__ == "__main__":
    sys.exit(run_script("graph_ab.py", main))
