"""`--plot FILE.png` of `benchmark` and `compare`: one figure, one bar per backend for each figure that matters.

matplotlib is an optional extra (`pip install 'nndf[plot]'`); `check_plotting` says so in one sentence before
anything is loaded or timed. The figure is drawn off-screen (its own Agg canvas, pyplot's backend left as it is)
and written atomically.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import NamedTuple, Sequence

from nndf.errors import HarnessError
from nndf.workspace import atomic_path


class Panel(NamedTuple):
    """One figure of the rows: its row key, title, the row key of its spread (None: no error bars), and what the
    panel says when no row has the figure (why it could not be measured: the action knows)."""

    key: str
    label: str
    spread: str | None = None
    missing: str = "not measured in this run"


def check_plotting(path: str | None) -> None:
    """Before any work: matplotlib is there (where the file goes is checked with the other paths: nndf.paths)."""
    if path is None:
        return
    try:
        import matplotlib
    except ImportError:
        raise HarnessError("--plot needs matplotlib, which is not installed: pip install 'nndf[plot]'") from None
    del matplotlib  # only whether it is there matters here (and pyflakes sees it used)


def plot_bars(path: str, title: str, rows: Sequence[dict], panels: Sequence[Panel]) -> Path:
    """A PNG at `path` with one panel per `Panel`, a bar per row that has the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A Figure on its own Agg canvas, not pyplot: switching pyplot's backend would end a notebook's inline plots.
    fig = Figure(figsize=(4.6 * len(panels), 3.8))
    FigureCanvasAgg(fig)
    draw_bars(fig, title, rows, panels)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return Path(path)


def draw_bars(fig, title: str, rows: Sequence[dict], panels: Sequence[Panel]) -> None:
    """The panels on `fig`: a bar per row that has the panel's figure, or a line saying none has it."""
    import matplotlib

    axes = fig.subplots(1, len(panels), squeeze=False)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label, spread, missing) in zip(axes[0], (Panel(*panel) for panel in panels)):
        shown = [r for r in rows if r.get(key) is not None]
        ax.set_title(label, fontsize=10)
        if not shown:  # e.g. decode steps of a run that generates one token: say why, not an empty axis
            ax.text(0.5, 0.5, "\n".join(textwrap.wrap(missing, 34)), ha="center", va="center", fontsize=9,
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        values = [r[key] for r in shown]
        errors = None
        if spread:  # a time is never below 0: a spread wider than its bar stops there, not on a negative axis
            above = [r.get(spread) or 0.0 for r in shown]
            errors = [[min(e, v) for e, v in zip(above, values)], above]
        bars = ax.bar(range(len(shown)), values, yerr=errors, capsize=4,
                      color=[colors[i % len(colors)] for i in range(len(shown))])
        ax.bar_label(bars, labels=[bar_label(v) for v in values], padding=2, fontsize=8)
        ax.set_xticks(range(len(shown)), [r["backend"] for r in shown], rotation=20, ha="right", fontsize=8)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()


def bar_label(value: float) -> str:
    """A bar's figure in three significant digits, never in exponent form: "1119" ms, not "1.12e+03"."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
