"""What this CPU's int8 kernels in ONNX Runtime (MLAS) can do, read from its flags, for the quantizers to choose by.

Four choices depend on the CPU, and all are made here so that they are made the same way everywhere:

- `nbits_accuracy_level`: MatMulNBits' `accuracy_level` (nndf.export.quantize). 4 quantizes the activations to
  int8 per block and multiplies int8 by int8 on the prepacked weights; MLAS has such kernels on x86-64 with AVX2
  (plus AVX-VNNI / AVX-512 / AVX-512-VNNI variants) and on ARM64 with the dot-product extension. Elsewhere level 1
  (fp32 compute) is asked for, which is what ORT would fall back to anyway. For 8-bit weights level 4 is the only
  fast kernel: measured on this project's host (ORT 1.32, 2 cores with AVX-512-VNNI, one 768 x 3072 MatMul, one
  row, one thread), 8-bit levels 0 and 1 take 40 and 38 ms (the weights are dequantized at every call), level 4
  0.6 ms; 4-bit 1.06 / 0.82 / 0.41 ms.
- `int8_weight_type`: the weight type of ONNX Runtime's dynamic int8 quantization (`quantize_dynamic`: int8
  decoders, nndf.export.quantize, and `nndf.convert` for encoder models). MLAS multiplies uint8 activations by
  int8 weights exactly only with VNNI (or AMX); without it it uses VPMADDUBSW, whose int16 sums of two products
  saturate (255 * 127 * 2 > 32767), so results are wrong wherever large activations meet large weights (on a
  trained tiny GPT-2: mean KL 0.0007 -> 0.0137). There uint8 weights (the exact uint8 x uint8 kernel) are chosen, ~15-30% slower per MatMul.
- `screen_weight_levels`: the screened LM head's int8 weights (nndf.export.screened_head), whose products must be
  exact: 8-bit where uint8 x int8 is exact, 7-bit where VPMADDUBSW would saturate 8-bit ones.

- `int8_method`: how int8 quantizes the weight MatMuls. Where the CPU has VNNI but no AMX, 8-bit MatMulNBits in
  blocks of 128 (MLAS's block-wise int8 kernel over prepacked weights); elsewhere ONNX Runtime's dynamic
  quantization (MatMulInteger). Measured (bench/README.md): on Zen 4 (AVX-512-VNNI, no AMX) a GPT-2 small decode
  step at batch 1 is 0.83-0.85x the dynamic graph's, SmolLM2-135M's 0.88x, at the price of a 1.5-1.8x longer
  prompt (the dynamic graph's GEMM is MLAS's best for many rows) and 1.04x at batch 4; on a Xeon with AMX, whose
  MatMulInteger GEMM is 4x the block kernel on a prompt, the block kernel was 0.93x per step (within that
  machine's noise) and 2x per prompt; on AVX2 without VNNI it is slower at every size.

Flags come from /proc/cpuinfo (Linux); where they cannot be read, the safe choice is made (QUInt8, 63 levels; level 4 on
x86-64, whose every CPU since 2013 has AVX2, since level 1 is ~65x slower for 8-bit weights).
"""

from __future__ import annotations

import platform
from pathlib import Path

X86 = ("x86_64", "amd64", "i386", "i686", "x86")
ARM64 = ("aarch64", "arm64")

# x86 CPU flags with which MLAS multiplies uint8 by int8 exactly (VPDPBUSD(S) accumulates in int32, or AMX).
_EXACT_U8S8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (x86 "flags", ARM "Features") from `cpuinfo` (default: /proc/cpuinfo); None when
    they cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def u8s8_exact(machine: str | None = None, cpuinfo: str | None = None) -> bool:
    """Whether ONNX Runtime's CPU kernel for uint8 activations x int8 weights is exact for every value: on x86 only
    with VNNI or AMX (see the module docstring); other CPUs (ARM's NEON / dot-product kernels) widen exactly.
    `machine` and `cpuinfo` default to this host's."""
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in X86:
        return True
    flags = cpu_flags(cpuinfo)
    return bool(flags and _EXACT_U8S8_FLAGS & flags)


def int8_weight_type(machine: str | None = None, cpuinfo: str | None = None) -> str:
    """"QInt8" where ONNX Runtime's CPU kernel for uint8 activations x int8 weights is exact (`u8s8_exact`), else
    "QUInt8"."""
    return "QInt8" if u8s8_exact(machine, cpuinfo) else "QUInt8"


def screen_weight_levels(machine: str | None = None, cpuinfo: str | None = None) -> int:
    """The largest magnitude of the screened LM head's int8 weights (`nndf.export.screened_head`) on this CPU: 127
    where uint8 x int8 products are exact (`u8s8_exact`), else 63, where AVX2's `vpmaddubsw` adds two of them in an
    int16 that 255 x 63 x 2 fits and 255 x 127 x 2 overflows. Twice the levels halve the weights' share of the
    screen's error bound, and so about halve the columns it must compute exactly (top-k sampling's 50: ~1500 of
    GPT-2's 50257 at batch 4 with 63 levels, ~800 with 127)."""
    return 127 if u8s8_exact(machine, cpuinfo) else 63


def nbits_accuracy_level(machine: str | None = None, cpuinfo: str | None = None) -> int:
    """MatMulNBits' accuracy_level for this CPU: 4 (int8 compute) where MLAS has int8 kernels, else 1 (fp32)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    flags = cpu_flags(cpuinfo)
    if machine in X86:
        return 4 if flags is None or "avx2" in flags else 1
    if machine in ARM64:
        return 4 if flags is None or "asimddp" in flags else 1
    return 1


def int8_method(machine: str | None = None, cpuinfo: str | None = None) -> str:
    """int8's way of quantizing the weight MatMuls on this CPU (see the module docstring): "matmul_nbits" on x86 with
    VNNI and without AMX, else "dynamic" (also where the flags cannot be read)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    flags = cpu_flags(cpuinfo)
    if machine not in X86 or not flags:
        return "dynamic"
    return "matmul_nbits" if {"avx512_vnni", "avx_vnni"} & flags and "amx_int8" not in flags else "dynamic"
