"""int8 / int4 weight quantization of an exported decoder graph for ONNX Runtime on the CPU.

`quantized_decoder(export, kind, working_dir)` returns a quantized copy of the fp32 graph of `nndf.export.onnx`,
kept in the working dir as a folder artifact (graph + one external weight file, metadata beside it) that is reused
while its metadata (source export, kind, every quantization parameter, ONNX Runtime's version, QUANTIZER_REVISION)
matches and its files have their recorded sizes, and rebuilt with a message otherwise. The graph keeps the fp32
graph's input and output names, so the onnxrt backend runs it exactly like the fp32 one.

Before quantizing, `nndf.export.weight_graph.prepare_graph` rewrites a copy of the graph so that every weight
matrix is a constant operand of a MatMul (Gemm -> MatMul, tied heads given their own constant; see that module).
Then `nndf.export.weight_quant` quantizes it as the parameters say (defaults in INT8 / INT4; every parameter can be
overridden for measurements, the block size also by `--block-size`):

- int4: MatMulNBits, asymmetric 4-bit blocks of 128 along K (a uint8 zero point per block; padded to whole
  blocks), each block's range searched for the least squared error (`nndf.export.block_search`; measured at the
  end), `accuracy_level` chosen for the CPU (`nndf.export.cpu_int8.nbits_accuracy_level`: 4, int8 dot products on
  prepacked weights, wherever MLAS has the kernels; 2x faster than fp32 compute per MatMul here). Embedding tables
  stay fp32 (their 4-bit copy costs agreement, below).
- int8: the method is the CPU's (`nndf.export.cpu_int8.int8_method`). Where it has VNNI and no AMX, 8-bit
  MatMulNBits in blocks of 128 at accuracy level 4 (measured at the end). Elsewhere ONNX Runtime's dynamic
  quantization (weights int8 per output channel, activations quantized per call: DynamicQuantizeLinear +
  MatMulInteger, which ORT fuses), weight type from `int8_weight_type` (uint8 on x86 without VNNI, whose uint8 x
  int8 kernel saturates; see nndf.export.cpu_int8): on the AMX host below, 8-bit MatMulNBits was no faster per
  decode step at batch 1, 1.3x slower at batch 4 and 2-3x slower in the prompt, because MLAS's int8 GEMM for
  MatMulInteger (AMX there) beats its block-wise kernel as soon as there are several rows. MatMulNBits is the more
  exact of the two (KL 0.0004 vs 0.0010). Either way the embedding tables are 8-bit in blocks of 32
  (GatherBlockQuantized, `embedding_block_size`): the table is ~30% of GPT-2 small's weights and costs no
  agreement. 8-bit MatMulNBits' accuracy levels 0 and 1 dequantize the weights at every call (one 768 x 3072
  MatMul, one row, one thread: 40 / 38 ms vs 0.6 ms at level 4).
- Both: the LM head (tied or not) is quantized like any other MatMul (`lm_head`).

Measured 2026-11-25 (ORT 1.32.0, the 2-core AVX-512-VNNI/AMX host, heavily loaded by other work: load average
6-12, so step times are 5-10x a quiet machine's and only same-round comparisons mean much). Speed: GPT-2 small
random weights, 64 prompt + 64 new tokens, default threads, 5 alternating rounds in one process; decode ms/step
(median over rounds of each run's median step; in brackets the median of each run's 10th-percentile step, less
hit by the load) and first-token ms. Single MatMuls of GPT-2 small's shapes (one thread, best of 30 calls),
dynamic vs 8-bit MatMulNBits block 32 / 128 vs 4-bit block 32: one row 0.11 / 0.12 / 0.10 / 0.07 ms (768 x 3072),
four rows 0.16 / 0.31 / 0.23 / 0.25, 64 rows 0.54 / 2.14 / 1.57 / 2.23 (fp32: 2.2).

    graph (b1 / b4)                       b1 ms/step       b1 first   b4 ms/step        b4 first
    int8 dynamic (before and now)         103.4 (76.8)       242      132.6 (104.2)       729
    int8 MatMulNBits block 32             107.8 (92.1)       684      176.0 (129.8)      1580
    int8 MatMulNBits block 128             96.1 (72.2)       481      145.5 (112.5)      1294
    int4 MatMulNBits block 32 (default)    73.3 (58.6)       639      140.2 (110.2)      1680
    int4 MatMulNBits block 128             72.0 (49.7)       567      124.3 (106.2)      1443

Fidelity: the trained tiny GPT-2 of ../shared/data against fp32 PyTorch, LAMBADA passages 2500-2999 (the ones it
memorised; 500 passages, 41703 positions): top-1 agreement at every position, mean KL, lm-eval acc / ppl. fp32
onnxrt gives 1.00000 / 0.00000 / 1.000 / 1.1416.

    int8 dynamic, embeddings fp32 (before)     0.99914   0.00102   1.000   1.1441
    int8 dynamic, embeddings 8-bit (default)   0.99878   0.00112   1.000   1.1440
    int8 MatMulNBits block 32, emb. 8-bit      0.99938   0.00043   1.000   1.1425
    int8 MatMulNBits block 32, emb. fp32       0.99926   0.00034   1.000   1.1425
    int4 MatMulNBits block 32 (default)        0.99225   0.03465   1.000   1.2182

What the LM head and the embeddings cost, on a seeded 100 of those passages (8314 positions; int8 default 0.99820
/ 0.00102 / 1.000): int8 with the head fp32 0.99808 / 0.00093 (nothing measurable in agreement), with the tables
fp32 0.99880 / 0.00092 (5 positions; the 8-bit tables save 108 of GPT-2 small's 270 MiB); int4 with 4-bit tables
0.98280 / 0.0812 and acc 0.990 (a passage lost: hence fp32 tables for int4); int4 default 0.99338 / 0.0344 / 1.000,
with the head fp32 0.99519 / 0.0267 / 1.000: the 4-bit head costs 15 positions, no passage, and saves most of a
step (GPT-2 small's head alone, one row, one thread: 25.3 ms in fp32, 2.7 in 4-bit, 3.7 in dynamic int8).

Older measurements (ORT 1.31.1, a VNNI CPU, 200 of these passages): int4 block 64 / 128 agree 0.9894 / 0.9889 (KL
0.041 / 0.053; acc 1.000 / 1.000), asymmetric int4 block 32 0.9929 (0.029); per-tensor int8 scales double the KL;
on x86 without VNNI int8 weights (QInt8) give KL 0.0137 where uint8 give 0.0007. With attention exported from
Hugging Face's eager implementation instead of SDPA the quantized graphs were ~15% faster at batch 1: SDPA's export
transposes the whole key cache at every step (Reshape-Transpose-Reshape, which ORT cannot fuse into the MatMul).

int4's block size, 2026-11-29 (35th session; ORT 1.32.0, the 2-core AMD EPYC Zen 4 with AVX-512-VNNI and no AMX, 64
prompt + 64 new tokens at batch 1, alternating rounds in one process, decode ms per step inside ONNX Runtime): GPT-2
small blocks of 32 / 64 / 128 3.44 / 3.02 / 2.53 ms (paired 1.000 / 0.873 / 0.740, 9 rounds), SmolLM2-135M 4.40 /
3.95 / 3.62 (1.000 / 0.876 / 0.802, 7 rounds). The kernel pays per block (a scale and a float conversion per block
of int8 dot products), which is why its steps shrink faster than its bytes. On the trained GPT-2 over passages
2500-2999 (`accuracy` as above): block 64 top-1 = PyTorch 98.93%, KL 4.29e-2, lm-eval acc 100%; block 128 98.79%,
5.44e-2 and 99.4% (3 passages lost, where the issue allows one). Hence blocks of 64 for int4 then (the Xeon
measured them 3-15% faster per MatMul at 1 and 4 rows too, bench/README.md); searched ranges changed that (below).

int4's zero points and searched ranges, 2026-11-29 (37th session, the same Zen 4). On the trained GPT-2's passages
2500-2999 (top-1 = PyTorch / KL vs PyTorch / lm-eval acc):

    blocks   symmetric, nearest        asymmetric, nearest       asymmetric, searched (block_search)
    64       98.93% / 4.29e-2 / 100%   99.26% / 3.53e-2 / 100%   99.23% / 3.23e-2 / 100%
    128      98.79% / 5.44e-2 / 99.4%  99.03% / 4.92e-2 / 99.6%  99.18% / 4.47e-2 / 100%
    256      -                         -                         99.02% / 4.46e-2 / 99.8%

(symmetric: scale = the block's largest magnitude / -8, llama.cpp's Q4_0 rounding, whose blocks of 32 give 99.23% /
3.47e-2 / 100%; nearest asymmetric: ORT's, levels over each block's min to max; searched: that range shrunk by the
factor of 0.7-1.0 with the least squared error, the scale refitted.) Zero points cost no time: one 768 x 3072 MatMul
at one row 47-49 us either way, whole int4 generations (7 alternating processes each) 0.984x (GPT-2 small) and
1.014x (SmolLM2-135M) a decode step, first token 1.000x and 0.989x. Blocks of 128 against 64, the same way: decode
step 0.828x (GPT-2 small, 2.59 against 3.13 ms) and 0.926x (SmolLM2-135M, 3.86 against 4.17), first token 0.795x
and 0.837x (MLAS's int8 block kernel pays per block in the prompt too: one 768 x 3072 MatMul at 64 rows 0.92
against 1.21 ms, fp32 1.48). Hence asymmetric blocks of 128 with searched ranges: as close to fp32 as the symmetric
blocks of 64 that were the default (higher top-1, KL 4% higher, no passage lost), for the faster step and prompt;
`--block-size 64` gives the closest int4 (KL 3.23e-2, 4.56 bits a weight). Not adopted: a symmetric scale searched
the same way (99.04% / 3.82e-2 at 64, 98.95% / 4.75e-2 at 128); ORT's HQQ (float zero points, which MLAS's int8
kernel does not take: 113-152 ms a GPT-2 step); ORT's k_quant (fails on a K that is not a whole number of blocks).

int8's method on that Zen 4 (the same runs; decode in ONNX Runtime / first token, paired against dynamic int8):
GPT-2 small at batch 1, 8-bit MatMulNBits blocks of 32 / 64 / 128 1.14 / 0.96 / 0.85x (4.46 against 5.56 ms) and
2.19 / 1.84 / 1.61x (34.9 against 22.6 ms), 256 no better than 128; a second run 0.83x and 1.47x; at batch 4
blocks of 128 1.04x and 1.76x; SmolLM2-135M at batch 1 0.88x and 1.58x. The decode step is what a generation
repeats: blocks of 128 there, the prompt still under half of llama.cpp's Q8_0 (bench/README.md). On the trained
GPT-2's 100 seeded passages (above) blocks of 128 agree 0.99856 / KL 0.00051 / acc 1.000 with fp32 PyTorch.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import shutil
import sys
from pathlib import Path
from typing import Mapping

from nndf.errors import HarnessError, UsageError, refused_by_the_disk
from nndf.export.cpu_int8 import int8_method, int8_weight_type, nbits_accuracy_level
from nndf.export.graph_reads import ONNX_HINT, GraphLoadError, first_line
from nndf.export.onnx import derived_graph
from nndf.export.weight_graph import non_finite_weights, prepare_graph, weight_matmuls
from nndf.workspace import read_metadata
from nndf.progress import say

QUANTIZER_HINT = "that this onnxruntime quantizes what this torch exports"
# Bump when a change here changes the graphs produced, so that old quantized graphs are rebuilt rather than reused.
QUANTIZER_REVISION = 3

# The parameters of each kind. Every one of them is part of the artifact's settings (and so of its name): a graph
# made for another block size, accuracy level or weight type is not reused. `method` says how the weight MatMuls are
# quantized: "matmul_nbits" (bits, block_size, is_symmetric, accuracy_level, rounding) or, for 8 bits, "dynamic"
# (weight_type, per_channel); `lm_head` and `embedding` (8 or 4 bits as `bits`, blocks of `embedding_block_size`)
# apply to both. `rounding`: "nearest" (ORT's, over each block's whole range) or "searched" (4-bit asymmetric blocks
# only: each block's range searched for the least squared error, nndf.export.block_search).
# int8's method is the CPU's (`int8_method`): 8-bit MatMulNBits in blocks of 128 where the CPU has VNNI and no AMX,
# else dynamic. The embedding tables have blocks of their own: 32 divides every hidden size of the families (128
# would leave SmolLM2's 576-wide table in fp32).
INT8_METHOD = int8_method()
INT8_BLOCK_SIZE = {"matmul_nbits": 128, "dynamic": 32}  # dynamic's blocks are its tables' alone
INT8 = {"method": INT8_METHOD, "bits": 8, "block_size": INT8_BLOCK_SIZE[INT8_METHOD],
        "embedding_block_size": 32, "is_symmetric": True, "accuracy_level": nbits_accuracy_level(),
        "weight_type": int8_weight_type(), "per_channel": True, "lm_head": True, "embedding": True,
        "rounding": "nearest"}
# int4: asymmetric blocks of 128 with searched ranges, 4.28 bits a weight; on the trained GPT-2 as close to fp32 as
# the symmetric blocks of 64 rounded to nearest that were the default (lm-eval acc 100%, top-1 99.18% against
# 98.93%), and on Zen 4 a decode step 0.83-0.93x and a prompt 0.80-0.84x theirs (docstring, end)
INT4 = dict(INT8, method="matmul_nbits", bits=4, block_size=128, is_symmetric=False, embedding=False,
            rounding="searched")
ROUNDINGS = ("nearest", "searched")
KINDS: dict[str, dict] = {"int8": INT8, "int4": INT4}
PARAMETERS = frozenset(INT8)
METHODS = ("matmul_nbits", "dynamic")
MATMUL_OP = {"matmul_nbits": "MatMulNBits", "dynamic": "MatMulInteger"}  # the op each method makes of a MatMul


def block_size_problem(block_size) -> str | None:
    """Why `block_size` cannot be MatMulNBits' block size (ORT: a power of two of at least 16), or None."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 \
            or block_size & (block_size - 1):
        return f"must be a power of two of at least 16 (16, 32, 64, 128, ...), got {block_size!r}"
    return None


