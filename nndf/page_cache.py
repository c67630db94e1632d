"""Files we wrote or read whole, written out and dropped from the page cache, so that a session maps them as it
maps files it finds on disk.

Why: ONNX Runtime maps a graph's external data file, and a decoder's embedding table stays mapped (its Gather reads
rows of it as tokens come). On the Linux 6.18 / ext4 machine measured, pages that entered the cache through `write`
or `read` (an export writing the file, a quantizer loading it with `onnx.load`, a `cp`) came back mapped far beyond
the rows touched (likely the large page-cache folios such writes and reads make, ext4 has them since 6.16, mapped
whole on a fault; what was measured is the effect): a GPT-2 small session on a graph whose data
file had just been written or read counted 248-251 MiB of it resident (peak 810-813 MiB), against 129 MiB (peak 691)
once the file was dropped from the cache and read back through the mapping, as every later run reads it. So a run's
first load after an export, and a benchmark right after one, peaked 17% higher than every later run. Dropping the
files we have just written, and the graph a derived graph was just read from, makes the first run the same as the
rest; loading a dropped GPT-2 graph took 2.67 s against 2.57-2.90 s from the cache (measured 2026-11-29).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


def drop_from_page_cache(files: Iterable[str | os.PathLike]) -> None:
    """Write each file's dirty pages to disk and drop its pages from the page cache (clean pages that no process maps;
    where a file system keeps its pages, as tmpfs does, nothing changes). A missing file is skipped."""
    if not hasattr(os, "posix_fadvise"):  # not Linux: no such large folios to avoid either
        return
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_folder_from_page_cache(folder: str | os.PathLike) -> None:
    """`drop_from_page_cache` for every file directly in `folder`."""
    drop_from_page_cache(path for path in Path(folder).iterdir() if path.is_file())
