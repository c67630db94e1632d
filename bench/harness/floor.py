"""The memory floor, as an engine of its own: the time no decode step of the fp32 model can beat on this machine.

A batch-1 decode step reads every weight once, so it takes at least the fp32 weights' bytes over the bandwidth at
which the cores read memory. Issue 21's goal puts GPT-2's fp32 step within 1.25x of that floor ("497 MB of weights
at the 33 GB/s that two threads read here").

That bandwidth moves while we measure: on the 2-core Zen 4 guest the same sum of the same 1 GiB read 31-37 GB/s in
most rounds and 65-68 in a few, switching within seconds, for reasons outside the guest's view. So it is measured
in the same rounds as the engines, turn by turn with them. Each `generate` request times `PASSES` sums of a
`BUFFER_BYTES` float32 buffer with the bench's threads (`torch.sum`: one streaming pass, no writes), about half a
second in all, and answers with their median as a decode step of bytes / bandwidth; first token and tokens stay
empty. A median over a stretch as long as an engine's decode is what an engine's step is too. The fastest pass would
catch the fast moments alone: a first version took it, and in one run the floor read 61 GB/s while the engines in
the same rounds ran at the usual speed. The report then takes the median over rounds, as for every engine.

The buffer lies on 2 MiB pages, as our onnxrt weights do (`nndf.hugepages`): on 4 KiB pages the prefetchers stop at
every page boundary, and the same sum read 4% slower (alternating the two 12 times).

The bytes are the weights folder's: 4 bytes for every element of every tensor in its safetensors files (stored in
whatever dtype), a tied head counted once, as `save_pretrained` stores it. Standard library only at import time.
"""

from __future__ import annotations

import json
import math
import statistics
import struct
import time
from pathlib import Path

ENGINE = "floor"
HELP = ("the memory floor: the fp32 weights' bytes over the read bandwidth of this machine, timed in every round "
        "beside the engines (the median of 15 torch.sum passes over 1 GiB on 2 MiB pages, the bench's threads)")
BUFFER_BYTES = 1 << 30  # far beyond any CPU's last-level cache
PASSES = 15  # about half a second at 33 GB/s


def weight_bytes(folder: Path) -> int:
    """4 bytes per element of every tensor in `folder`'s *.safetensors files (their headers alone are read)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no .safetensors file to count the weights of")
    elements = 0
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        elements += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return 4 * elements


class FloorRunner:
    """The worker side of the floor engine: a `generate` request times the read bandwidth (module docstring)."""

    encoder = None

    def __init__(self, args, buffer_bytes: int = BUFFER_BYTES) -> None:
        import torch
        from nndf import hugepages

        if args.threads:
            torch.set_num_threads(args.threads)
        self.bytes = weight_bytes(Path(args.weights_dir))
        pages = hugepages.HugePageReport()
        with hugepages.huge_pages_for_load(pages):
            self.buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        self.buffer.sum()  # the first pass pays for anything left lazy
        self.versions = {"weights_mb": round(self.bytes / 1e6, 1), "buffer_mib": buffer_bytes >> 20,
                         "torch_threads": torch.get_num_threads(), "pages": pages.describe()}
        self.commands = {"generate": self.generate, "memory": self.memory}

    def read_gb_s(self) -> float:
        """The median of `PASSES` sums of the buffer, in GB/s."""
        times = []
        for _ in range(PASSES):
            started = time.perf_counter()
            self.buffer.sum()
            times.append(time.perf_counter() - started)
        return self.buffer.numel() * 4 / statistics.median(times) / 1e9

    def generate(self, command: dict) -> dict:
        """A decode step at the floor: the weights' bytes at this round's bandwidth; as many steps as asked, so
        that tok/s is batch / step (every row of a batch shares the step's one read of the weights)."""
        bandwidth = self.read_gb_s()
        step = self.bytes / (bandwidth * 1e9)
        steps = int(command["new_tokens"])
        return {"ttft_s": None, "step_median_s": step, "e2e_s": step * steps, "marks": steps, "tokens": None,
                "read_gb_s": bandwidth}

    def memory(self, command: dict) -> dict:
        """No figures: the buffer is the probe's, not a model's memory."""
        return {"peak_rss_bytes": None, "rss_bytes": None, "ru_maxrss_bytes": None, "rss_file_bytes": None}


def note(report: dict, batch: int) -> str | None:
    """The line under a batch's table that says what the floor row is: the bytes, and the bandwidth its rounds read
    (a `Bench.table_notes` hook)."""
    reads = [run["read_gb_s"] for run in report.get("raw", {}).get("rounds", {}).get(batch, {}).get(ENGINE, [])
             if run.get("read_gb_s")]
    weights = report["engines"].get(ENGINE, {}).get("versions", {}).get("weights_mb")
    if not reads or weights is None:
        return None
    return (f"  {ENGINE}: {weights:.1f} MB of fp32 weights per step at {statistics.median(reads):.1f} GB/s (median "
            f"over rounds of each round's median of {PASSES} sums of 1 GiB; {min(reads):.1f} to {max(reads):.1f})")
