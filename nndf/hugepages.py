"""Huge pages for the memory a runtime fills while it loads: its weights, read once per decode step.

Why: a batch-1 decode step on the CPU reads every weight once and is bound by memory bandwidth. On 4 KiB pages the
hardware prefetchers stop at every page boundary and each page costs a TLB entry; on 2 MiB pages a Gemm streams
its weights faster (GPT-2 small fp32 on ONNX Runtime, 2 cores: about 5% per decode step, bench/README.md). Linux
gives anonymous memory transparent huge pages only where a program asks (`madvise` mode, the usual default) and
ONNX Runtime does not ask, so after it loads a session we ask for it: `MADV_HUGEPAGE` on the memory that appeared
during the load (so that it stays eligible) and `MADV_COLLAPSE` (Linux 6.1+) to move what is already there onto
huge pages now rather than whenever khugepaged gets to it.

Only private anonymous regions that the load filled are touched (their resident memory grew by 2 MiB or more during
it, and at least 3/4 of each is resident after, so collapsing adds few pages nobody wrote), in whole 2 MiB-aligned
stretches; no file mappings. A region counts whether it is new or one the allocator reused, as happens when a
process loads a second graph after freeing the first. Where the kernel or platform refuses (not Linux, an old kernel,
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
SMAPS = "/proc/self/smaps"
DENSE = 0.75  # the share of a region that must be resident for it to be collapsed whole


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


def anonymous_regions(smaps_text: str) -> dict[tuple[int, int], int]:
    """The private, writable, anonymous mappings of a /proc/<pid>/smaps text (the heap included, stacks not):
    [start, end) address pair -> resident bytes."""
    regions: dict[tuple[int, int], int] = {}
    current = None
    for line in smaps_text.splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            anonymous = len(fields) >= 5 and fields[1] == "rw-p" and (len(fields) == 5 or fields[5] == "[heap]")
            current = tuple(int(address, 16) for address in fields[0].split("-")) if anonymous else None
        elif current is not None and fields and fields[0] == "Rss:":
            regions[current] = int(fields[1]) * 1024
    return regions


def grown_stretches(before: dict[tuple[int, int], int], after: dict[tuple[int, int], int],
                    dense: float = DENSE) -> list[tuple[int, int]]:
    """The 2 MiB-aligned stretches of the regions the load filled: whose resident memory grew by at least a huge
    page (new regions, and old ones the allocator reused) and is at least `dense` of their size afterwards, so that
    collapsing them adds few pages that nobody wrote."""
    stretches = []
    for (start, end), resident in after.items():
        earlier = sum(old_resident * (min(end, old_end) - max(start, old_start)) // (old_end - old_start)
                      for (old_start, old_end), old_resident in before.items() if old_start < end and old_end > start)
        if resident - earlier < HUGE_PAGE or resident < dense * (end - start):
            continue
        aligned_start, aligned_end = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if aligned_end > aligned_start:
            stretches.append((aligned_start, aligned_end))
    return stretches


def _read_smaps() -> str:
    with open(SMAPS) as smaps:
        return smaps.read()


@contextmanager
def huge_pages_for_load(report: HugePageReport):
    """Run a load inside; afterwards the anonymous memory it added is put on huge pages and `report` says how much."""
    if not enabled():
        report.reason = "turned off by NNDF_HUGE_PAGES=0" if sys.platform.startswith("linux") else "not Linux"
        yield report
        return
    before = anonymous_regions(_read_smaps())
    yield report
    stretches = grown_stretches(before, anonymous_regions(_read_smaps()))
    if not stretches:
        report.reason = "the load filled no 2 MiB stretch of memory"
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
