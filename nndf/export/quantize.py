"""int8 / int4 weight quantization of an exported decoder graph for ONNX Runtime on the CPU.

`quantized_decoder(export, kind, working_dir)` returns a quantized copy of the fp32 graph of `nndf.export.onnx`,
kept in the working dir as a folder artifact (graph + one external weight file, metadata beside it) that is reused
while its metadata (source export, kind, every quantization parameter, ONNX Runtime's version, QUANTIZER_REVISION)
matches and its files have their recorded sizes, and rebuilt with a message otherwise. The graph keeps the fp32
graph's input and output names, so the onnxrt backend runs it exactly like the fp32 one.

Before quantizing, `nndf.export.weight_graph.prepare_graph` rewrites a copy of the graph so that every weight
matrix is a constant operand of a MatMul (Gemm -> MatMul, tied heads given their own constant; see that module).

Then (defaults in INT8 / INT4, every parameter can be overridden for measurements):

- int8: `quantize_dynamic` restricted to those MatMuls: weights quantized offline to 8 bits with one scale per output
  column, activations per call (DynamicQuantizeLinear + MatMulInteger, fused by ORT into DynamicQuantizeMatMul).
  Run on the untouched graph it is slower than fp32: it quantizes the tied embedding, which is then dequantized and
  transposed at every step. The weights are int8 (QInt8) where ORT's uint8 x int8 kernel is exact, uint8 (QUInt8)
  elsewhere (`int8_weight_type`): on x86 without VNNI (AVX2, or AVX-512 without VNNI), MLAS multiplies uint8
  activations by int8 weights with VPMADDUBSW, whose int16 sums of two products saturate (255 * 127 * 2 > 32767),
  so the results are wrong wherever large activations meet large weights, and per-channel scales put a +-127 weight
  in every column. On the trained tiny GPT-2 (AVX2 host, ORT 1.31.1 and 1.32.0) that raises the mean KL from 0.0007
  to 0.0137 (top-1 0.9998 -> 0.9960); the same int8 values shifted to uint8 (the exact uint8 x uint8 kernel) give
  0.0007 again. QUInt8 is ~15-30% slower per MatMul there; 7-bit weights (reduce_range, ORT's other remedy) keep
  the speed but give KL 0.0012, as bad as one scale per tensor.
- int4: `MatMulNBitsQuantizer`, symmetric 4-bit blocks of 32 along K (K is padded to whole blocks by the quantizer,
  so any width works), accuracy_level 4 (int8 activations in the kernel; the default fp32 kernel is far slower).

Measured (ORT 1.31.1, 2 cores of a CPU where QInt8 and QUInt8 agree, i.e. with VNNI; GPT-2 small random weights, 64
prompt + 64 new tokens, medians of 5 interleaved runs after a warm-up; ratios against Hugging Face eager fp32
generate() = 27-28 ms/step and 72-74 tok/s at batch 4; fidelity on the trained tiny GPT-2 of ../shared/data against
fp32 PyTorch, 200 memorised LAMBADA passages sampled from 2500-2999: top-1 agreement over all 16k positions, mean
KL, lm-eval acc / ppl (fp32: 1.000 / 1.13)):

    variant                       b1 ms/step  b4 tok/s   top-1    mean KL   acc   ppl
    int8 dynamic QUInt8 tensor       0.36x      2.68x    0.9988   0.0015   1.000  1.13
    int8 dynamic QInt8 tensor        0.32x      3.35x    0.9989   0.0016   1.000  1.14
    int8 dynamic QUInt8 channel      0.37x      2.65x    0.9990   0.0008   1.000  1.14
    int8 dynamic QInt8 channel  (*)  0.34x      3.24x    0.9990   0.0008   1.000  1.13
    8-bit MatMulNBits block 128      0.34x      2.67x    0.9987   0.0005   1.000  1.13
    8-bit MatMulNBits block 32       0.38x      2.35x    0.9992   0.0003   1.000  1.13
    int4 sym block 32           (*)  0.29x      2.62x    0.9925   0.0338   1.000  1.20
    int4 asym block 32               0.30x      2.60x    0.9929   0.0291   1.000  1.20
    int4 sym block 64                0.27x      2.79x    0.9894   0.0412   1.000  1.22
    int4 sym block 128               0.25x      2.99x    0.9889   0.0531   1.000  1.26
    int4 asym block 128              0.25x      3.05x    0.9912   0.0479   0.995  1.24

On unseen passages (2000-2499, where this memorising model is wrong anyway) agreement is lower for all (int8
0.90-0.94, int4 0.69-0.72) in the same order. Per-channel scales halve int8's KL; int8 weights (QInt8) are faster
than uint8 here (the default where exact; QUInt8 channel on x86 without VNNI). For int4 the block size of the layers
decides fidelity (the LM head's block matters little), and small blocks cost batch-4 throughput in the prefill
(MatMulNBits with 256 rows is slower than fp32). With attention exported from Hugging Face's eager implementation
instead of SDPA, the same quantized graphs reach int8 0.30x / 4.48x, int4 block 32 0.25x / 3.34x and block 128 0.20x
/ 3.97x: SDPA's export transposes the whole key cache at every step (Reshape-Transpose-Reshape, which ORT cannot
fuse into the MatMul).
"""

