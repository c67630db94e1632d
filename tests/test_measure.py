from __future__ import annotations

import math
import time

import numpy as np
import pytest

from nndf import measure
from nndf.errors import UsageError
from nndf.measure import PeakMemory, StepTimer, Timing, TimingSettings, format_bytes, time_calls


class FakeClock:
    """A perf_counter that only moves when the code under test calls `advance` (through the timed fn)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(measure.time, "perf_counter", fake)
    return fake


# --- TimingSettings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"iterations": 0}, "--iterations"),
        ({"iterations": 2.5}, "--iterations"),
        ({"number": 0}, "--number"),
        ({"warmup": -1}, "--warmup"),
        ({"duration": -0.5}, "--duration"),
        ({"duration": float("inf")}, "--duration"),
        ({"percentile": 100.5}, "--percentile"),
        ({"percentile": -1}, "--percentile"),
        ({"percentile": float("nan")}, "--percentile"),
    ],
)
def test_settings_reject_bad_values_naming_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(UsageError) as info:
        TimingSettings(**kwargs)
    message = str(info.value)
    assert message.startswith(flag + " must be ")  # as every other flag's message: "--x must be ..., got V"
    assert message.endswith(f", got {next(iter(kwargs.values()))!r}") and ". " not in message


def test_settings_accept_edges() -> None:
    s = TimingSettings(iterations=1, number=1, warmup=0, duration=0, percentile=100)
    assert s.percentile == 100
    assert TimingSettings().iterations == 10


# --- time_calls -----------------------------------------------------------------------------------------


def test_calls_are_warmup_plus_iterations_times_number(clock: FakeClock) -> None:
    calls: list[float] = []

    def fn() -> None:
        calls.append(clock())
        clock.advance(0.25)

    timing = time_calls(fn, TimingSettings(iterations=4, number=3, warmup=2))
    assert len(calls) == 2 + 4 * 3
    assert timing.samples == [0.25] * 4


def test_warmup_calls_are_not_timed(clock: FakeClock) -> None:
    durations = iter([8.0, 8.0, 0.5, 0.25, 0.125])  # two slow warm-up calls, then fast ones

    def fn() -> None:
        clock.advance(next(durations))

    timing = time_calls(fn, TimingSettings(iterations=3, number=1, warmup=2))
    assert timing.samples == [0.5, 0.25, 0.125]


def test_a_sample_is_the_mean_of_number_calls(clock: FakeClock) -> None:
    durations = iter([1.0, 3.0, 0.5, 1.5])

    def fn() -> None:
        clock.advance(next(durations))

    timing = time_calls(fn, TimingSettings(iterations=2, number=2, warmup=0))
    assert timing.samples == [2.0, 1.0]


def test_duration_keeps_sampling_past_iterations(clock: FakeClock) -> None:
    calls = 0

    def fn() -> None:
        nonlocal calls
        calls += 1
        clock.advance(0.25)

    # Each sample is 2 calls = 0.5 s of timed work; 2.0 s needs 4 samples although 1 was asked for.
    timing = time_calls(fn, TimingSettings(iterations=1, number=2, warmup=1, duration=2.0))
    assert len(timing.samples) == 4
    assert calls == 1 + 4 * 2


def test_iterations_win_when_duration_is_short(clock: FakeClock) -> None:
    timing = time_calls(lambda: clock.advance(1.0), TimingSettings(iterations=5, warmup=0, duration=0.5))
    assert len(timing.samples) == 5


def test_sync_runs_after_every_call_inside_the_timed_region(clock: FakeClock) -> None:
    events: list[str] = []

    def fn() -> None:
        events.append("call")

    def sync() -> None:
        events.append("sync")
        clock.advance(0.5)  # the "GPU" finishing must be counted

    timing = time_calls(fn, TimingSettings(iterations=2, number=2, warmup=1), sync=sync)
    assert events == ["call", "sync"] * (1 + 2 * 2)
    assert timing.samples == [0.5, 0.5]


def test_real_sleeps_are_measured_at_least_as_long() -> None:
    timing = time_calls(lambda: time.sleep(0.01), TimingSettings(iterations=3, number=2, warmup=1))
    assert len(timing.samples) == 3
    assert timing.min >= 0.009


def test_progress_bar_goes_to_stderr(clock: FakeClock, capsys: pytest.CaptureFixture[str]) -> None:
    time_calls(lambda: clock.advance(1.0), TimingSettings(iterations=3, warmup=0), progress=True, desc="bar")
    out, err = capsys.readouterr()
    assert out == ""
    assert "bar" in err


# --- Timing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0, 10, 25, 33.3, 50, 75, 90, 99, 100])
def test_percentiles_match_numpy(p: float) -> None:
    samples = [0.31, 0.12, 0.5, 0.07, 0.22, 0.9, 0.18]
    assert Timing(samples).percentile(p) == pytest.approx(float(np.percentile(samples, p)))


def test_statistics() -> None:
    t = Timing([4.0, 1.0, 3.0, 2.0])
    assert t.median == 2.5
    assert t.mean == 2.5
    assert t.min == 1.0 and t.max == 4.0
    assert t.stdev == pytest.approx(float(np.std([4.0, 1.0, 3.0, 2.0], ddof=1)))
    assert t.to_dict()["median"] == 2.5


def test_one_sample() -> None:
    t = Timing([0.5])
    assert math.isnan(t.stdev)  # unknown, not 0: one run shows no spread
    assert t.median == t.percentile(90) == t.min == t.max == 0.5


def test_no_samples_and_bad_percentile_raise() -> None:
    with pytest.raises(ValueError):
        Timing([]).median
    with pytest.raises(ValueError):
        Timing([1.0]).percentile(101)


# --- StepTimer ------------------------------------------------------------------------------------------


def test_step_timer_arithmetic(clock: FakeClock) -> None:
    timer = StepTimer()
    timer.start()
    clock.advance(2.0)  # prefill
    timer.mark()
    for step in (0.5, 0.25, 0.75):
        clock.advance(step)
        timer.mark()
    assert timer.marks == 4
    assert timer.time_to_first_token == 2.0
    assert timer.step_times == [0.5, 0.25, 0.75]
    assert timer.decode_step_median == 0.5
    assert timer.total == 3.5


def test_step_timer_callback_and_reset(clock: FakeClock) -> None:
    timer = StepTimer()
    callback = timer.mark
    timer.start()
    clock.advance(1.0)
    callback()
    clock.advance(1.0)
    callback()
    timer.start()  # a new generation forgets the old marks
    assert timer.marks == 0
    assert timer.time_to_first_token is None and timer.total is None
    clock.advance(0.25)
    callback()
    assert timer.time_to_first_token == 0.25
    assert timer.step_times == []
    assert timer.decode_step_median is None


def test_step_timer_needs_start() -> None:
    with pytest.raises(RuntimeError):
        StepTimer().mark()


# --- PeakMemory -----------------------------------------------------------------------------------------

MB = 1024 * 1024


def test_peak_memory_sees_allocation_alive_at_exit() -> None:
    with PeakMemory() as pm:
        block = np.ones(200 * MB, dtype=np.uint8)  # ones() writes every page, so they are resident
    assert block[-1] == 1
    assert pm.peak_rss_bytes - pm.baseline_rss_bytes >= 150 * MB
    assert pm.increase_bytes >= 150 * MB
    assert pm.peak_cuda_bytes is None
    assert pm.peak_bytes == pm.peak_rss_bytes
    del block


def test_peak_memory_sees_allocation_freed_inside_block() -> None:
    with PeakMemory(interval=0.001) as pm:
        block = np.ones(200 * MB, dtype=np.uint8)
        deadline = time.monotonic() + 10.0  # generous: only waits for the sampler thread to run once
        while pm.peak_rss_bytes - pm.baseline_rss_bytes < 150 * MB and time.monotonic() < deadline:
            time.sleep(0.005)
        del block
    assert pm.peak_rss_bytes - pm.baseline_rss_bytes >= 150 * MB


def test_peak_memory_without_proc_falls_back_to_rusage(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc() -> int:
        raise FileNotFoundError("/proc/self/statm")

    monkeypatch.setattr(measure, "_rss_from_proc", no_proc)
    with PeakMemory() as pm:
        pass
    assert pm.peak_rss_bytes >= pm.baseline_rss_bytes > 0


def test_cpu_device_does_not_measure_cuda() -> None:
    with PeakMemory(device="cpu") as pm:
        pass
    assert pm.peak_cuda_bytes is None


def test_format_bytes() -> None:
    assert format_bytes(512 * MB) == "512.0 MiB"
    assert format_bytes(int(1.2 * 1024 * MB)) == "1.20 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(None) == "-"
