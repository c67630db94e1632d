"""How every backend is timed and how its memory is measured, in one place.

PyTorch, ONNX Runtime and TensorRT are compared with the same code so that a difference in the report is a
difference between backends, not between three ways of timing them:

- `time_calls` times a callable the same way everywhere: untimed warm-up calls (lazy initialisation, caches,
  autotuning), then samples that are each the mean of `number` back-to-back calls (to average out timer
  resolution for very short calls), for at least `iterations` samples and at least `duration` seconds.
- `StepTimer` marks every generated token of ONE generation, so time-to-first-token and the per-step decode
  time come from the same run instead of from two runs that could differ.
- `PeakMemory` reports the peak memory of this process (and of the GPU when asked) during a block.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from nndf.errors import UsageError


def _check_whole(flag: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{flag} must be a whole number of at least {minimum}, got {value!r}")


@dataclass(frozen=True)
class TimingSettings:
    """The timing flags of the CLI, checked when built so that a bad value fails before any model loads.

    `iterations` is the minimum number of samples, `number` the calls averaged into one sample, `warmup` the
    untimed calls before sampling, `duration` the minimum seconds of timed work (0: exactly `iterations`
    samples) and `percentile` the percentile reported as the headline latency (50: the median).
    """

    iterations: int = 10
    number: int = 1
    warmup: int = 3
    duration: float = 0.0
    percentile: float = 50.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise UsageError naming the CLI flag of the first setting that is out of range."""
        _check_whole("--iterations", self.iterations, 1)
        _check_whole("--number", self.number, 1)
        _check_whole("--warmup", self.warmup, 0)
        if (
            isinstance(self.duration, bool)
            or not isinstance(self.duration, (int, float))
            or not math.isfinite(self.duration)
            or self.duration < 0
        ):
            raise UsageError(f"--duration must be a finite number of seconds >= 0, got {self.duration!r}")
        if (
            isinstance(self.percentile, bool)
            or not isinstance(self.percentile, (int, float))
            or not 0 <= self.percentile <= 100
        ):
            raise UsageError(f"--percentile must be a number from 0 to 100, got {self.percentile!r}")


@dataclass
class Timing:
    """Timed samples in seconds, each the mean time of one call, with the statistics a report needs."""

    samples: list[float] = field(default_factory=list)

    def _sorted(self) -> list[float]:
        if not self.samples:
            raise ValueError("Timing has no samples.")
        return sorted(self.samples)

    def percentile(self, p: float) -> float:
        """The p-th percentile with linear interpolation between the closest ranks (numpy's default)."""
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be from 0 to 100, got {p!r}.")
        s = self._sorted()
        rank = (len(s) - 1) * p / 100.0
        lo = math.floor(rank)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (rank - lo)

    @property
    def median(self) -> float:
        return self.percentile(50.0)

    @property
    def mean(self) -> float:
        self._sorted()
        return statistics.fmean(self.samples)

    @property
    def stdev(self) -> float:
        """Sample standard deviation (n - 1); NaN for a single sample, whose spread is unknown (tables show it as
        "-" and JSON as null, where 0 would claim a perfectly steady run)."""
        self._sorted()
        return statistics.stdev(self.samples) if len(self.samples) > 1 else math.nan

    @property
    def min(self) -> float:
        return self._sorted()[0]

    @property
    def max(self) -> float:
        return self._sorted()[-1]

    def to_dict(self) -> dict:
        """The samples and their statistics, JSON-able, for a result's raw data."""
        return {
            "samples": list(self.samples),
            "median": self.median,
            "mean": self.mean,
            "stdev": self.stdev,
            "min": self.min,
            "max": self.max,
        }


def time_calls(
    fn: Callable[[], object],
    settings: TimingSettings,
    *,
    sync: Callable[[], None] | None = None,
    progress: bool = False,
    desc: str | None = None,
) -> Timing:
    """Time `fn` as `settings` says and return one sample (seconds per call) per group of `number` calls.

    `sync` is called after every call, warm-up included, and inside the timed region: CUDA work is
    asynchronous, so without it the clock would stop before the GPU has finished. Sampling continues past
    `iterations` until the timed samples add up to at least `duration` seconds. `progress` shows a tqdm bar
    on stderr, so stdout stays clean for the report.
    """
    settings.validate()
    for _ in range(settings.warmup):
        fn()
        if sync is not None:
            sync()

    bar = None
    if progress:
        from tqdm import tqdm

        # cleared from a terminal when done; kept, with its newline, in a log file (a cleared bar there leaves its
        # text without one, and the report's first line would follow it on the same line with `2>&1`)
        bar = tqdm(total=settings.iterations, desc=desc, file=sys.stderr, leave=not sys.stderr.isatty())
    samples: list[float] = []
    timed = 0.0
    try:
        while len(samples) < settings.iterations or timed < settings.duration:
            start = time.perf_counter()
            for _ in range(settings.number):
                fn()
                if sync is not None:
                    sync()
            elapsed = time.perf_counter() - start
            timed += elapsed
            samples.append(elapsed / settings.number)
            if bar is not None:
                if len(samples) > bar.total:
                    bar.total = len(samples)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return Timing(samples)


