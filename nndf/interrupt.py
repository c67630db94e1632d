"""Ctrl-C that stops one piece of work (a chat's reply) instead of the whole program.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be, which may be inside a backend's
step (an ONNX Runtime run, a TensorRT launch) whose state then has to be trusted. Here the first Ctrl-C only sets a
flag; the work asks `check()` at a point where stopping is safe (the generation loop's `on_token`, between steps)
and unwinds with `Stopped`. A second Ctrl-C before that interrupts as usual, so a stuck step can still be left.
SIGTERM is not touched (nndf.cli unwinds on it).
"""

from __future__ import annotations

import signal
import threading


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
