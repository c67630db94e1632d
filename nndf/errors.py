"""The two kinds of failure a user sees, so that the CLI can turn each into one sentence and an exit code.

`UsageError` is the user's input being wrong (a flag, a name, a path): exit code 2, like argparse.
`HarnessError` is a well-understood runtime failure (a model cannot be loaded offline, a backend is missing on
this machine): exit code 1. Anything else is a bug and keeps its traceback. `run_command` turns them, Ctrl-C and
SIGTERM into what both command lines (run.py and convert_model) print and return.
"""

import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable


class UsageError(ValueError):
    """Bad input from the user: the message names what was wrong and what is allowed."""

    exit_code = 2


class HarnessError(RuntimeError):
    """A failure with a known cause that is not the user's typing: the message says what to do."""

    exit_code = 1


class OneSentenceParser(argparse.ArgumentParser):
    """argparse, but a usage error is one sentence and exit 2 (a UsageError) without the usage dump."""

    def error(self, message: str):
        raise UsageError(message)


class Terminated(BaseException):
    """SIGTERM (`timeout`, `kill`, a job scheduler) as an exception, so that `finally` blocks remove temporary files."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_unwinds():
    """Without this, SIGTERM ends the process at once and a half-built export stays behind as a `.tmp` folder."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# a disk that cannot take what the run writes: the user's machine, not a bug, and the unwinding removed what was
# half-written (nndf.workspace), so the sentence says where, and what to do
_STORAGE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system", errno.EACCES: "permission denied"}
_ELSEWHERE = "write elsewhere (--working-dir, -o, --json, --plot)"


def _nearest_existing(path: str) -> Path:
    """The deepest folder of `path` that still exists (its temporary files are gone once the run has unwound)."""
    place = Path(path)
    while not place.is_dir() and place != place.parent:
        place = place.parent
    return place


def refused_by_the_disk(exc: BaseException) -> bool:
    """Whether `exc` is a write that the disk refused (full, over quota, read-only, another user's folder): never the
    data's fault."""
    return isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS


def storage_sentence(exc: OSError) -> str | None:
    """One sentence for a write that the disk refused (full, over quota, read-only), or None for any other error."""
    if not refused_by_the_disk(exc):
        return None
    what = _STORAGE_ERRNOS[exc.errno]
    target = exc.filename2 or exc.filename  # a copy names its source first, its destination second
    where = f" in {_nearest_existing(os.fsdecode(target))}" if target else ""
    if exc.errno == errno.EACCES:  # a read as well as a write (an unreadable --torch-dir): nothing said of writes
        return f"{what}{where}: check its permissions, or for an output {_ELSEWHERE}"
    advice = f"free some space or {_ELSEWHERE}" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else _ELSEWHERE
    return f"{what}{where}; nothing half-written was kept: {advice}"


def run_command(body: Callable[[], int]) -> int:
    """A command's exit code: its own, or one line on stderr instead of a traceback for a failure the user can act
    on (a UsageError or HarnessError: "error: ...", Ctrl-C: "interrupted", SIGTERM: "terminated", a disk that
    refuses a write: where, and what to do); temporary files go with the unwinding. A reader that closes the pipe
    early (`run.py list | head -1`) ends the command quietly, as it ends any shell tool: exit 141 (128 + SIGPIPE)."""
    with sigterm_unwinds():
        try:
            return body()
        except (UsageError, HarnessError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except Terminated:
            print("terminated", file=sys.stderr)
            return 128 + signal.SIGTERM
        except BrokenPipeError:
            # what is still buffered for the closed pipe would fail again at exit: point stdout at nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + 13  # SIGPIPE
        except OSError as exc:
            sentence = storage_sentence(exc)
            if sentence is None:
                raise
            print(f"error: {sentence}", file=sys.stderr)
            return 1
