"""int8 / int4 weight quantization of an exported decoder graph for ONNX Runtime on the CPU.

`quantized_decoder(export, kind, working_dir)` returns a quantized copy of the fp32 graph of `nndf.export.onnx`,
kept in the working dir as a folder artifact (graph + one external weight file, metadata beside it) that is reused
while its metadata (source export, kind, every quantization parameter, ONNX Runtime's version, QUANTIZER_REVISION)
matches and its files have their recorded sizes, and rebuilt with a message otherwise. The graph keeps the fp32
graph's input and output names, so the onnxrt backend runs it exactly like the fp32 one.

Before quantizing, `nndf.export.weight_graph.prepare_graph` rewrites a copy of the graph so that every weight
matrix is a constant operand of a MatMul (Gemm -> MatMul, tied heads given their own constant; see that module).
Then `nndf.export.nbits` quantizes both kinds the same way (defaults in INT8 / INT4, every parameter can be
overridden for measurements, the block size also by `--block-size`):

- MatMulNBits with `bits` 8 or 4, symmetric blocks of `block_size` (32) along K, and the `accuracy_level` chosen for
  the CPU (`nndf.export.cpu_int8.nbits_accuracy_level`: 4, int8 dot products on prepacked weights, wherever MLAS has
  the kernels). For 8 bits level 4 is the only fast kernel: levels 0 and 1 dequantize the weights at every call
  (one 768 x 3072 MatMul, one row: 40 / 38 ms vs 0.6 ms at level 4; 4-bit: 1.06 / 0.82 / 0.41 ms; ORT 1.32, this
  project's 2-core host with AVX-512-VNNI).
- The LM head is a MatMul like any other (`lm_head`, on by default) and the embedding tables become
  GatherBlockQuantized on the same blocks (`embedding`: on for int8, off for int4; see nndf.export.nbits).

Until QUANTIZER_REVISION 3 int8 was ONNX Runtime's dynamic quantization (DynamicQuantizeLinear + MatMulInteger
with per-channel weights, uint8 weights on x86 without VNNI, whose uint8 x int8 kernel saturates): 8-bit
MatMulNBits replaced it, being as fast or faster and more exact (figures below), and needing no weight-type choice
(its int8 path quantizes the activations to signed int8 and does not saturate). The dynamic path remains where it
has no replacement, in `nndf.convert` (encoder models, fused Attention nodes).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Mapping

from nndf.errors import HarnessError, UsageError
from nndf.export.cpu_int8 import nbits_accuracy_level
from nndf.export.onnx import derived_graph
from nndf.export.weight_graph import prepare_graph, weight_matmuls
from nndf.workspace import read_metadata
from nndf.progress import say

# Bump when a change here changes the graphs produced, so that old quantized graphs are rebuilt rather than reused.
QUANTIZER_REVISION = 3

# The parameters of each kind. Every one of them is part of the artifact's settings (and so of its name): a graph
# made for another block size or accuracy level is not reused.
INT8 = {"bits": 8, "block_size": 32, "is_symmetric": True, "accuracy_level": nbits_accuracy_level(),
        "lm_head": True, "embedding": True}
INT4 = {"bits": 4, "block_size": 32, "is_symmetric": True, "accuracy_level": nbits_accuracy_level(),
        "lm_head": True, "embedding": False}
KINDS: dict[str, dict] = {"int8": INT8, "int4": INT4}
PARAMETERS = frozenset(INT8)


def block_size_problem(block_size) -> str | None:
    """Why `block_size` cannot be MatMulNBits' block size (ORT: a power of two of at least 16), or None."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 \
            or block_size & (block_size - 1):
        return f"must be a power of two of at least 16 (16, 32, 64, 128, ...), got {block_size!r}"
    return None


def quantize_params(kind: str, block_size: int | None = None) -> dict:
    """The default parameters of `kind`, with `block_size` (the --block-size flag) in place of the default."""
    if kind not in KINDS:
        raise UsageError(f"unknown quantization '{kind}'; allowed: {', '.join(KINDS)}")
    params = dict(KINDS[kind])
    if block_size is not None:
        params["block_size"] = block_size
    return params


