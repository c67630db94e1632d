"""The report as text: header, one table per batch size, the token check, RATIOS, then GOALS."""

from __future__ import annotations

from harness.bench import BUSY_CORES, METRIC_LABELS, METRICS
from harness.stats import metric


def format_table(header: list[str], rows: list[list[str]], align: str | None = None, indent: str = "") -> str:
    """Columns padded to their widest cell; `align` has one 'l' or 'r' per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]

    def line(cells):
        out = [str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align)]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def spread(s: dict | None) -> str:
    """The spread over rounds; "-" with one round (nothing to spread)."""
    return "-" if not s or s.get("n", 2) < 2 else f"{s['spread_pct']:.1f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _tokens_cell(bench, engine: str, entry: dict) -> str:
    t = entry.get("tokens")
    if engine == "hf":
        return "reference" if t is None or t["identical"] else f"reference, varies ({100 * t['share']:.1f}%)"
    if t is None:
        return "-"
    if t["identical"]:
        return "identical"
    text = f"{100 * t['share']:.1f}% equal"
    return f"MISMATCH {text}" if engine in bench.exact_engines else text


def _header(report: dict, bench) -> list[str]:
    s = report["settings"]
    inputs = s.get("inputs") or f"{s['input_len']} {bench.input_word}"  # "64 encoder", "random 384x384 images"
    out = [f"{bench.name}: {s['family']} {s['variant']} ({s['weights']}), {inputs} + "
           f"{s['output_len']} new tokens, greedy, KV cache, "
           f"{s['rounds']} interleaved round{'s' if s['rounds'] != 1 else ''} after 1 warm-up"]
    if s.get("generation"):
        out.append("generation config of the weights (applies to every engine): "
                   + ", ".join(f"{k} {v}" for k, v in s["generation"].items()))
    env = report.get("environment", {})
    out.append("main env: " + ", ".join(f"{k} {v}" for k, v in env.get("main", {}).items()))
    if env.get("optimum"):
        out.append("optimum env: " + ", ".join(f"{k} {v}" for k, v in env["optimum"]["versions"].items()))
    threads = s.get("threads")
    out.append(f"threads: {threads if threads else 'each runtime default'}; figures are medians over rounds, "
               "spread = (max - min) / median")
    note = cpu_note(report)
    if note:
        out.append(note)
    return out


def cpu_note(report: dict) -> str | None:
    """The CPU (report["machine"]["cpu"], `cpu_description`) and CpuWatch's figure, with a WARNING when other
    processes used BUSY_CORES or more."""
    machine = report.get("machine") or {}
    foreign, cores = machine.get("foreign_cores"), machine.get("cores")
    cpu = f"cpu: {machine['cpu']}" if machine.get("cpu") else None
    if foreign is None:
        return cpu
    note = f"other processes used {foreign:.2f} of {cores} cores on average while we measured"
    if foreign >= BUSY_CORES:
        note = ("WARNING: " + note + ": absolute figures are inflated and ratios skewed (a runtime whose step waits"
                " for all of its threads, like PyTorch's, loses more to a busy core"
                + ("" if report["settings"].get("threads") == 1 else "; try --threads 1") + ")")
    return f"{cpu}\n{note}" if cpu else note


def _batch_table(report: dict, bench, b: int) -> list[str]:
    s = report["settings"]
    out = ["", f"batch {b}"]
    rows = []
    for e in s["engines"]:
        entry = report["batches"].get(b, {}).get(e)
        if not entry:
            continue
        row = [e]
        for name in bench.table_metrics:
            row += [_num(metric(report, e, b, name), METRICS[name][2]), spread(entry.get(name))]
        rows.append(row + [_tokens_cell(bench, e, entry)])
    header = ["engine"] + [h for name in bench.table_metrics for h in (METRIC_LABELS[name], "spread")]
    if rows:
        out.append(format_table(header + ["tokens vs hf"], rows, "l" + "rr" * len(bench.table_metrics) + "l",
                                indent="  "))
    for e in s["engines"]:
        info = report["engines"].get(e, {})
        if not report["batches"].get(b, {}).get(e):
            out.append(f"  {e}: not run: {info.get('reason') or 'no result'}")
    out += [line for line in (note(report, b) for note in bench.table_notes) if line]
    return out


def _token_section(report: dict, bench) -> list[str]:
    """Per engine and batch: identical or the share of equal tokens; loud when an exact engine differs."""
    s = report["settings"]
    out = ["", "tokens (greedy, every run against hf's warm-up run of the same batch)"]
    for e in s["engines"]:
        if e == "hf":
            continue
        parts, loud = [], []
        for b in s["batch_sizes"]:
            t = (report["batches"].get(b, {}).get(e) or {}).get("tokens")
            if t is None:
                continue
            first = t["first_difference"] or {}
            if t["identical"]:
                parts.append(f"batch {b}: identical")
            else:
                parts.append(f"batch {b}: {100 * t['share']:.1f}% equal (first difference: row {first.get('row')}, "
                             f"new token {first.get('step')})")
            if e in bench.exact_engines and not t["identical"]:
                loud.append(f"!!! TOKEN MISMATCH: {e} differs from hf at batch {b}: {100 * t['share']:.1f}% of "
                            f"tokens equal, first difference at row {first.get('row')}, new token {first.get('step')}")
        if parts:
            out.append(f"  {e}: " + "; ".join(parts))
        out.extend("  " + line for line in loud)
    return out


def _ratio_section(report: dict, bench) -> list[str]:
    ratios = report["ratios"]
    out = ["", "RATIOS (same run, side by side)"]
    for b in report["settings"]["batch_sizes"]:
        for name in bench.ratio_metrics(b):
            label, lower, digits = METRICS[name]
            rows = [[r["engine"], _num(r["value"], digits), _x(r.get("vs_hf")), _x(r.get("vs_optimum"))]
                    for r in ratios if r["batch"] == b and r["metric"] == name]
            if rows:
                out.append(f"  batch {b}: {label} ({'lower' if lower else 'higher'} is faster)")
                out.append(format_table(["engine", label, "/ hf", "/ optimum"], rows, indent="    "))
    peers = report.get("peer_ratios") or []
    if peers:
        out.append("  against the peers (ours / peer, same weights and precision; lower is faster, tok/s higher)")
        rows = [[str(r["batch"]), r["engine"], r["peer"], _x(r["step_ms"]), _x(r["ttft_ms"]), _x(r["tok_s"])]
                for r in peers]
        out.append(format_table(["batch", "engine", "peer", "decode ms/step", "first token ms", "tok/s"], rows,
                                "lllrrr", indent="    "))
    rows = [[r["engine"], f"{r['value'] / 2**20:.0f}", _x(r.get("vs_hf")), _mmap(report, r["engine"])]
            for r in ratios if r["metric"] == "peak_rss"]
    if rows:
        out.append("  peak memory of each worker process (its peak RSS, VmHWM, read at the end; llama.cpp: its tool's,"
                   " mmap'd weights included)")
        out.append(format_table(["engine", "MiB", "/ hf", "of it file-backed (mmap) MiB"], rows, indent="    "))
    return out


def _mmap(report: dict, engine: str) -> str:
    value = report["engines"].get(engine, {}).get("rss_file_bytes")
    return "-" if value is None else f"{value / 2**20:.0f}"


def render_report(report: dict, bench) -> str:
    out = _header(report, bench)
    for b in report["settings"]["batch_sizes"]:
        out += _batch_table(report, bench, b)
    out += _token_section(report, bench)
    out += _ratio_section(report, bench)  # ratios last, then the verdicts
    out += ["", "GOALS"] + [f"  {g['status']:4}  {g['text']}" for g in report["goals"]]
    return "\n".join(out)
