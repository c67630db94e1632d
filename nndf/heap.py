"""Handing the heap a build freed back to the operating system.

glibc keeps memory that many small blocks freed in its arenas for later allocations instead of returning it to the
OS. An ONNX export or a quantization allocates and frees a great many (the exporter's graphs, protobuf copies of the
weights), so after exporting GPT-2 small the process stayed about 1.1 GiB larger than a run on the graphs already
built: memory nothing uses, yet counted in the resident set that `benchmark`'s peak memory and the OS see.
`malloc_trim(0)` returns it (a few milliseconds). Other C libraries (musl, macOS, Windows) have no such call and
nothing is done there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, looked up once per process (finding the C library runs ldconfig), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_heap(collect: bool = True) -> None:
    """Give the C heap's free memory back to the OS where glibc allows; with `collect`, after a full garbage
    collection (what an export leaves is mostly reference cycles, which only a collection frees)."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def empty_tensors(module) -> None:
    """Give up the memory of a PyTorch module's parameters and buffers that is no longer to be used, even where
    references to them outlive the module. After an export they do: onnxscript's default rewrite rules are
    module-level objects whose matchers keep the last graph they matched, and that graph wraps the very parameter
    objects it was traced from (as does torch's map of the last export's proxies), so letting go of the module alone
    frees nothing. Each tensor keeps its object but holds no elements; the module must not run again."""
    import torch

    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
