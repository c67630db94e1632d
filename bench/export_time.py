"""ONNX export time, side by side in one process: the exporter's ATen -> ONNX table built once per process
(nndf.export.torchlib_registry) against torch's way, built again for every graph.

    python bench/export_time.py [--family GPT2] [--rounds 3] [--threads 1]

Builds a tiny random model of the family's test example (tests/family_examples.py: one or two layers, seconds to
export), then exports its decoder graph in alternating rounds, each into a fresh working dir so nothing is reused:
`cached` (the table from the process's first build) and `torch` (the table built inside every export, as
`torch.onnx.export` does by itself). The first export of the process runs before the rounds (a warm-up that pays
the exporter's imports and the cache's one build). Prints each round, the medians, and the ratio cached / torch
last. The graphs are the same either way (the table is the same table); the script checks that their ONNX
protos are equal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

import nndf  # noqa: E402
import nndf.export.onnx as onnx_export  # noqa: E402
from harness.cli import parse_checked, positive, run_script  # noqa: E402


def _export(family: str, folder: Path, work: Path, cached: bool) -> tuple[float, bytes]:
    """Seconds for one export of the decoder graph with cache, and the graph's bytes."""
    original = onnx_export.torchlib_registry_built_once
    if not cached:
        onnx_export.torchlib_registry_built_once = contextlib.nullcontext
    try:
        started = time.perf_counter()
        nndf.load(family, backend="onnxrt", torch_dir=str(folder), working_dir=str(work), device="cpu")
        seconds = time.perf_counter() - started
    finally:
        onnx_export.torchlib_registry_built_once = original
    [graph] = work.glob(f"*/{onnx_export.GRAPH_FILE}")
    return seconds, graph.read_bytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="GPT2", help="a decoder family of tests/family_examples.py (GPT2)")
    parser.add_argument("--rounds", type=positive, default=3, help="alternating rounds (3)")
    parser.add_argument("--threads", type=positive, default=1, help="torch threads (1)")
    args = parse_checked(parser, argv)
    from conftest import build_tiny
    from family_examples import FAMILY_EXAMPLES

    if args.family not in FAMILY_EXAMPLES:
        parser.error(f"--family {args.family} has no test example; allowed: {', '.join(FAMILY_EXAMPLES)}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = build_tiny(root, args.family, FAMILY_EXAMPLES[args.family])
        _export(args.family, folder, root / "warm-up", cached=True)
        times: dict[str, list[float]] = {"cached": [], "torch": []}
        graphs: dict[str, bytes] = {}
        for index in range(args.rounds):
            order = ("cached", "torch") if index % 2 == 0 else ("torch", "cached")
            for way in order:
                seconds, graphs[way] = _export(args.family, folder, root / f"{way}-{index}", cached=way == "cached")
                times[way].append(seconds)
                print(f"round {index + 1}  {way:<6}  {seconds:6.2f} s", flush=True)
        same = graphs["cached"] == graphs["torch"]
    cached, plain = statistics.median(times["cached"]), statistics.median(times["torch"])
    print(f"\n{args.family} decoder export, median of {args.rounds}: cached table {cached:.2f} s, torch's "
          f"{plain:.2f} s; cached / torch {cached / plain:.2f}x; graphs identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(run_script("export_time.py", main))
