"""One result type for every action, so that every report looks the same on screen and in JSON.

An action (benchmark, accuracy check, export, ...) builds a `Result` of raw values: numbers stay numbers
so that the JSON can be compared and plotted later, and formatting (digits, units, "-" for a missing
value) happens only when the table is rendered for a person.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from nndf.workspace import atomic_write_json

_GAP = "  "


@dataclass(frozen=True)
class Column:
    """One column of a table: which row key it shows, its header, how to format a value, and its unit."""

    key: str
    header: str
    fmt: str = "{}"
    unit: str = ""
    width: int | None = None  # a longer cell is cut at a word, " ..." marking the cut (JSON keeps the whole value)

    @property
    def formats_numbers(self) -> bool:
        """Whether the format is a number's ("{:.1f}", "{:.0%}", "{:d}"): such a column is right-aligned even when
        no row has a value ("-" under numbers everywhere)."""
        return re.fullmatch(r"\{:[^{}]*[dfFeEgG%n]\}", self.fmt) is not None

    @property
    def label(self) -> str:
        """The header as shown: `header (unit)` when the column has a unit."""
        return f"{self.header} ({self.unit})" if self.unit else self.header

    def format(self, value: object) -> str:
        """The cell text for a raw value; None and NaN (not measured, not applicable, nothing to average) are "-".

        A value the format does not fit (say an "error" string in a "{:.2f}" column) is shown as plain text
        rather than losing the whole report; line breaks in text (a generated reply) show as \\n, so that a row
        stays one line.
        """
        if value is None or (_is_number(value) and math.isnan(value)):  # numpy's float32 NaN too
            return "-"
        try:
            text = self.fmt.format(value)
        except (ValueError, TypeError, IndexError, KeyError):
            text = str(value)
        if _is_number(value) and text.endswith("."):  # "{:#.6g}" keeps its digits but writes 100000 as "100000."
            text = text[:-1]
        text = text.replace("\r", "\\r").replace("\n", "\\n")
        if self.width is not None and len(text) > self.width:
            cut = textwrap.shorten(text, self.width, placeholder=" ...")  # at a word, else (one long word) anywhere
            text = cut if cut != "..." else text[:self.width - 4] + " ..."
        return text


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _context_text(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(value)


def _jsonable(value: object) -> object:
    """Raw values as plain JSON types: numpy scalars and arrays become numbers and lists, paths strings.

    NaN and infinities become null, as strict JSON parsers need (Python's own writes NaN, which they reject).
    Anything else is left as is, so that a value that cannot be serialised fails loudly in `write_json`.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return value


@dataclass
class Result:
    """The outcome of one action: a titled table of raw rows, the context that produced it, and notes.

    `context` (model, variant, settings, ...) always goes into the JSON and is printed above the table only
    when verbose, so the default screen output stays one table per action.
    """

    action: str
    title: str
    columns: list[Column]
    rows: list[dict]
    context: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def context_lines(self, shown: dict | None = None) -> list[str]:
        """The context as `key: value` lines, less the entries `shown` prints above them already."""
        return [f"{key}: {_context_text(value)}" for key, value in self.context.items()
                if (shown or {}).get(key, object()) != value]

    def render(self, verbose: bool = False, shown: dict | None = None) -> str:
        """The table as text: title, (context when verbose, less the entries `shown` above it already, as --info's
        settings block), header, dashes, rows, then the notes.

        A column whose values are all numbers is right-aligned, header included, and so is a column of a number's
        format whose rows have none ("-" each); any other column is left-aligned. Every column is padded to its widest cell.
        """
        lines = [self.title] + (self.context_lines(shown) if verbose else [])
        cells = [[col.format(row.get(col.key)) for col in self.columns] for row in self.rows]
        widths = [max([len(col.label)] + [len(r[i]) for r in cells]) for i, col in enumerate(self.columns)]
        numeric = [
            (col.formats_numbers or any(_is_number(row.get(col.key)) for row in self.rows))
            and all(row.get(col.key) is None or _is_number(row.get(col.key)) for row in self.rows)
            for col in self.columns
        ]

        def line(texts: list[str]) -> str:
            padded = [t.rjust(w) if num else t.ljust(w) for t, w, num in zip(texts, widths, numeric)]
            return _GAP.join(padded).rstrip()

        lines.append(line([col.label for col in self.columns]))
        lines.append(_GAP.join("-" * w for w in widths))
        lines += [line(r) for r in cells]
        lines += list(self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The result as JSON-able data, with rows of raw values (not the formatted strings of `render`)."""
        return {
            "action": self.action,
            "title": self.title,
            "context": _jsonable(self.context),
            "columns": [{"key": c.key, "header": c.header, "unit": c.unit} for c in self.columns],
            "rows": [_jsonable(row) for row in self.rows],
            "notes": list(self.notes),
        }


def write_json(results: Sequence[Result], path: str | os.PathLike) -> Path:
    """Write `{"results": [...]}` atomically: an interrupted or failed write leaves no partial file."""
    return atomic_write_json(path, _jsonable({"results": [r.to_dict() for r in results]}))
