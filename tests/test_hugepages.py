"""nndf.hugepages: the memory a load adds goes onto 2 MiB pages, and nothing else is touched."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from nndf import hugepages
from nndf.hugepages import HUGE_PAGE, HugePageReport, anonymous_regions, huge_pages_for_load, new_huge_stretches

MIB = 1 << 20

MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 08:01 1234   /usr/bin/python3.11
55d0c1000000-55d0c1400000 rw-p 00000000 00:00 0      [heap]
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
7f0000a00000-7f0000c00000 rw-p 00000000 08:01 99     /tmp/weights.bin
7f0001000000-7f0001100000 r--p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
"""


def test_anonymous_regions_are_private_writable_and_unnamed_or_heap():
    assert anonymous_regions(MAPS) == [(0x55D0C1000000, 0x55D0C1400000), (0x7F0000000000, 0x7F0000A00000)]


def test_only_aligned_stretches_that_are_new_are_taken():
    before = [(0, 3 * MIB)]
    after = [(0, 11 * MIB + 4096), (20 * MIB + 4096, 23 * MIB)]
    # the old 0-3 MiB are left out, 3-4 MiB is not a whole aligned page, 4-10 MiB are three pages, the first
    # region's tail is short of a page, and the second region (20 MiB + 4 KiB to 23 MiB) holds no whole aligned page
    assert new_huge_stretches(before, after) == [(4 * MIB, 10 * MIB)]
    assert new_huge_stretches([], [(HUGE_PAGE, 3 * HUGE_PAGE)]) == [(HUGE_PAGE, 3 * HUGE_PAGE)]
    assert new_huge_stretches([(0, 64 * MIB)], [(0, 64 * MIB)]) == []  # nothing new: nothing asked
    # a region that grew around an old one keeps the old part out
    assert new_huge_stretches([(4 * MIB, 6 * MIB)], [(0, 10 * MIB)]) == [(0, 4 * MIB), (6 * MIB, 10 * MIB)]


def test_turned_off_asks_nothing(monkeypatch):
    monkeypatch.setenv("NNDF_HUGE_PAGES", "0")
    report = HugePageReport()
    with huge_pages_for_load(report):
        kept = np.ones(8 * MIB // 8)
    assert report.asked == 0 and "NNDF_HUGE_PAGES=0" in report.describe() and kept.sum() == kept.size


def _huge_kib_over(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                low, high = (int(address, 16) for address in first.split("-"))
                inside = low < end and high > start
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_a_load_lands_on_huge_pages():
    """What a load allocates and fills (here 64 MiB standing for weights) is asked onto huge pages, and where the
    kernel has MADV_COLLAPSE (Linux 6.1+) it is on them right after, as smaps shows."""
    report = HugePageReport()
    with huge_pages_for_load(report):
        weights = np.full(64 * MIB // 4, 1.5, dtype=np.float32)
    start = weights.ctypes.data
    assert report.asked >= 60 * MIB
    if report.collapsed == 0:
        pytest.skip(f"this kernel collapses nothing ({report.describe()})")
    assert _huge_kib_over(start, start + weights.nbytes) * 1024 >= 60 * MIB
    assert float(weights.sum()) == 1.5 * weights.size  # the data moved with its pages
    assert "MiB loaded onto 2 MiB pages" in report.describe()


def test_enabled_follows_platform_and_switch(monkeypatch):
    monkeypatch.delenv("NNDF_HUGE_PAGES", raising=False)
    assert hugepages.enabled() == sys.platform.startswith("linux")
