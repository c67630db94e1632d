"""nndf.hugepages: the memory a load adds goes onto 2 MiB pages, and nothing else is touched."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from nndf import hugepages
from nndf.hugepages import HugePageReport, anonymous_regions, grown_stretches, huge_pages_for_load

MIB = 1 << 20

SMAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 08:01 1234   /usr/bin/python3.11
Size:                132 kB
Rss:                 132 kB
55d0c1000000-55d0c1400000 rw-p 00000000 00:00 0      [heap]
Size:               4096 kB
Rss:                1024 kB
Private_Dirty:      1024 kB
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
Size:              10240 kB
Rss:               10240 kB
VmFlags: rd wr mr mw me ac
7f0000a00000-7f0000c00000 rw-p 00000000 08:01 99     /tmp/weights.bin
Rss:                2048 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
Rss:                  12 kB
"""


def test_anonymous_regions_are_private_writable_and_unnamed_or_heap_with_their_resident_bytes():
    assert anonymous_regions(SMAPS) == {(0x55D0C1000000, 0x55D0C1400000): 1 * MIB,
                                        (0x7F0000000000, 0x7F0000A00000): 10 * MIB}


def test_only_regions_the_load_filled_are_taken_in_aligned_stretches():
    after = {(0, 11 * MIB + 4096): 11 * MIB, (20 * MIB + 4096, 23 * MIB): 3 * MIB - 4096}
    # a new region, filled: its whole aligned part [0, 10 MiB); the second holds no whole aligned page
    assert grown_stretches({}, after) == [(0, 10 * MIB)]
    # the same region, resident before: nothing grew
    assert grown_stretches({(0, 11 * MIB + 4096): 11 * MIB}, after) == []
    # an old region the allocator reused (resident 1 MiB before, 11 after): taken
    assert grown_stretches({(0, 11 * MIB + 4096): 1 * MIB}, after) == [(0, 10 * MIB)]
    # grown, but mostly empty after (a large heap with a small new chunk): not collapsed, as that would fill it
    assert grown_stretches({}, {(0, 64 * MIB): 8 * MIB}) == []
    # grown by less than a huge page: left alone
    assert grown_stretches({(0, 4 * MIB): 3 * MIB}, {(0, 4 * MIB): 4 * MIB}) == []
    # regions merged since: the old region's residence counts in proportion to the overlap
    assert grown_stretches({(0, 4 * MIB): 4 * MIB}, {(0, 8 * MIB): 8 * MIB}) == [(0, 8 * MIB)]


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


def _private_anonymous(size: int) -> tuple[mmap.mmap, np.ndarray]:
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memory, np.frombuffer(memory, dtype=np.float32)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
@pytest.mark.parametrize("region", ["new", "reused"])
def test_a_load_lands_on_huge_pages(region):
    """What a load fills (here 64 MiB standing for weights, in a mapping made during the load or in one that
    existed before it, as memory the allocator reuses) is asked onto huge pages, and where the kernel has
    MADV_COLLAPSE (Linux 6.1+) it is on them right after, as smaps shows; the data is unchanged."""
    report = HugePageReport()
    memory = weights = None
    if region == "reused":
        memory, weights = _private_anonymous(64 * MIB)
    with huge_pages_for_load(report):
        if region == "new":
            memory, weights = _private_anonymous(64 * MIB)
        weights[:] = 1.5
    start = weights.ctypes.data
    assert report.asked >= 60 * MIB
    if report.collapsed == 0:
        pytest.skip(f"this kernel collapses nothing ({report.describe()})")
    assert _huge_kib_over(start, start + weights.nbytes) * 1024 >= 60 * MIB
    assert float(weights.sum()) == 1.5 * weights.size  # the data moved with its pages
    assert "MiB loaded onto 2 MiB pages" in report.describe()
    del weights
    memory.close()


def test_enabled_follows_platform_and_switch(monkeypatch):
    monkeypatch.delenv("NNDF_HUGE_PAGES", raising=False)
    assert hugepages.enabled() == sys.platform.startswith("linux")