def quantize_params(kind: str, block_size: int | None = None, int8_method: str | None = None) -> dict:
    """The default parameters of `kind`, with `block_size` (the --block-size flag) in place of the default and, for
    int8, `int8_method` (--int8-method: "matmul_nbits" or "dynamic") in place of the CPU's, with its own default
    block size."""
    if kind not in KINDS:
        raise UsageError(f"unknown quantization '{kind}'; allowed: {', '.join(KINDS)}")
    params = dict(KINDS[kind])
    if int8_method is not None:
        if kind != "int8" or int8_method not in METHODS:
            raise UsageError(f"an int8 method ({', '.join(METHODS)}) applies to int8 weights, not {kind} "
                             f"{int8_method!r}")
        params.update(method=int8_method, block_size=INT8_BLOCK_SIZE[int8_method])
    return with_block_size(params, block_size)


def with_block_size(params: dict, block_size: int | None) -> dict:
    """`params` with every block-wise part in blocks of `block_size` (the --block-size flag), when it is given."""
    if block_size is not None:
        params["block_size"] = params["embedding_block_size"] = block_size
    return params


def describe_quantization(kind: str, block_size: int | None = None, int8_method: str | None = None) -> str:
    """What `kind` builds on this CPU (with --block-size `block_size`, --int8-method `int8_method`), for --info:
    int8's method is the CPU's unless given."""
    text = f"{kind}: {_describe(quantize_params(kind, block_size, int8_method))}"
    if kind == "int8" and int8_method is not None:
        text += " (--int8-method)"
    elif kind == "int8":
        text += (" (this CPU has VNNI and no AMX)" if INT8_METHOD == "matmul_nbits"
                 else " (8-bit MatMulNBits only where the CPU has VNNI and no AMX)")
    return text


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
        importlib.import_module("onnxruntime.quantization.matmul_nbits_quantizer")  # its import logs

        root.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(sys.stderr):  # its prints are progress, not results
            yield
    finally:
        root.setLevel(level)
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)


