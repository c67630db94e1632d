"""lm-evaluation-harness's own `hf` model against our backends as an lm-eval model and `accuracy`'s lm-eval
columns, side by side in one process on the same model and LAMBADA passages (lm-eval's `lambada_openai` task).

    HF_HUB_OFFLINE=1 python bench/lm_eval_check.py            # shared trained tiny GPT-2, LAMBADA lines 2000-2999
    HF_HUB_OFFLINE=1 python bench/lm_eval_check.py --backends frameworks onnxrt onnxrt-int8 onnxrt-int4 \\
        --first 2500 --passages 500

Rows: `lm-eval hf` (lm-eval 0.4.13's HFLM on the PyTorch model, `--hf-batch-size` 1 as lm-eval's default), then per
backend `nndf.lm_eval` (NndfLM through `lm_eval.simple_evaluate`) and `accuracy` (the scoring `run.py accuracy`
runs, `architecture.lambada`: its lm-eval acc and ppl columns; without the fidelity pass that accuracy adds for
non-PyTorch backends). Columns: acc, ppl, each relative to the hf row, and seconds. Exit 1 when a full-precision
row (frameworks, onnxrt) differs from the hf row by more than `--tolerance` (1e-6) relative. Needs lm-eval[hf]
(the test extra) and ../shared/data beside the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from harness.cli import parse_checked, positive, run_script  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="GPT2")
    parser.add_argument("--torch-dir", default=str(SHARED / "lambada-tiny-gpt2"))
    parser.add_argument("--dataset-file", default=str(SHARED / "lambada" / "lambada_test.jsonl"))
    parser.add_argument("--first", type=int, default=2000, help="first LAMBADA line (0-based, default 2000)")
    parser.add_argument("--passages", type=positive, default=1000, help="lines scored (default 1000)")
    parser.add_argument("--backends", nargs="+", default=["frameworks", "onnxrt", "onnxrt-int8"])
    parser.add_argument("--batch-size", type=positive, default=16, help="ours: requests per forward pass (default 16)")
    parser.add_argument("--hf-batch-size", type=positive, default=1, help="lm-eval's hf model (default 1)")
    parser.add_argument("--tolerance", type=float, default=1e-6)
    parser.add_argument("--working-dir", default="temp")
    return parse_checked(parser, argv)


def relative(value: float, reference: float) -> float:
    return 0.0 if value == reference else (value - reference) / abs(reference)


def render(rows: list[dict]) -> str:
    header = ["row", "backend", "acc", "acc vs hf", "ppl", "ppl vs hf", "seconds"]
    cells = [[r["row"], r["backend"], f"{r['acc']:.6f}", f"{r['acc_rel']:+.2e}", f"{r['ppl']:.7g}",
              f"{r['ppl_rel']:+.2e}", f"{r['seconds']:.1f}"] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    import nndf
    from nndf.lambada import read_jsonl_texts
    from nndf.lm_eval import NndfLM
    from nndf.lm_eval_tasks import prepare_tasks

    texts = read_jsonl_texts(args.dataset_file)[args.first:args.first + args.passages]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lm-eval-check-") as folder:
        data = Path(folder) / "passages.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        tasks = prepare_tasks("lambada_openai", [str(data)], None, Path(folder))

        def evaluate(lm) -> tuple[float, float, float]:
            started = time.perf_counter()
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks.specs, task_manager=tasks.manager, bootstrap_iters=0,
                                          log_samples=False)["results"]["lambada_openai"]
            return out["acc,none"], out["perplexity,none"], time.perf_counter() - started

        hf = HFLM(pretrained=args.torch_dir, backend="default", batch_size=args.hf_batch_size, device="cpu")
        acc, ppl, seconds = evaluate(hf)
        reference = {"acc": acc, "ppl": ppl}
        rows.append(dict(row="lm-eval hf", backend="PyTorch", acc=acc, ppl=ppl, seconds=seconds))
        del hf
        first = nndf.load(args.family, backend="frameworks", torch_dir=args.torch_dir)
        for name in args.backends:
            model = first if name == "frameworks" else nndf.load(args.family, backend=name, loaded=first.loaded,
                                                                 working_dir=args.working_dir)
            acc, ppl, seconds = evaluate(NndfLM(model, batch_size=args.batch_size))
            rows.append(dict(row="nndf.lm_eval", backend=name, acc=acc, ppl=ppl, seconds=seconds))
            started = time.perf_counter()
            metrics = model.architecture.lambada(texts, model, 1, 5, batch_size=args.batch_size)
            rows.append(dict(row="accuracy", backend=name, acc=metrics.lm_eval_accuracy,
                             ppl=metrics.lm_eval_perplexity, seconds=time.perf_counter() - started))
    for row in rows:
        row["acc_rel"] = relative(row["acc"], reference["acc"])
        row["ppl_rel"] = relative(row["ppl"], reference["ppl"])
    print(f"\nlm-eval lambada_openai, {len(texts)} passages (lines {args.first}-{args.first + len(texts) - 1}), "
          f"{args.torch_dir}; ours at batch {args.batch_size}, lm-eval hf at batch {args.hf_batch_size}")
    print(render(rows))
    exact = [r for r in rows[1:] if r["backend"] in ("frameworks", "onnxrt")]
    worst = max(max(abs(r["acc_rel"]), abs(r["ppl_rel"])) for r in exact) if exact else 0.0
    verdict = "within" if worst <= args.tolerance else "OUTSIDE"
    print(f"full-precision rows: largest relative difference from lm-eval hf {worst:.2e}, {verdict} {args.tolerance:g}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(run_script("lm_eval_check.py", main))
