"""bench/encoder_cpu.py's arithmetic and report: per shape and engine, ms per call and sentences/s over rounds and
how close the embeddings are to pytorch's; ratios; the goals as PASS / FAIL / SKIP; the report text.

The report keeps the harness's layout where it can ("batches" by shape key, engines, machine), so that
harness.stats.ratio and harness.render.cpu_note read it as they read the decoder benchmarks' reports.
"""

from __future__ import annotations

import math
import statistics

from harness.render import cpu_note, format_table, spread
from harness.stats import ratio, stat

GOAL_WORDS = {"speedup": "throughput", "latency": "ms/call", "cosine": "mean cosine to"}


def key(shape: tuple[int, int]) -> str:
    """A shape's name in the report and on the command line: "16x128"."""
    return f"{shape[0]}x{shape[1]}"


def fidelity(reference: list[list[float]], rows: list[list[float]]) -> dict:
    """How close an engine's embeddings are to pytorch's: cosine per sentence (mean, worst), max |difference|."""
    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / (math.sqrt(sum(x * x for x in a) * sum(y * y for y in b)) or 1.0)

    cosines = [cos(a, b) for a, b in zip(reference, rows)]
    return {"mean_cosine": sum(cosines) / len(cosines), "min_cosine": min(cosines),
            "max_abs_diff": max(abs(x - y) for a, b in zip(reference, rows) for x, y in zip(a, b))}


def summarize(args, warm: dict, runs: dict) -> dict:
    """Per shape and engine: ms per call and sentences/s over the rounds (each round's median call), fidelity."""
    out = {}
    for b, s in args.shapes:
        per, reference = {}, (warm[key((b, s))].get("pytorch") or {}).get("embeddings")
        for engine, results in runs[key((b, s))].items():
            medians = [statistics.median(r["calls_s"]) * 1e3 for r in results]
            per[engine] = {"call_ms": stat(medians), "sent_s": stat([b * 1e3 / ms for ms in medians]),
                           "calls": sum(len(r["calls_s"]) for r in results)}
            if reference is not None:
                per[engine]["fidelity"] = fidelity(reference, warm[key((b, s))][engine]["embeddings"])
        out[key((b, s))] = per
    return out


def goal_value(report: dict, engine: str, shape: str, what: str, reference: str) -> float | None:
    """A goal's figure (see evaluate_goals), None when the engine or its reference has none at that shape."""
    if what == "cosine":
        return ((report["batches"].get(shape, {}).get(engine) or {}).get("fidelity") or {}).get("mean_cosine")
    value = ratio(report, engine, reference, shape, "call_ms")
    return 1 / value if what == "speedup" and value else value


def _why_missing(report: dict, engine: str, reference: str, shape: str) -> str:
    for name in (engine, reference):
        info = report["engines"].get(name)
        if info is None:
            return f"{name} was not among --engines"
        if info.get("status") != "ok":
            return f"{name} did not run: {info.get('reason')}"
    if shape not in report["settings"]["shapes"]:
        return f"shape {shape} was not among --shapes"
    return "no figure"


def evaluate_goals(report: dict, goals) -> list[dict]:
    """Each goal (engine, shape, what, reference, op, target) as PASS, FAIL or SKIP (with the reason). what:
    "speedup" = reference ms/call / engine ms/call (a throughput ratio), "latency" = engine ms/call / reference
    ms/call, "cosine" = the engine's mean cosine to pytorch's embeddings."""
    out = []
    for engine, shape, what, reference, op, target in goals:
        label = f"{shape} {engine} {GOAL_WORDS[what]} {'/ ' if what != 'cosine' else ''}{reference}"
        value = goal_value(report, engine, shape, what, reference)
        unit, digits = ("", 4) if what == "cosine" else ("x", 2)
        goal = {"engine": engine, "shape": shape, "what": what, "reference": reference, "op": op, "target": target,
                "value": value, "label": label}
        if value is None:
            goal.update(status="SKIP", text=f"{label} (goal {op} {target:.2f}{unit}): "
                                             f"{_why_missing(report, engine, reference, shape)}")
        else:
            ok = value <= target if op == "<=" else value >= target
            if f"{value:.{digits}f}" == f"{target:.{digits}f}":
                digits += 2  # 0.998 is not 1.00
            goal.update(status="PASS" if ok else "FAIL",
                        text=f"{label} = {value:.{digits}f}{unit} (goal {op} {target:.2f}{unit})")
        out.append(goal)
    return out


def render_report(report: dict) -> str:
    s, env = report["settings"], report["environment"]
    out = [f"encoder_cpu: {s['model']}, {s['inputs']}; {s['rounds']} interleaved round{'s' if s['rounds'] != 1 else ''} after 1 warm-up, each the "
           f"median of >= 3 calls and >= {s['seconds']:g} s per engine and shape",
           "main env: " + ", ".join(f"{k} {v}" for k, v in env["main"].items())]
    if env.get("optimum"):
        out.append("optimum env: " + ", ".join(f"{k} {v}" for k, v in env["optimum"]["versions"].items()))
    out.append(f"threads: {s['threads'] or 'each runtime default'}; figures are medians over rounds, "
               "spread = (max - min) / median; fidelity = the warm-up's embeddings against pytorch's")
    out += [cpu_note(report)] if cpu_note(report) else []
    header = ["engine", "ms/call", "spread", "sentences/s", "spread", "mean cos", "min cos", "max |diff|", "peak MiB"]
    for shape in s["shapes"]:
        rows = []
        for e, entry in report["batches"].get(shape, {}).items():
            f, rss = entry.get("fidelity") or {}, report["engines"][e].get("peak_rss_bytes")
            rows.append([e, f"{entry['call_ms']['median']:.2f}", spread(entry['call_ms']),
                         f"{entry['sent_s']['median']:.1f}", spread(entry['sent_s']),
                         *(f"{f[k]:.{d}}" if k in f else "-" for k, d in (("mean_cosine", "6f"), ("min_cosine", "6f"),
                                                                          ("max_abs_diff", "2e"))),
                         f"{rss / 2**20:.0f}" if rss else "-"])
        out += ["", f"batch {shape.replace('x', ', seq ')}"]
        out += [format_table(header, rows, indent="  ")] if rows else []
        out += [f"  {e}: not run: {i.get('reason') or 'no result'}" for e, i in report["engines"].items()
                if e not in report["batches"].get(shape, {})]
    out += ["", "RATIOS (same run, side by side; throughput = pytorch ms/call / engine ms/call)"]
    for shape in s["shapes"]:
        rows = [[e, f"{entry['call_ms']['median']:.2f}", _x(goal_value(report, e, shape, "speedup", "pytorch")),
                 _x(goal_value(report, e, shape, "latency", "optimum"))]
                for e, entry in report["batches"].get(shape, {}).items()]
        if rows:
            out += [f"  {shape}", format_table(["engine", "ms/call", "throughput / pytorch", "ms/call / optimum"],
                                               rows, indent="    ")]
    return "\n".join(out + ["", "GOALS"] + [f"  {g['status']:4}  {g['text']}" for g in report["goals"]])


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
