"""Huge pages for the memory a runtime fills while it loads: its weights, read once per decode step.

Why: a batch-1 decode step on the CPU reads every weight once and is bound by memory bandwidth. On 4 KiB pages the
hardware prefetchers stop at every page boundary and each page costs a TLB entry; on 2 MiB pages a Gemm streams
its weights faster (GPT-2 small fp32 on ONNX Runtime, 2 cores: about 5% per decode step, bench/README.md). Linux
gives anonymous memory transparent huge pages only where a program asks (`madvise` mode, the usual default) and
ONNX Runtime does not ask, so after it loads a session we ask for it: `MADV_HUGEPAGE` on the memory that appeared
during the load (so that it stays eligible) and `MADV_COLLAPSE` (Linux 6.1+) to move what is already there onto
huge pages now rather than whenever khugepaged gets to it.

Only whole 2 MiB-aligned stretches of private anonymous memory that did not exist before the load are touched:
nothing a caller held before, no file mappings. Where the kernel or platform refuses (not Linux, an old kernel,
THP disabled), memory stays as it was; it is a speed-up, never needed for correctness. `NNDF_HUGE_PAGES=0` turns it
off (for measuring what it brings).
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MAPS = "/proc/self/maps"


@dataclass
class HugePageReport:
    """What a load got: bytes asked to be collapsed onto huge pages and bytes the kernel collapsed."""

    asked: int = 0
    collapsed: int = 0
    reason: str = ""  # why nothing was asked or collapsed, when so

    def describe(self) -> str:
        if not self.asked:
            return f"huge pages: none ({self.reason})"
        mib = 1 << 20
        text = f"huge pages: {self.collapsed // mib} of {self.asked // mib} MiB loaded onto 2 MiB pages"
        return f"{text} ({self.reason})" if self.reason else text


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("NNDF_HUGE_PAGES", "1") != "0"


def anonymous_regions(maps_text: str) -> list[tuple[int, int]]:
    """The private, writable, anonymous mappings of a /proc/<pid>/maps text, as [start, end) address pairs."""
    regions = []
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or len(fields) > 5 and not fields[5].startswith("[heap"):
            continue
        start, end = (int(address, 16) for address in fields[0].split("-"))
        regions.append((start, end))
    return regions


def new_huge_stretches(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned stretches of `after`'s regions that no region of `before` overlaps, as [start, end)."""
    stretches = []
    for start, end in after:
        pieces = [(start, end)]
        for old_start, old_end in before:  # subtract every old region from this one
            pieces = [part for piece_start, piece_end in pieces
                      for part in ((piece_start, min(piece_end, old_start)), (max(piece_start, old_end), piece_end))
                      if part[0] < part[1]]
        for piece_start, piece_end in pieces:
            aligned_start = -(-piece_start // HUGE_PAGE) * HUGE_PAGE
            aligned_end = piece_end // HUGE_PAGE * HUGE_PAGE
            if aligned_end > aligned_start:
                stretches.append((aligned_start, aligned_end))
    return stretches


def _read_maps() -> str:
    with open(MAPS) as maps:
        return maps.read()


@contextmanager
def huge_pages_for_load(report: HugePageReport):
    """Run a load inside; afterwards the anonymous memory it added is put on huge pages and `report` says how much."""
    if not enabled():
        report.reason = "turned off by NNDF_HUGE_PAGES=0" if sys.platform.startswith("linux") else "not Linux"
        yield report
        return
    before = anonymous_regions(_read_maps())
    yield report
    stretches = new_huge_stretches(before, anonymous_regions(_read_maps()))
    if not stretches:
        report.reason = "the load added no 2 MiB stretch of memory"
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    errors = set()
    for start, end in stretches:
        report.asked += end - start
        libc.madvise(start, end - start, MADV_HUGEPAGE)
        if libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
            report.collapsed += end - start
        else:
            errors.add(os.strerror(ctypes.get_errno()))
    if errors:
        report.reason = "the kernel refused some: " + ", ".join(sorted(errors))
