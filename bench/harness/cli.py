"""What every bench script does with its command line: counts that must be positive, output paths checked before
minutes of measuring (a `--json` in a folder that cannot be written used to fail at the very end, with a traceback),
and nndf's usage and runtime errors as one line, `SCRIPT.py: ...` with exit 2 or 1, instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable


def seconds(text: str) -> float:
    """An argparse type: a time in seconds, zero or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be zero or more seconds")
    return value


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (rounds, batch sizes, lengths, requests)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def check_outputs(args: argparse.Namespace) -> None:
    """The script's output flags (those it has of --json, --plot, --working-dir), checked as run.py checks its own:
    a UsageError before anything runs."""
    from nndf.paths import check_output_file, check_output_folder

    check_output_file("--json", getattr(args, "json", None), "report.json")
    check_output_file("--plot", getattr(args, "plot", None), "plot.png")
    check_output_folder("--working-dir", getattr(args, "working_dir", None))


def parse_checked(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, its output flags checked: a bad one is the parser's own error (exit 2)."""
    from nndf.errors import UsageError

    args = parser.parse_args(argv)
    try:
        check_outputs(args)
    except UsageError as exc:
        parser.error(str(exc))
    return args


def run_script(name: str, body: Callable[[], int | None]) -> int:
    """`body()`'s exit code (None: 0), or one line `NAME: message` on stderr and 2 (UsageError) or 1 (HarnessError)."""
    try:
        from nndf.errors import HarnessError, UsageError
    except ImportError:  # a peer's worker, in its own environment without nndf: nothing of nndf's to catch
        return body() or 0
    try:
        code = body()
    except (UsageError, HarnessError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0 if code is None else code
