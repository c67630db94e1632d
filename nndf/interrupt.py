"""Ctrl-C that stops one piece of work (a chat's reply) instead of the whole program.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be, which may be inside a backend's
step (an ONNX Runtime run, a TensorRT launch) whose state then has to be trusted. Here the first Ctrl-C only sets a
flag; the work asks `check()` at a point where stopping is safe (the generation loop's `on_token`, between steps)
and unwinds with `Stopped`. A second Ctrl-C before that interrupts as usual, so a stuck step can still be left.
SIGTERM is not touched (nndf.cli unwinds on it).

An action that measures several backends in turn keeps what it measured when Ctrl-C comes (`KeepOnInterrupt`): its
tables show the backends done, say where it stopped, and the command still exits as interrupted (`Interrupted`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable


class Stopped(Exception):
    """The user asked (Ctrl-C) to stop the work in progress."""


class StopOnInterrupt:
    """`with StopOnInterrupt() as stop: ... stop.check() ...`: Ctrl-C inside the block makes `check()` raise
    `Stopped`. Outside the main thread (where signals cannot be handled) it changes nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "StopOnInterrupt":
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # the second Ctrl-C: the work did not reach a check; interrupt it where it is
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise Stopped()

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after some of an action's work was measured: `results` are the tables of what was (their notes say
    where it stopped). Still a KeyboardInterrupt, so a script calling `nndf.run` stops as it would; the command line
    prints and writes them before it exits 130."""

    def __init__(self, results: list) -> None:
        super().__init__("interrupted; the results measured before it are in .results")
        self.results = results


class KeepOnInterrupt:
    """Ctrl-C in an action's loop over backends (hours of LAMBADA or lm-eval, minutes of benchmarks) used to lose
    every table. `each` runs each backend's work in `guard`: Ctrl-C there, once something is measured, ends the loop
    instead of the command; the action builds its tables from what was measured, adds `notes()`, and calls
    `finish`, which raises `Interrupted` with them."""

    def __init__(self) -> None:
        self.during: str | None = None  # what was being done when Ctrl-C came
        self.missing = ""  # what the tables lack for it

    @property
    def stopped(self) -> bool:
        return self.during is not None

    @contextlib.contextmanager
    def guard(self, what: str, kept: bool, missing: str = ""):
        """Run the block; Ctrl-C inside it is remembered (`what`: "benchmarking onnxrt"; `missing`: what the tables
        then lack) where `kept` (something measured already), else raised as usual."""
        try:
            yield
        except KeyboardInterrupt:
            if not kept:
                raise
            self.during, self.missing = what, missing

    def each(self, items: list, doing: str, undone: str, work: Callable, name: Callable[[object], str]) -> list:
        """`work(item)` for each item in turn, in a list; Ctrl-C ends the loop with the results so far (after the
        first), remembering what was being done ("{doing} {name}") and which items were not ("{undone}: ...")."""
        done = []
        for index, item in enumerate(items):
            left = f"{undone}: {', '.join(name(i) for i in items[index:])}"
            with self.guard(f"{doing} {name(item)}", kept=bool(done), missing=left):
                done.append(work(item))
            if self.stopped:
                break
        return done

    def notes(self) -> list[str]:
        """The note of an interrupted table (where Ctrl-C came and what is missing for it), or none."""
        return [f"interrupted (Ctrl-C) while {self.during}: {self.missing}."] if self.stopped else []

    def finish(self, results: list) -> list:
        """`results`, or `Interrupted` carrying them when Ctrl-C ended the loop (each result's context, and so its
        JSON, then says `interrupted`: what was being done)."""
        if self.stopped:
            for result in results:
                result.context["interrupted"] = self.during
            raise Interrupted(results)
        return results
