"""Measurement arithmetic: foreign CPU use, per-round statistics, token agreement, ratios and goals."""

from __future__ import annotations

import os
import statistics
import time

from harness.bench import METRIC_LABELS, REFERENCES


def machine_cpu() -> str | None:
    """This machine's CPU for a report's header (`nndf.machine.cpu_description`), imported only when a report is
    made: the scripts are also the workers of venvs without nndf (Optimum's, GenAI's)."""
    from nndf.machine import cpu_description

    return cpu_description()


class CpuWatch:
    """How much CPU processes other than ours used while we measured, in cores (from /proc; None elsewhere).

    On a 2-core machine one busy foreign process starves one of the two threads that each runtime uses by default,
    and the runtimes do not suffer alike (PyTorch's step waits for its slowest thread): the report says so.
    """

    def __init__(self) -> None:
        self.start_time = self.machine = None
        self.ours: dict[int, int] = {}

    @staticmethod
    def _machine_busy() -> int:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait

    @staticmethod
    def _process(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return sum(int(f) for f in fields[11:15])  # utime + stime + cutime + cstime (its tools, once waited for)
        except (OSError, IndexError, ValueError):
            return 0

    def start(self, pids: list[int]) -> None:
        try:
            self.machine = self._machine_busy()
        except OSError:
            return
        self.ours = {pid: self._process(pid) for pid in pids}
        self.start_time = time.perf_counter()

    def foreign_cores(self) -> float | None:
        if self.start_time is None:
            return None
        elapsed = time.perf_counter() - self.start_time
        machine = self._machine_busy() - self.machine
        ours = sum(self._process(pid) - before for pid, before in self.ours.items())
        return max(0.0, (machine - ours) / os.sysconf("SC_CLK_TCK") / elapsed) if elapsed > 0 else None


def stat(values: list[float]) -> dict | None:
    """Median, min, max and spread = (max - min) / median in % of a list of per-round values."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return {"median": med, "min": lo, "max": hi, "spread_pct": 100.0 * (hi - lo) / med if med else 0.0,
            "n": len(values), "values": values}


def token_agreement(reference: list[list[int]], runs: list[list[list[int]]]) -> dict:
    """How many new tokens of `runs` equal the reference's at the same row and position, and the first that do not."""
    equal = total = 0
    first = None
    for rows in runs:
        for r, (ref_row, row) in enumerate(zip(reference, rows)):
            for s, (a, b) in enumerate(zip(ref_row, row)):
                total += 1
                if a == b:
                    equal += 1
                elif first is None:
                    first = {"row": r, "step": s}
            total += abs(len(ref_row) - len(row))
    return {"equal": equal, "total": total, "share": equal / total if total else None,
            "identical": total > 0 and equal == total, "first_difference": first}


def summarize(runs: dict, warm: dict, args) -> dict:
    """Per batch and engine: statistics over the timed rounds and the token check against hf."""
    batches = {}
    for b in args.batch_sizes:
        per = {}
        reference = warm.get(b, {}).get("hf", {}).get("tokens")
        for engine, results in runs.get(b, {}).items():
            if not results:
                continue
            entry = {
                "step_ms": stat([r["step_median_s"] * 1e3 for r in results if r["step_median_s"] is not None]),
                "ttft_ms": stat([r["ttft_s"] * 1e3 for r in results if r["ttft_s"] is not None]),
                "tok_s": stat([b * args.output_len / r["e2e_s"] for r in results]),
                "e2e_s": stat([r["e2e_s"] for r in results]),
                "marks": sorted({r["marks"] for r in results}),
                "tokens": None,
            }
            encoder = stat([r["encoder_s"] * 1e3 for r in results if r.get("encoder_s") is not None])
            if encoder is not None:
                entry["encoder_ms"] = encoder
            if reference is not None and all(r.get("tokens") is not None for r in [warm[b][engine], *results]):
                outputs = [warm[b][engine]["tokens"]] + [r["tokens"] for r in results]
                entry["tokens"] = token_agreement(reference, outputs)
            per[engine] = entry
        batches[b] = per
    return batches


def metric(report: dict, engine: str, batch: int | None, name: str) -> float | None:
    if name == "peak_rss":
        return report["engines"].get(engine, {}).get("peak_rss_bytes")
    entry = report["batches"].get(batch, {}).get(engine) or {}
    value = entry.get(name)
    return value["median"] if value else None


def ratio(report: dict, engine: str, reference: str, batch: int | None, name: str) -> float | None:
    a, b = metric(report, engine, batch, name), metric(report, reference, batch, name)
    return a / b if a is not None and b else None


def compute_ratios(report: dict, bench) -> list[dict]:
    """Per batch, each of bench.ratio_metrics(batch) / hf and / optimum; then peak memory / hf."""
    rows = []
    engines = list(report["settings"]["engines"])
    for b in report["settings"]["batch_sizes"]:
        for name in bench.ratio_metrics(b):
            for e in engines:
                if metric(report, e, b, name) is None:
                    continue
                rows.append({"batch": b, "metric": name, "engine": e, "value": metric(report, e, b, name),
                             **{f"vs_{ref}": ratio(report, e, ref, b, name) for ref in REFERENCES}})
    for e in engines:
        if metric(report, e, None, "peak_rss") is not None:
            rows.append({"batch": None, "metric": "peak_rss", "engine": e, "value": metric(report, e, None, "peak_rss"),
                         "vs_hf": ratio(report, e, "hf", None, "peak_rss")})
    return rows


def peer_ratios(report: dict, bench) -> list[dict]:
    """Per batch, each (ours, peer) pair of bench.peers where both ran: decode ms/step, first token ms and tok/s of
    ours divided by the peer's (the same weights converted for the peer, at the same precision)."""
    rows = []
    for b in report["settings"]["batch_sizes"]:
        for ours, peer in getattr(bench, "peers", ()):
            if metric(report, ours, b, "step_ms") is None or metric(report, peer, b, "step_ms") is None:
                continue
            rows.append({"batch": b, "engine": ours, "peer": peer,
                         **{name: ratio(report, ours, peer, b, name) for name in ("step_ms", "ttft_ms", "tok_s")}})
    return rows


def _why_missing(report: dict, engine: str, batch: int | None) -> str:
    info = report["engines"].get(engine)
    if batch is not None and batch not in report["settings"]["batch_sizes"]:  # the wider reason first
        return f"batch {batch} was not among --batch-sizes"
    if info is None:
        return f"{engine} was not among --engines"
    if info.get("status") != "ok" and info.get("reason"):
        return f"{engine} did not run: {info['reason']}"
    return f"no figure for {engine}"


def evaluate_goals(report: dict, bench) -> list[dict]:
    """Each of bench.goals as PASS, FAIL or SKIP (with the reason), plus the token check of onnxrt fp32 against hf."""
    goals = []
    for engine, batch, name, reference, op, target in bench.goals:
        where = f"batch {batch} " if batch is not None else ""
        label = f"{where}{engine} {METRIC_LABELS[name]} / {reference}"
        value = ratio(report, engine, reference, batch, name)
        goal = {"engine": engine, "batch": batch, "metric": name, "reference": reference, "op": op, "target": target,
                "ratio": value, "label": label}
        if value is None:
            missing = engine if metric(report, engine, batch, name) is None else reference
            why = _why_missing(report, missing, batch)
            goal.update(status="SKIP", text=f"{label} (goal {op} {target:.2f}x): {why}")
        else:
            ok = value <= target if op == "<=" else value >= target
            shown = f"{value:.2f}" if f"{value:.2f}" != f"{target:.2f}" else f"{value:.4f}"  # 2.998 is not 3.00
            goal.update(status="PASS" if ok else "FAIL", text=f"{label} = {shown}x (goal {op} {target:.2f}x)")
        goals.append(goal)
    checked = [(b, e["onnxrt"]["tokens"]) for b, e in report["batches"].items()
               if e.get("onnxrt") and e["onnxrt"].get("tokens")]
    label = "onnxrt fp32 tokens equal hf's"
    if not checked:
        goals.append({"status": "SKIP", "label": label, "engine": "onnxrt", "metric": "tokens",
                      "text": f"{label}: needs both hf and onnxrt"})
    else:
        bad = [f"batch {b}: {100 * t['share']:.1f}% equal" for b, t in checked if not t["identical"]]
        text = f"{label} at batch {', '.join(str(b) for b, _ in checked)}" + (f" ({'; '.join(bad)})" if bad else "")
        goals.append({"status": "FAIL" if bad else "PASS", "label": label, "engine": "onnxrt", "metric": "tokens",
                      "text": text})
    return goals
