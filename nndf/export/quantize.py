"""int8 / int4 weight quantization of an exported decoder graph for ONNX Runtime on the CPU.

`quantized_decoder(export, kind, working_dir)` returns a quantized copy of the fp32 graph of `nndf.export.onnx`,
kept in the working dir as a folder artifact (graph + one external weight file, metadata beside it) that is reused
while its metadata (source export, kind, every quantization parameter, ONNX Runtime's version, QUANTIZER_REVISION)
matches and its files have their recorded sizes, and rebuilt with a message otherwise. The graph keeps the fp32
graph's input and output names, so the onnxrt backend runs it exactly like the fp32 one.

What the exporter gives us (torch dynamo exporter, optimize=True; inspected on GPT-2): every Conv1D (attention
qkv and output projections, MLP up and down) is a 2-D `Gemm(Reshape(x, [-1, K]), W[K, N], bias)` followed by a
Reshape back to 3-D, with alpha = beta = 1 and no transposes (the bias input is absent when it was all zeros, as
in randomly initialised models); attention's two MatMuls multiply activations; and the tied LM head is
`MatMul(h, Transpose(wte))`, whose output is `logits`, with `wte` the one initializer the embedding `Gather` also
reads. Hence, on a copy of the graph and before quantizing (`prepare_graph`):

1. Each `Gemm` with a constant weight becomes `MatMul(x, W)` (+ `Add(bias)`) under the Gemm's output name: ORT's
   weight-only quantizer handles MatMul only ("Unsupported operator Gemm for weight only quantization"), and
   restricting both quantizers to one op type keeps them off everything else. transB = 1 transposes the constant;
   a Gemm with other alpha/beta/transA, or whose weight is not a constant, stays in fp32 (and is reported). When
   the shapes the exporter recorded prove it, the Reshapes to 2-D and back are dropped too (MatMul broadcasts over
   leading dims): 6 of the 8 per GPT-2 layer, ~5% of a batch-1 decode step.
2. Each `MatMul(x, Transpose(W))` with a constant 2-D `W` reads its own constant `W.T` instead. Both quantizers
   need a constant weight and skip the tied LM head otherwise, yet it is the largest matrix of a small model (38 M
   of GPT-2 small's 124 M parameters: ~6 ms/step at batch 1). The Gather keeps the fp32 table, so embeddings stay
   exact; the price is a second (quantized) copy of the table in the file. An untied weight read only through
   the Transpose is replaced by its copy.
3. Nodes left unread (the Transposes, the shape arithmetic of dropped Reshapes) are removed.

Then (defaults in INT8 / INT4, every parameter can be overridden for measurements):

- int8: `quantize_dynamic` restricted to those MatMuls: weights quantized offline to int8 with one scale per output
  column, activations per call (DynamicQuantizeLinear + MatMulInteger, fused by ORT into DynamicQuantizeMatMul).
  Run on the untouched graph it is slower than fp32: it quantizes the tied embedding, which is then dequantized and
  transposed at every step.
- int4: `MatMulNBitsQuantizer`, symmetric 4-bit blocks of 32 along K (K is padded to whole blocks by the quantizer,
  so any width works), accuracy_level 4 (int8 activations in the kernel; the default fp32 kernel is far slower).

Measured (ORT 1.31.1, 2 cores, GPT-2 small random weights, 64 prompt + 64 new tokens, medians of 5 interleaved
runs after a warm-up; ratios against Hugging Face eager fp32 generate() = 27-28 ms/step and 72-74 tok/s at batch 4;
fidelity on the trained tiny GPT-2 of ../shared/data against fp32 PyTorch, 200 memorised LAMBADA passages sampled
from 2500-2999: top-1 agreement over all 16k positions, mean KL, lm-eval acc / ppl (fp32: 1.000 / 1.13)):

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
than uint8 here. For int4 the block size of the layers decides fidelity (the LM head's block matters little), and
small blocks cost batch-4 throughput in the prefill (MatMulNBits with 256 rows is slower than fp32). With attention
exported from Hugging Face's eager implementation instead of SDPA, the same quantized graphs reach int8 0.30x /
4.48x, int4 block 32 0.25x / 3.34x and block 128 0.20x / 3.97x: SDPA's export transposes the whole key cache at
every step (Reshape-Transpose-Reshape, which ORT cannot fuse into the MatMul).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
from pathlib import Path
from typing import Mapping

from nndf.errors import HarnessError, UsageError
from nndf.export.onnx import derived_graph
from nndf.workspace import read_metadata

# Bump when a change here changes the graphs produced, so that old quantized graphs are rebuilt rather than reused.
QUANTIZER_REVISION = 2

# The parameters of each kind. Every one of them is part of the artifact's settings (and so of its name).
INT8 = {"method": "dynamic", "weight_type": "QInt8", "per_channel": True, "reduce_range": False}
INT4 = {"method": "matmul_nbits", "bits": 4, "block_size": 32, "is_symmetric": True, "accuracy_level": 4}
KINDS: dict[str, dict] = {"int8": INT8, "int4": INT4}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
# Graph preparation
# ----------------------------------------------------------------------------------------------------------------


def _attr(node, name: str, default):
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def prepare_graph(model) -> dict[str, int]:
    """Rewrite `model` (an onnx ModelProto with its weights loaded) in place for weight quantization.

    Gemm -> MatMul (+ Add) and MatMul(x, Transpose(W)) -> MatMul(x, W.T) as in the module docstring; returns counts
    of what was rewritten and of what was left alone. Node output names, graph inputs and outputs do not change.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    used_names = {n.name for n in graph.node} | {o for n in graph.node for o in n.output} | set(inits)
    used_names |= {i.name for i in graph.input}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in used_names:
            name, k = f"{base}_{k}", k + 1
        used_names.add(name)
        return name

    copies: dict[str, str] = {}  # initializer -> its transposed copy (one however many nodes read it)

    def transposed(source: str) -> str:
        if source not in copies:
            copy = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(inits[source]).T),
                                           fresh(f"{source}.transposed"))
            graph.initializer.append(copy)
            inits[copy.name] = copy
            copies[source] = copy.name
        return copies[source]

    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*graph.value_info, *graph.input, *graph.output] if v.type.tensor_type.HasField("shape")}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in graph.output}

    def unflattened(node, k: int, n: int):
        """(x, y, reshapes) when `node` is Reshape(x, [-1, K]) -> node -> Reshape(., x.shape[:-1] + [N]) = y."""
        flatten = producers.get(node.input[0])
        after = readers.get(node.output[0], [])
        if flatten is None or flatten.op_type != "Reshape" or len(readers[node.input[0]]) != 1:
            return None
        if len(after) != 1 or after[0].op_type != "Reshape" or node.output[0] in outputs:
            return None
        x, y = flatten.input[0], after[0].output[0]
        source, target = shapes.get(x), shapes.get(y)
        if not source or not target or any(d in (0, "") for d in source + target):
            return None  # unknown dims: cannot prove that MatMul on x gives y's shape
        if len(source) < 2 or source[-1] != k or target != source[:-1] + [n]:
            return None
        return x, y, (flatten, after[0])

    counts = {"gemm_rewritten": 0, "gemm_left": 0, "transposed_weights": 0, "reshapes_removed": 0}
    dropped: set[int] = set()
    new_nodes = []
    for node in graph.node:
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
        trans_a, trans_b = _attr(node, "transA", 0), _attr(node, "transB", 0)
        weight = node.input[1]
        if alpha != 1.0 or beta != 1.0 or trans_a or weight not in inits:
            counts["gemm_left"] += 1
            new_nodes.append(node)
            continue
        if trans_b:
            weight = transposed(weight)
        x, y = node.input[0], node.output[0]
        folded = unflattened(node, *inits[weight].dims)
        if folded is not None:  # MatMul broadcasts over leading dims: the Reshapes to 2-D and back are not needed
            x, y, reshapes = folded
            dropped.update(id(r) for r in reshapes)
            counts["reshapes_removed"] += 2
        has_bias = len(node.input) > 2 and node.input[2] != ""
        product = fresh(f"{y}_matmul") if has_bias else y
        stem = node.name or "gemm"
        new_nodes.append(helper.make_node("MatMul", [x, weight], [product], name=fresh(f"{stem}_MatMul")))
        if has_bias:
            new_nodes.append(helper.make_node("Add", [product, node.input[2]], [y], name=fresh(f"{stem}_bias")))
        counts["gemm_rewritten"] += 1
    del graph.node[:]
    graph.node.extend(n for n in new_nodes if id(n) not in dropped)

    producers = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] in inits:
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in inits:
            continue
        if len(inits[transpose.input[0]].dims) != 2 or list(_attr(transpose, "perm", [1, 0])) != [1, 0]:
            continue
        node.input[1] = transposed(transpose.input[0])
        counts["transposed_weights"] += 1

    # Drop what the rewrites left unread: Transposes of constants, the shape arithmetic of removed Reshapes, and
    # untied weights whose transposed copy replaced them. (ONNX ops have no side effects: an unread node is dead.)
    while True:
        read = {x for n in graph.node for x in n.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    for index in reversed([k for k, i in enumerate(graph.initializer) if i.name in copies and i.name not in read]):
        del inits[graph.initializer[index].name]
        del graph.initializer[index]  # by index: remove() would compare weight tensors byte by byte
    live = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | set(inits)
    for v in [v for v in graph.value_info if v.name not in live]:
        graph.value_info.remove(v)
    return counts


def weight_matmuls(model) -> list[str]:
    """Names of the MatMul nodes whose second input is a 2-D fp32 constant: the ones the quantizers replace."""
    from onnx import TensorProto

    weights = {i.name for i in model.graph.initializer if len(i.dims) == 2 and i.data_type == TensorProto.FLOAT}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


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