class StepTimer:
    """Times one generation token by token: `start()` before the prefill, `mark()` after each chosen token.

    The first mark ends the prefill (time to first token); the gaps between later marks are decode steps.
    `mark` takes no arguments so it can be handed to a generation loop as a callback. On a CUDA `device` the marks
    are CUDA events recorded on the stream, so that timing a step neither waits for the GPU nor stops the loop
    from queueing the next step; the figures are read once the last event has completed.
    """

    def __init__(self, device: object | None = None) -> None:
        self._cuda = device is not None and str(device).startswith("cuda")
        self._start = None
        self._marks: list = []
        self._encoded = None

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, a, b) -> float:
        if not self._cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1000.0

    def start(self) -> None:
        """Begin a new generation; forgets the marks of the previous one."""
        self._marks = []
        self._encoded = None
        self._start = self._now()

    def mark_encoded(self) -> None:
        """Record that an encoder-decoder model's encoder (and cross-attention cache) is done."""
        if self._start is None:
            raise RuntimeError("StepTimer.mark_encoded() was called before start().")
        self._encoded = self._now()

    @property
    def encoder_time(self) -> float | None:
        """Seconds from start to the encoder's end, or None when nothing was encoded (decoder-only models)."""
        return None if self._encoded is None else self._seconds(self._start, self._encoded)

    def mark(self) -> None:
        """Record that one more token has been chosen."""
        if self._start is None:
            raise RuntimeError("StepTimer.mark() was called before start().")
        self._marks.append(self._now())

    @property
    def marks(self) -> int:
        return len(self._marks)

    @property
    def time_to_first_token(self) -> float | None:
        if not self._marks:
            return None
        return self._seconds(self._start, self._marks[0])

    @property
    def step_times(self) -> list[float]:
        return [self._seconds(a, b) for a, b in zip(self._marks, self._marks[1:])]

    @property
    def decode_step_median(self) -> float | None:
        steps = self.step_times
        return statistics.median(steps) if steps else None

    @property
    def total(self) -> float | None:
        if not self._marks:
            return None
        return self._seconds(self._start, self._marks[-1])


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (what a new allocation can get without swapping), else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _rss_from_proc() -> int:
    """Resident set size now, from /proc/self/statm (the second field, in pages)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_from_rusage() -> int:
    """The process's lifetime peak RSS: ru_maxrss is kilobytes on Linux but bytes on macOS."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


class PeakMemory:
    """Peak memory of this process during a `with` block, so a benchmark can report it for each backend.

    A daemon thread samples the resident set size every `interval` seconds, plus once at enter and once at
    exit, so an allocation still alive at exit is always seen and a short-lived one is seen if it lasts
    longer than about one interval. Without /proc (macOS) the fallback is ru_maxrss, which is the peak of the
    whole process lifetime, so it can only over-report. With `device` naming CUDA (and CUDA available),
    the peak memory allocated by torch on that device is measured too.
    """

    def __init__(self, interval: float = 0.002, device: object | None = None) -> None:
        self.interval = interval
        self.device = device
        self.baseline_rss_bytes: int | None = None
        self.peak_rss_bytes: int | None = None
        self.peak_cuda_bytes: int | None = None
        self._read: Callable[[], int] = _rss_from_proc
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._torch = None

    def _sample(self) -> None:
        rss = self._read()
        if self.peak_rss_bytes is None or rss > self.peak_rss_bytes:
            self.peak_rss_bytes = rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._sample()
            except OSError:
                return

    def _cuda_device(self) -> bool:
        if self.device is None or not str(self.device).startswith("cuda"):
            return False
        import torch

        if not torch.cuda.is_available():
            return False
        self._torch = torch
        return True

    def __enter__(self) -> PeakMemory:
        try:
            self._read = _rss_from_proc
            baseline = self._read()
        except OSError:
            self._read = _rss_from_rusage
            baseline = self._read()
        self.baseline_rss_bytes = self.peak_rss_bytes = baseline
        self.peak_cuda_bytes = None
        self._torch = None
        if self._cuda_device():
            self._torch.cuda.reset_peak_memory_stats(self.device)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="PeakMemory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._sample()
        if self._torch is not None:
            self._torch.cuda.synchronize(self.device)
            self.peak_cuda_bytes = int(self._torch.cuda.max_memory_allocated(self.device))

    @property
    def peak_bytes(self) -> int | None:
        """The CUDA peak when it was measured (the GPU is what the model lives on), else the RSS peak."""
        return self.peak_cuda_bytes if self.peak_cuda_bytes is not None else self.peak_rss_bytes

    @property
    def increase_bytes(self) -> int | None:
        """How far the RSS peak rose above the RSS at enter: the block's own share of the peak."""
        if self.peak_rss_bytes is None or self.baseline_rss_bytes is None:
            return None
        return self.peak_rss_bytes - self.baseline_rss_bytes


def format_bytes(n: float | None) -> str:
    """A byte count for humans in binary units: "512 B", "1.5 KiB", "512.0 MiB", "1.20 GiB"; None is "-"."""
    if n is None:
        return "-"
    size = abs(n)
    if size < 1024:
        return f"{int(n)} B"
    if size < 1024**2:
        return f"{n / 1024:.1f} KiB"
    if size < 1024**3:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024**3:.2f} GiB"