def _describe(params: Mapping) -> str:
    tables = f"embeddings (block {params['embedding_block_size']})"
    quantized = ["LM head"] * bool(params["lm_head"]) + [tables] * bool(params["embedding"])
    also = f"{' and '.join(quantized) or 'neither LM head nor embeddings'} quantized too"
    if params["method"] == "dynamic":
        return (f"dynamic int8 MatMul ({params['weight_type']} weights, "
                f"{'per-channel' if params['per_channel'] else 'per-tensor'} scales; {also})")
    searched = ", searched ranges" if params["rounding"] == "searched" else ""
    return (f"MatMulNBits {params['bits']}-bit ({'symmetric' if params['is_symmetric'] else 'asymmetric'}, "
            f"block {params['block_size']}{searched}, accuracy level {params['accuracy_level']}; {also})")


def _check_params(kind: str, params: Mapping) -> None:
    missing, unknown = PARAMETERS - set(params), set(params) - PARAMETERS
    if missing or unknown:
        raise UsageError(f"quantization parameters for {kind} lack {', '.join(sorted(missing)) or 'nothing'} and "
                         f"have unknown {', '.join(sorted(unknown)) or 'nothing'}")
    if params["method"] not in METHODS:
        raise UsageError(f"quantization method for {kind} must be one of {', '.join(METHODS)}, got "
                         f"{params['method']!r}")
    if params["bits"] not in (4, 8):
        raise UsageError(f"MatMulNBits bits must be 4 or 8, got {params['bits']!r}")
    if params["method"] == "dynamic" and (params["bits"] != 8 or params["weight_type"] not in ("QUInt8", "QInt8")):
        raise UsageError(f"dynamic quantization is 8-bit with QUInt8 or QInt8 weights, got {params['bits']} bits and "
                         f"{params['weight_type']!r}")
    if params["bits"] != int(kind[3:]):
        raise UsageError(f"{kind} must quantize to {kind[3:]} bits, but the parameters give {params['bits']}")
    for name in ("block_size", "embedding_block_size"):
        problem = block_size_problem(params[name])
        if problem:
            raise UsageError(f"the {'block size' if name == 'block_size' else 'embedding tables block size'} "
                             f"{problem}")
    if params["accuracy_level"] not in (0, 1, 2, 3, 4):
        raise UsageError(f"MatMulNBits accuracy_level must be 0 to 4, got {params['accuracy_level']!r}")
    if params["rounding"] not in ROUNDINGS:
        raise UsageError(f"quantization rounding must be one of {', '.join(ROUNDINGS)}, got {params['rounding']!r}")
    if params["rounding"] == "searched" and (params["method"] != "matmul_nbits" or params["bits"] != 4
                                             or params["is_symmetric"]):
        raise UsageError("searched block ranges are built for asymmetric 4-bit MatMulNBits blocks; "
                         "use rounding 'nearest' for other weights")
    if params["embedding"] and not params["is_symmetric"]:
        raise UsageError("quantized embeddings need symmetric weights (GatherBlockQuantized without zero points)")


