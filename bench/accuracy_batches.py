"""LAMBADA scoring one passage per forward pass against batches of passages, side by side in one process.

    HF_HUB_OFFLINE=1 python bench/accuracy_batches.py                     # trained tiny GPT-2, 1000 passages
    HF_HUB_OFFLINE=1 python bench/accuracy_batches.py --backends frameworks onnxrt --rounds 2

For each backend the same passages are scored with `--batch-size 1` and each of `--batch-sizes`, interleaved round
by round (the machine is noisy: the ratio is what counts), and the script checks that every figure of every
batched run equals the one-by-one figures exactly. `--fidelity N` also times the logit comparison with PyTorch
that `accuracy` runs for non-PyTorch backends, on the first N passages.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from harness.cli import parse_checked, positive, run_script  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-dir", default=str(SHARED / "lambada-tiny-gpt2"))
    parser.add_argument("--dataset-file", default=str(SHARED / "lambada" / "lambada_test.jsonl"))
    parser.add_argument("--num-samples", type=positive, default=1000)
    parser.add_argument("--backends", nargs="+", default=["frameworks", "onnxrt"])
    parser.add_argument("--batch-sizes", type=positive, nargs="+", default=[16])
    parser.add_argument("--rounds", type=positive, default=1)
    parser.add_argument("--fidelity", type=int, default=0, metavar="N")
    parser.add_argument("--working-dir", default="temp")
    args = parse_checked(parser, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import nndf
    from nndf.lambada import load_lambada, sample_texts

    texts = [t for _, t in sample_texts(load_lambada(args.dataset_file), args.num_samples, seed=0)]
    reference = nndf.load("GPT2", backend="frameworks", torch_dir=args.torch_dir)
    models = {name: reference if name == "frameworks" else
              nndf.load("GPT2", backend=name, loaded=reference.loaded, working_dir=args.working_dir)
              for name in args.backends}
    sizes = [1, *args.batch_sizes]
    seconds: dict[tuple[str, int], list[float]] = {}
    figures: dict[tuple[str, int], dict] = {}
    for _ in range(args.rounds):
        for name, model in models.items():
            for size in sizes:
                started = time.perf_counter()
                metrics = model.architecture.lambada(texts, model, 1, 5, batch_size=size)
                seconds.setdefault((name, size), []).append(time.perf_counter() - started)
                figures[(name, size)] = metrics.as_dict()

    print(f"\nLAMBADA, {len(texts)} passages, {args.torch_dir}, {args.rounds} round(s), median seconds")
    print(f"{'backend':<12} {'batch':>5} {'seconds':>8} {'passages/s':>10} {'speed-up':>8}  figures")
    for name in models:
        one = statistics.median(seconds[(name, 1)])
        for size in sizes:
            took = statistics.median(seconds[(name, size)])
            same = "equal to batch 1" if figures[(name, size)] == figures[(name, 1)] else "DIFFER from batch 1"
            print(f"{name:<12} {size:>5} {took:>8.2f} {len(texts) / took:>10.1f} {one / took:>7.2f}x  {same}")
    if args.fidelity:
        print(f"\nfidelity against PyTorch (float64 KL over every position), first {args.fidelity} passages")
        for name, model in models.items():
            if model.is_reference:
                continue
            for size in sizes:
                started = time.perf_counter()
                model.architecture.fidelity(texts[: args.fidelity], model, size)
                print(f"{name:<12} {size:>5} {time.perf_counter() - started:>8.2f} s")
    return 0 if all(figures[(n, s)] == figures[(n, 1)] for n in models for s in sizes) else 1


if __name__ == "__main__":
    sys.exit(run_script("accuracy_batches.py", main))