from __future__ import annotations

import contextlib
import logging
import platform
import shutil
import sys
from pathlib import Path
from typing import Mapping

from nndf.errors import HarnessError, UsageError
from nndf.export.onnx import derived_graph
from nndf.export.weight_graph import prepare_graph, weight_matmuls
from nndf.workspace import read_metadata
from nndf.progress import say

# Bump when a change here changes the graphs produced, so that old quantized graphs are rebuilt rather than reused.
QUANTIZER_REVISION = 2

# x86 CPU flags with which MLAS multiplies uint8 by int8 exactly (VPDPBUSD(S) accumulates in int32, or AMX).
_EXACT_U8S8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def int8_weight_type(machine: str | None = None, cpuinfo: str | None = None) -> str:
    """"QInt8" where ONNX Runtime's CPU kernel for uint8 activations x int8 weights is exact, else "QUInt8".

    On x86 that kernel is exact only with VNNI (or AMX): without it MLAS uses VPMADDUBSW, whose int16 pair sums
    saturate (see the module docstring); on x86 the CPU flags are read from /proc/cpuinfo (Linux), and when they
    cannot be read the exact uint8 x uint8 kernel is chosen. Other CPUs (ARM's NEON / dot-product kernels) widen
    exactly. `machine` and `cpuinfo` default to this host's.
    """
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return "QInt8"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return "QUInt8"
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags") and ":" in line), [])
    return "QInt8" if _EXACT_U8S8_FLAGS & set(flags) else "QUInt8"


# The parameters of each kind. Every one of them is part of the artifact's settings (and so of its name): an int8
# graph made for one weight type is not reused on a host that needs the other.
INT8 = {"method": "dynamic", "weight_type": int8_weight_type(), "per_channel": True, "reduce_range": False}
INT4 = {"method": "matmul_nbits", "bits": 4, "block_size": 32, "is_symmetric": True, "accuracy_level": 4}
KINDS: dict[str, dict] = {"int8": INT8, "int4": INT4}


@contextlib.contextmanager
def _quiet_quantizers():
    """Import ORT's quantizers and run them without their log lines, leaving the root logger as it was.

    `matmul_nbits_quantizer` calls `logging.basicConfig(level=INFO)` on import (a handler and INFO level on the
    root logger, i.e. a line per node on stderr), and `quantize_dynamic` warns that the graph was not
    "pre-processed" (ORT's shape-inference script, which a decoder graph from our exporter does not need).
    """
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        import onnxruntime.quantization  # noqa: F401
        import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401

        root.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(sys.stderr):  # their prints are progress, not results
            yield
    finally:
        root.setLevel(level)
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)


def _describe(params: Mapping) -> str:
    if params["method"] == "dynamic":
        return (f"dynamic int8 MatMul ({params['weight_type']} weights, "
                f"{'per-channel' if params['per_channel'] else 'per-tensor'} scales"
                f"{', reduced range' if params['reduce_range'] else ''})")
    return (f"MatMulNBits {params['bits']}-bit ({'symmetric' if params['is_symmetric'] else 'asymmetric'}, "
            f"block {params['block_size']}, accuracy level {params['accuracy_level']})")


def _check_params(kind: str, params: Mapping) -> None:
    method = params.get("method")
    if method == "dynamic":
        needed = {"weight_type", "per_channel", "reduce_range"}
        if params.get("weight_type") not in ("QUInt8", "QInt8"):
            raise UsageError(f"int8 weight_type must be QUInt8 or QInt8, got {params.get('weight_type')!r}")
    elif method == "matmul_nbits":
        needed = {"bits", "block_size", "is_symmetric", "accuracy_level"}
        if params.get("bits") not in (4, 8):
            raise UsageError(f"MatMulNBits bits must be 4 or 8, got {params.get('bits')!r}")
        block = params.get("block_size")
        if not isinstance(block, int) or block < 16 or block & (block - 1):
            raise UsageError(f"MatMulNBits block_size must be a power of two >= 16, got {block!r}")
    else:
        raise UsageError(f"quantization method for {kind} must be 'dynamic' or 'matmul_nbits', got {method!r}")
    bits = 8 if method == "dynamic" else params.get("bits")
    if kind in KINDS and bits != int(kind[3:]):
        raise UsageError(f"{kind} must quantize to {kind[3:]} bits, but the parameters give {bits}")
    missing = needed - set(params)
    if missing:
        raise UsageError(f"quantization parameters for {kind} lack {', '.join(sorted(missing))}")


# ----------------------------------------------------------------------------------------------------------------
# Quantization
# ----------------------------------------------------------------------------------------------------------------


def _quantize_dynamic(prepared: Path, out: Path, nodes: list[str], params: Mapping) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        prepared, out, op_types_to_quantize=["MatMul"], nodes_to_quantize=nodes,
        per_channel=bool(params["per_channel"]), reduce_range=bool(params["reduce_range"]),
        weight_type=getattr(QuantType, params["weight_type"]), use_external_data_format=True,
        extra_options={"MatMulConstBOnly": True},
    )


