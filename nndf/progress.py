"""Progress for people: lines on stderr (stdout stays the results), and a ticker for long silent work.

An ONNX export of GPT-2 takes half a minute and a quantization as long, during which the libraries print nothing;
`ticking` says every few seconds how long it has been, so that a first run does not look hung.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def ticking(doing: str, every: float = 10.0):
    """Inside the block, a line `  ... DOING: N s` every `every` seconds (none when it ends sooner)."""
    stop = threading.Event()
    started = time.perf_counter()

    def tick() -> None:
        while not stop.wait(every):
            say(f"  ... {doing}: {time.perf_counter() - started:.0f} s")

    ticker = threading.Thread(target=tick, name="progress-ticker", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """`1 reply`, `2 replies`: a count with its noun in the right number, for lines a person reads."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"
