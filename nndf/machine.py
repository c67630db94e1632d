"""The machine a result was measured on, in one line for reports and results: figures, and ratios between engines,
carry over only between machines whose CPUs agree on the flags that choose the kernels (bench/README.md: the same
code, measured on three kinds of 2-core guest, passed and failed different goals of issue 21)."""

from __future__ import annotations

import os

from nndf.export.cpu_int8 import cpu_flags

# The x86 / ARM flags that decide which of ONNX Runtime's (MLAS) and llama.cpp's kernels run, as a report names them.
KERNEL_FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"), ("avx_vnni", "AVX-VNNI"),
                ("avx512_bf16", "BF16"), ("amx_int8", "AMX"), ("asimddp", "dot product"), ("sve", "SVE"))


def cpu_description(cpuinfo: str | None = None, cores: int | None = None) -> str | None:
    """This machine's CPU in one line, for a report's header and a result's context: its model name (with x86's
    family and model numbers, which tell one generation from the next where the name does not), its cores, and
    which of the `KERNEL_FLAGS` it has, with "no AMX" said on x86 (the flag that most changes int8 prompts).
    `cpuinfo` defaults to /proc/cpuinfo; None where it cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep and fields:  # the first processor's block ends at its blank line
            break
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = cpu_flags(cpuinfo) or set()
    name = fields.get("model name") or fields.get("Hardware") or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    cores = cores if cores is not None else os.cpu_count()
    has = [label for flag, label in KERNEL_FLAGS if flag in flags]
    x86 = "cpu family" in fields
    text = f"{name}, {cores} core{'s' if cores != 1 else ''}"
    if has:
        text += ": " + ", ".join(has)
    if x86 and "amx_int8" not in flags:
        text += ("; " if has else ": ") + "no AMX"
    return text


def gpu_description(device) -> str | None:
    """The CUDA device a result ran on (its name and memory), or None on the CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
