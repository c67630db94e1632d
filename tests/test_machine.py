"""nndf.machine: the one line that names the CPU a result or a bench report was measured on (the JSON's `cpu`,
`--info`, the bench headers: tests/test_bench.py, tests/test_cli.py)."""

from __future__ import annotations

import pytest

from nndf.machine import cpu_description

XEON = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu sse avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: other\n")
ZEN4 = ("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n")
AVX2_ONLY = "processor\t: 0\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n"
ARM = "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd asimddp sve\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("cpuinfo, expected", [
    (XEON, "Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143), 2 cores: AVX2, AVX-512, VNNI, BF16, AMX"),
    (ZEN4, "AMD EPYC (family 25, model 17), 2 cores: AVX2, AVX-512, VNNI, BF16; no AMX"),
    (AVX2_ONLY, "AMD EPYC (family 23, model 49), 2 cores: AVX2; no AMX"),
    (ARM, "unknown CPU, 2 cores: dot product, SVE"),
])
def test_the_machine_is_named_by_the_cpu_and_the_flags_that_choose_the_kernels(cpuinfo, expected):
    """The same code passed and failed different goals on three kinds of 2-core machine: results and bench reports
    say which kind they ran on (the first processor's name and numbers, and the flags MLAS and llama.cpp choose by)."""
    assert cpu_description(cpuinfo, cores=2) == expected