@contextlib.contextmanager
def _quiet_quantizers():
    """Import ORT's quantizer and run it without its log lines, leaving the root logger as it was.

    `matmul_nbits_quantizer` calls `logging.basicConfig(level=INFO)` on import (a handler and INFO level on the
    root logger, i.e. a line per node on stderr).
    """
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401

        root.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(sys.stderr):  # its prints are progress, not results
            yield
    finally:
        root.setLevel(level)
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)


def _describe(params: Mapping) -> str:
    quantized = ["LM head"] * bool(params["lm_head"]) + ["embeddings"] * bool(params["embedding"])
    return (f"MatMulNBits {params['bits']}-bit ({'symmetric' if params['is_symmetric'] else 'asymmetric'}, "
            f"block {params['block_size']}, accuracy level {params['accuracy_level']}; "
            f"{' and '.join(quantized) or 'neither LM head nor embeddings'} quantized too)")


def _check_params(kind: str, params: Mapping) -> None:
    missing, unknown = PARAMETERS - set(params), set(params) - PARAMETERS
    if missing or unknown:
        raise UsageError(f"quantization parameters for {kind} lack {', '.join(sorted(missing)) or 'nothing'} and "
                         f"have unknown {', '.join(sorted(unknown)) or 'nothing'}")
    if params["bits"] not in (4, 8):
        raise UsageError(f"MatMulNBits bits must be 4 or 8, got {params['bits']!r}")
    if params["bits"] != int(kind[3:]):
        raise UsageError(f"{kind} must quantize to {kind[3:]} bits, but the parameters give {params['bits']}")
    problem = block_size_problem(params["block_size"])
    if problem:
        raise UsageError(f"the block size {problem}")
    if params["accuracy_level"] not in (0, 1, 2, 3, 4):
        raise UsageError(f"MatMulNBits accuracy_level must be 0 to 4, got {params['accuracy_level']!r}")
    if params["embedding"] and not params["is_symmetric"]:
        raise UsageError("quantized embeddings need symmetric weights (GatherBlockQuantized without zero points)")


def _check_result(out: Path, export, report: Mapping) -> dict[str, int]:
    """Count the quantized nodes and check that the names the backend feeds and reads are all still there."""
    import onnx

    model = onnx.load(str(out), load_external_data=False)
    ops: dict[str, int] = {}
    for n in model.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    for op, expected in (("MatMulNBits", report["matmuls"]), ("GatherBlockQuantized", report["gathers"])):
        if ops.get(op, 0) != expected:
            raise HarnessError(f"quantizing {export.graph} gave {ops.get(op, 0)} {op} for {expected} nodes to "
                               "quantize; the quantizer skipped some, so the graph would be partly fp32")
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


def quantized_decoder(export, kind: str, working_dir: str | Path, params: Mapping | None = None,
                      block_size: int | None = None) -> Path:
    """The quantized graph (.onnx path) of `export` for `kind` ("int8" or "int4"), reused or (re)built.

    `block_size` replaces the kind's default block size (the --block-size flag); `params` replaces all of the
    kind's default parameters (for measuring alternatives). Both name the artifact too.
    """
    from nndf.export.nbits import quantize_graph

    params = dict(quantize_params(kind) if params is None else params)
    if block_size is not None:
        params["block_size"] = block_size
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
            say(f"  {len(nodes)} weight MatMuls{''.join(f'; {n}' for n in notes if not n.startswith('0 '))}")
            try:
                quantized, report = quantize_graph(model, nodes, params)
                quantized.save_model_to_file(str(out), use_external_data_format=True)
            except HarnessError:
                raise
            except Exception as exc:  # the quantizer raises many types; the user needs one sentence and the cause
                raise HarnessError(f"{kind} quantization of {export.graph} failed: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        say(f"  {report['matmuls']} MatMuls quantized (LM head {'in' if report['lm_head'] else 'not'} among them), "
            f"{report['gathers']} embedding lookups"
            + (f"; {', '.join(report['fp32_tables'])} kept in fp32 (width not a multiple of the block)"
               if report["fp32_tables"] else ""))
        _check_result(out, export, report)

    return derived_graph(export, kind, settings, working_dir, build,
                         f"quantizing {export.graph} to {kind}: {_describe(params)} ...")
