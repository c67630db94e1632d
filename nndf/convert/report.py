"""Checking each backend against PyTorch, timing it, and printing what transformer-deploy prints.

`check` runs a backend on every check input (the min, opt and max shapes of -b / -s) and raises one HarnessError
naming the backend, the output and the largest difference when it is over `--atol`. `timings` times it with the
harness's one timing function (`nndf.measure.time_calls`: warm-up, then one sample per call, the GPU synchronised
inside the timed region). `latency_line` is transformer-deploy's line: `[name] mean=..ms, sd=..ms, min=..ms,
max=..ms, median=..ms, 95p=..ms, 99p=..ms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from nndf.convert.engines import Engine
from nndf.errors import HarnessError
from nndf.measure import Timing, TimingSettings, time_calls


@dataclass
class Fidelity:
    """How far a backend's outputs are from PyTorch's over the check inputs."""

    max_abs_diff: float
    mean_cosine: float  # per row (an embedding, a row of logits), averaged


def compare(reference: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> tuple[Fidelity, list[float]]:
    """Fidelity over all check inputs, and the largest difference of each output (in the task's order)."""
    per_output = [0.0] * len(reference[0])
    cosines = []
    for ref_set, out_set in zip(reference, outputs):
        for index, (ref, out) in enumerate(zip(ref_set, out_set)):
            if ref.shape != out.shape:
                raise HarnessError(f"an output has shape {out.shape} where PyTorch's has {ref.shape}")
            per_output[index] = max(per_output[index], float(np.abs(ref - out).max()))
            a, b = ref.reshape(ref.shape[0], -1).astype(np.float64), out.reshape(out.shape[0], -1).astype(np.float64)
            norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
            # a row and its equal can come out a rounding step past 1 (1.0000000000000002): a cosine is within
            # [-1, 1], and the report and the JSON say so
            cosines.extend(np.clip((a * b).sum(axis=1) / np.maximum(norms, 1e-12), -1.0, 1.0))
    return Fidelity(max(per_output), float(np.mean(cosines))), per_output


def check(engine: Engine, inputs: list[dict[str, torch.Tensor]], reference: list[list[np.ndarray]],
          output_names: tuple[str, ...], atol: float) -> Fidelity:
    outputs = [engine.infer(feeds) for feeds in inputs]
    try:
        fidelity, per_output = compare(reference, outputs)
    except HarnessError as exc:  # which backend gave that shape
        raise HarnessError(f"[{engine.name}] {exc}") from None
    for name, diff in zip(output_names, per_output):
        if not diff <= atol and engine.reruns_reference:
            raise HarnessError(f"[{engine.name}] a second PyTorch run's output '{name}' differs from the first's by up "
                               f"to {diff:.4g}, more than --atol {atol:g}: that is this machine's run-to-run noise, "
                               "the floor every backend sits on; give an --atol above it")
        if not diff <= atol:  # NaN fails too
            raise HarnessError(f"[{engine.name}] output '{name}' differs from PyTorch's by up to {diff:.4g}, more "
                               f"than --atol {atol:g}; the converted model is not faithful (raise --atol only if "
                               "that difference is expected, as with int8)")
    return fidelity


def timings(engine: Engine, feeds: dict[str, torch.Tensor], warmup: int, measures: int, device: str) -> Timing:
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else None
    return time_calls(lambda: engine.infer(feeds), TimingSettings(iterations=measures, warmup=warmup), sync=sync)


def timing_ms(timing: Timing) -> dict[str, float | None]:
    """The statistics the latency line prints, in ms, for the JSON report: the same figures under the same names
    (stdev for sd), and null for an unknown spread (one measure), since NaN is not JSON."""
    ms = {k: 1000 * v for k, v in (("mean", timing.mean), ("stdev", timing.stdev), ("min", timing.min),
                                    ("max", timing.max), ("median", timing.median), ("95p", timing.percentile(95)),
                                    ("99p", timing.percentile(99)))}
    return {k: None if math.isnan(v) else v for k, v in ms.items()}


def latency_line(name: str, timing: Timing) -> str:
    ms = timing_ms(timing)
    return f"[{name}] " + ", ".join(f"{'sd' if k == 'stdev' else k}=-" if v is None else
                                    f"{'sd' if k == 'stdev' else k}={v:.2f}ms" for k, v in ms.items())


def fidelity_lines(results: dict[str, Fidelity], atol: float, reruns: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The differences table and its notes; `reruns`: the rows of PyTorch fp32 run again, which a reader would
    otherwise take for PyTorch against itself (a difference of 1e-7 there looked like a fault)."""
    width = max(map(len, results))
    lines = [f"{'backend':<{width}}  max |diff| vs PyTorch  mean cosine"]
    lines += [f"{name:<{width}}  {f.max_abs_diff:>20.2e}  {f.mean_cosine:>11.6f}" for name, f in results.items()]
    lines.append(f"each backend's outputs are within {atol:g} (--atol) of PyTorch's")
    lines += [f"{name}: a second PyTorch run against the first, the reference: this machine's run-to-run noise, the "
              "floor the other rows sit on" for name in reruns if name in results]
    return lines