def _check_result(out: Path, export, report: Mapping) -> dict[str, int]:
    """Count the quantized nodes and check that the names the backend feeds and reads are all still there."""
    import onnx

    model = onnx.load(str(out), load_external_data=False)
    ops: dict[str, int] = {}
    for n in model.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    matmul = MATMUL_OP[report["method"]]
    for op, expected in ((matmul, report["matmuls"]), ("GatherBlockQuantized", report["gathers"])):
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
                      block_size: int | None = None, int8_method: str | None = None) -> Path:
    """The quantized graph (.onnx path) of `export` for `kind` ("int8" or "int4"), reused or (re)built.

    `block_size` replaces the kind's default block size (the --block-size flag), `int8_method` int8's method (the
    --int8-method flag); `params` replaces all of the kind's default parameters (for measuring alternatives). Both name the artifact too. A base graph that cannot be
    read, or whose weights hold a NaN or an infinity where the quantizer fails (damaged at its recorded size, which
    reuse does not see), is a `GraphLoadError` naming it: the onnxrt backend rebuilds the export once on it
    (`nndf.export.graph_reads.rebuilt_once`). A quantizer failure on sound weights is one sentence at once: exporting
    again would not change it.
    """
    from nndf.export.screened_head import strip_screen
    from nndf.export.weight_quant import quantize_graph

    defaults = quantize_params(kind, int8_method=int8_method)  # an unknown kind is refused here, whatever `params` says
    params = with_block_size(dict(defaults if params is None else params), block_size)
    _check_params(kind, params)
    try:
        for module in ("onnx", "onnxruntime.quantization"):
            importlib.import_module(module)
    except ImportError:
        raise HarnessError("quantization needs onnx and onnxruntime: pip install -e '.[onnxruntime]'") from None
    if not export.graph.is_file():
        raise HarnessError(f"the exported graph {export.graph} is missing; delete {export.folder} to re-export it")

    settings = quantize_settings(export, kind, params)

    def build(out: Path) -> None:
        import onnx

        tmp, graph_file = out.parent, out.name
        with _quiet_quantizers():
            try:  # a base damaged at its recorded size is found here: the onnxrt backend rebuilds it once
                model = onnx.load(str(export.graph), load_external_data=True)
            except Exception as exc:  # onnx raises many types for a damaged graph
                raise GraphLoadError(export.graph, exc, "onnx", "could not read", ONNX_HINT, with_type=True) from exc
            strip_screen(model)  # the screened head checks the fp32 head's argmax: a quantized head has its own
            try:
                counts = prepare_graph(model)
                nodes = weight_matmuls(model)
            except Exception as exc:  # a graph that reads but is not shaped as ours: one sentence and the cause
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
                report = quantize_graph(model, nodes, params, out, tmp / "prepared")
            except HarnessError:
                raise
            except Exception as exc:  # the quantizer raises many types: damaged weights ("scale issue") among them
                if refused_by_the_disk(exc):  # a full disk under its save: nothing to say about the graph
                    raise
                if non_finite_weights(model):  # damaged at its recorded size: the onnxrt backend rebuilds it once
                    raise GraphLoadError(export.graph, exc, f"{kind} quantization", "failed on", QUANTIZER_HINT,
                                         with_type=True) from exc
                raise HarnessError(f"{kind} quantization failed on {export.graph}, whose weights are all finite "
                                   f"numbers ({first_line(exc, with_type=True)}): check {QUANTIZER_HINT}") from exc
        head = "the LM head among them" if report["lm_head"] else "not the LM head"
        say(f"  {report['matmuls']} MatMuls quantized ({head}), {report['gathers']} embedding lookups"
            + (f"; {', '.join(report['fp32_tables'])} kept in fp32 (width not a multiple of the block)"
               if report["fp32_tables"] else ""))
        _check_result(out, export, report)
        # quantize_dynamic leaves a shape-inferred copy behind in some versions: keep only the graph and its data.
        for extra in tmp.iterdir():
            if extra.name not in (graph_file, graph_file + ".data"):
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()

    return derived_graph(export, kind, settings, working_dir, build,
                         f"quantizing {export.graph} to {kind}: {_describe(params)} ...")