def _quantize_nbits(model, out: Path, nodes: list[str], params: Mapping) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(
        block_size=int(params["block_size"]), is_symmetric=bool(params["is_symmetric"]),
        accuracy_level=int(params["accuracy_level"]), op_types_to_quantize=("MatMul",), bits=int(params["bits"]),
    )
    quantizer = MatMulNBitsQuantizer(model, nodes_to_include=nodes, algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=True)


def _check_result(out: Path, export, params: Mapping, expected: int) -> dict[str, int]:
    """Count the quantized nodes and check that the names the backend feeds and reads are all still there."""
    import onnx

    model = onnx.load(str(out), load_external_data=False)
    ops: dict[str, int] = {}
    for n in model.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    done = ops.get("MatMulInteger", 0) if params["method"] == "dynamic" else ops.get("MatMulNBits", 0)
    if done != expected:
        raise HarnessError(f"quantizing {export.graph} replaced {done} of its {expected} weight MatMuls; "
                           f"the quantizer skipped some, so the graph would be partly fp32")
    inputs = tuple(i.name for i in model.graph.input)
    outputs = tuple(o.name for o in model.graph.output)
    if set(inputs) != set(export.input_names) or set(outputs) != set(export.output_names):
        raise HarnessError(f"the quantized graph of {export.graph} lost the decoder's input or output names "
                           f"(inputs {list(inputs)}, outputs {list(outputs)})")
    return ops


def quantize_settings(export, kind: str, params: Mapping) -> dict:
    """Every setting that shapes the quantized graph; its hash names the artifact."""
    import onnx
    import onnxruntime

    source_meta = read_metadata(export.folder) or {}
    return {
        "kind": f"onnx-decoder-{kind}",
        "source": export.folder.name,
        "graph": export.graph.name,
        "source_files": source_meta.get("files"),
        "quantize": kind,
        "params": dict(params),
        "versions": {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                     "quantizer_revision": str(QUANTIZER_REVISION)},
    }


def quantized_decoder(export, kind: str, working_dir: str | Path, params: Mapping | None = None) -> Path:
    """The quantized graph (.onnx path) of `export` for `kind` ("int8" or "int4"), reused or (re)built.

    `params` replaces the kind's default parameters (for measuring alternatives; they name the artifact too).
    """
    if kind not in KINDS:
        raise UsageError(f"unknown quantization '{kind}'; allowed: {', '.join(KINDS)}")
    params = dict(KINDS[kind] if params is None else params)
    _check_params(kind, params)
    try:
        import onnx  # noqa: F401
        import onnxruntime.quantization  # noqa: F401
    except ImportError:
        raise HarnessError("quantization needs onnx and onnxruntime: pip install -e '.[onnxruntime]'") from None
    if not export.graph.is_file():
        raise HarnessError(f"the exported graph {export.graph} is missing; delete {export.folder} to re-export it")

    settings = quantize_settings(export, kind, params)

    def build(out: Path) -> None:
        import onnx

        tmp, graph_file = out.parent, out.name
        with _quiet_quantizers():
            try:
                model = onnx.load(str(export.graph), load_external_data=True)
                counts = prepare_graph(model)
                nodes = weight_matmuls(model)
            except Exception as exc:  # onnx raises many types for a damaged graph; the user needs one sentence
                raise HarnessError(f"preparing {export.graph} for quantization failed: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
            if not nodes:
                raise HarnessError(f"{export.graph} has no MatMul or Gemm with a constant weight to quantize")
            notes = [f"{counts['gemm_rewritten']} were Gemm",
                     f"{counts['transposed_weights']} read a transposed constant",
                     f"{counts['reshapes_removed']} Reshapes around them removed",
                     f"{counts['gemm_left']} Gemm left in fp32 (not a plain x @ W + b)"]
            say(f"  {len(nodes)} weight MatMuls to quantize"
                f"{''.join(f'; {n}' for n in notes if not n.startswith('0 '))}")
            try:
                if params["method"] == "dynamic":
                    prep = tmp / "prepared"
                    prep.mkdir()
                    onnx.save_model(model, str(prep / graph_file), save_as_external_data=True,
                                    all_tensors_to_one_file=True, location=graph_file + ".data")
                    del model
                    _quantize_dynamic(prep / graph_file, out, nodes, params)
                    shutil.rmtree(prep)
                else:
                    _quantize_nbits(model, out, nodes, params)
            except HarnessError:
                raise
            except Exception as exc:  # the quantizers raise many types; the user needs one sentence and the cause
                raise HarnessError(f"{kind} quantization of {export.graph} failed: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        _check_result(out, export, params, len(nodes))
        # quantize_dynamic leaves a shape-inferred copy behind in some versions: keep only the graph and its data.
        for extra in tmp.iterdir():
            if extra.name not in (graph_file, graph_file + ".data"):
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()

    return derived_graph(export, kind, settings, working_dir, build,
                         f"quantizing {export.graph} to {kind}: {_describe(params)} ...")
