"""ONNX Runtime step execution, side by side in one process: IO binding vs plain `run`, and our loop vs a bare loop.

    python bench/onnxrt_io.py [--variant gpt2] [--batch 1] [--input-len 64] [--output-len 64] [--rounds 5]

Runs interleaved rounds of greedy generation (64 + 64 tokens by default, GPT-2 small with random weights):
- `nndf io-binding`: our generation loop, ONNX Runtime with IO binding, presents fed back as OrtValues;
- `nndf plain-run`: the same loop through `session.run` with numpy arrays (graphs with growing pasts only: the
  shared layout's buffers are always bound);
- `bare loop`: a minimal greedy loop over `session.run` with numpy on the same graph, no harness at all:
  the floor that our loop's Python overhead is measured against.
Prints decode ms/step medians and ratios to the bare loop last, then the host's share of our step (issue 21, goal
under 3% of a gpt2 fp32 step): per decode step of `nndf io-binding`, the step's time minus the time spent inside
ONNX Runtime's `run_with_iobinding` (so: feeding and binding inputs, the logits to torch, processors, argmax, the
cache's bookkeeping, the loop itself), the median over every step of every round; and the same for the first token
(from the call to `generate` to the first token, less the prefill's `run_with_iobinding`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import nndf  # noqa: E402
from nndf.actions.common import random_input_ids  # noqa: E402
from nndf.export.screened_head import INPUT as SCREEN_INPUT  # noqa: E402
from nndf.measure import StepTimer  # noqa: E402
from harness.cli import parse_checked, positive, run_script  # noqa: E402
from harness.worker import CallTimer  # noqa: E402


def bare_loop(session, ids: np.ndarray, new_tokens: int, num_layers: int, kv_heads: int, head_dim: int,
              on_token, shared: bool) -> np.ndarray:
    """The least a greedy loop over this graph can do: numpy in, numpy out, presents become pasts. `shared`: the
    graph's pasts are buffers of the whole generation's length (the shared layout), fed whole every step (without
    IO binding ONNX Runtime writes each step's presents into new buffers); else they grow by a position a step.
    A screened LM head is asked for the argmax alone (k = 1: no token is banned here)."""
    rows, length = ids.shape
    capacity = length + new_tokens if shared else 0
    past = {f"past_key_values.{i}.{k}": np.zeros((rows, kv_heads, capacity, head_dim), np.float32)
            for i in range(num_layers) for k in ("key", "value")}
    tokens = ids
    feed_ids = ids
    inputs = {i.name for i in session.get_inputs()}
    screen = {SCREEN_INPUT: np.array([1], np.int64)} if SCREEN_INPUT in inputs else {}
    out_names = [o.name for o in session.get_outputs()]
    for step in range(new_tokens):
        total = tokens.shape[1]
        new = feed_ids.shape[1]
        feeds = {"input_ids": feed_ids, "attention_mask": np.ones((rows, total), np.int64),
                 "position_ids": np.tile(np.arange(total - new, total, dtype=np.int64), (rows, 1)),
                 "logits_to_keep": np.array([new - 1], np.int64), **screen, **past}
        outputs = dict(zip(out_names, session.run(None, feeds)))
        next_tokens = outputs["logits"][:, -1, :].argmax(-1)[:, None].astype(np.int64)
        on_token()
        past = {name.replace("present", "past_key_values"): v for name, v in outputs.items()
                if name.startswith("present")}
        tokens = np.concatenate([tokens, next_tokens], axis=1)
        feed_ids = next_tokens
    return tokens


class MarkTimes(StepTimer):
    """A StepTimer that also keeps each token's time (perf_counter), to set against ONNX Runtime's own calls."""

    def start(self) -> None:
        self.times = []
        self.started = time.perf_counter()
        super().start()

    def mark(self) -> None:
        self.times.append(time.perf_counter())
        super().mark()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="gpt2")
    p.add_argument("--batch", type=positive, default=1)
    p.add_argument("--input-len", type=positive, default=64)
    p.add_argument("--output-len", type=positive, default=64)
    p.add_argument("--rounds", type=positive, default=5)
    p.add_argument("--working-dir", default="temp")
    args = parse_checked(p, None)

    m = nndf.load("GPT2", variant=args.variant, backend="onnxrt", random_weights=True, working_dir=args.working_dir)
    session = m.decoder.session
    ids = random_input_ids(args.batch, args.input_len, m.shapes.vocab_size, seed=0)
    n = args.output_len

    def ours(io_binding: bool):
        def run(timer):
            session.io_binding = io_binding
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, on_token=timer.mark)
        return run

    def bare(timer):
        shapes = m.shapes
        return torch.from_numpy(bare_loop(session.session, ids.numpy(), n, shapes.num_layers, shapes.kv_heads,
                                          shapes.head_dim, timer.mark, session.layout == "shared"))

    runtime = CallTimer()  # seconds inside ONNX Runtime per call of the io-binding engine, in call order
    runtime.wrap(session.session, "run_with_iobinding")
    host = []  # ms per decode step outside ONNX Runtime
    host_share = []
    first_host, first = [], []  # the first token: ms outside ONNX Runtime, and in all

    engines = {"nndf io-binding": ours(True), "nndf plain-run": ours(False), "bare loop": bare}
    if session.layout == "shared":  # its buffers are bound whatever io_binding says: plain run is not a way of it
        del engines["nndf plain-run"]
    steps = {name: [] for name in engines}
    outputs = {}
    for round_ in range(args.rounds + 1):  # round 0 is the warm-up
        for name, run in engines.items():
            timer = MarkTimes()
            runtime.reset()
            timer.start()
            outputs[name] = run(timer)
            inside_ort = runtime.calls
            marks = timer.times
            if round_:
                steps[name].append(timer.decode_step_median * 1e3)
            if round_ and name == "nndf io-binding":
                first.append((marks[0] - timer.started) * 1e3)
                first_host.append(first[-1] - inside_ort[0] * 1e3)
                # call k + 1 of ONNX Runtime (call 0 is the prefill) computes the logits of token k + 1
                for k, (before, after) in enumerate(zip(marks, marks[1:])):
                    step, ort = after - before, inside_ort[k + 1]
                    host.append((step - ort) * 1e3)
                    host_share.append((step - ort) / step)
        print(f"round {round_}/{args.rounds} done", file=sys.stderr)
    same = all(torch.equal(outputs["bare loop"], o) for o in outputs.values())
    print(f"GPT-2 {args.variant} random weights, batch {args.batch}, {args.input_len}+{n} tokens, "
          f"{args.rounds} interleaved rounds, KV layout {session.layout}; tokens identical across engines: {same}")
    base = statistics.median(steps["bare loop"])
    print(f"{'engine':<16} {'decode ms/step':>15} {'min':>7} {'max':>7} {'vs bare loop':>13}")
    for name, values in steps.items():
        med = statistics.median(values)
        print(f"{name:<16} {med:>15.2f} {min(values):>7.2f} {max(values):>7.2f} {med / base:>12.3f}x")
    share = statistics.median(host_share)
    print(f"host side of a decode step (nndf io-binding, outside ONNX Runtime): {statistics.median(host):.3f} ms "
          f"median, {share:.1%} of the step: {'PASS' if share < 0.03 else 'FAIL'} (goal < 3%)")
    print(f"host side of the first token (from the call to the first token, outside ONNX Runtime's prefill): "
          f"{statistics.median(first_host):.2f} ms median of {statistics.median(first):.1f} ms")


if __name__ == "__main__":
    sys.exit(run_script("onnxrt_io.py", main))
