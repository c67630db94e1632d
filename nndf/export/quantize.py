"""int8 / int4 weight quantization of an exported decoder graph for ONNX Runtime on the CPU.

`quantized_decoder(export, kind, working_dir)` returns a quantized copy of the fp32 graph of `nndf.export.onnx`,
kept in the working dir as a folder artifact (graph + one external weight file, metadata beside it) that is reused
while its metadata (source export, kind, every quantization parameter, ONNX Runtime's version, QUANTIZER_REVISION)
matches and its files have their recorded sizes, and rebuilt with a message otherwise. The graph keeps the fp32
graph's input and output names, so the onnxrt backend runs it exactly like the fp32 one.

What the exporter gives us (torch dynamo exporter, optimize=True, checked on GPT-2): every Conv1D (attention qkv
and output projections, MLP up and down) is a 2-D `Gemm(x, W[K, N], bias)` with alpha = beta = 1 and no transposes
(the bias input is absent when it was all zeros, as in randomly initialised models), between Reshapes to and from
2-D; attention's two MatMuls multiply activations; and the tied LM head is `MatMul(h, Transpose(wte))` whose
output is `logits`, with `wte` the single initializer that the embedding `Gather` also reads. Hence two rewrites
on a copy of the graph before quantizing (`prepare_graph`):

1. Each `Gemm` with a constant weight becomes `MatMul(x, W)` (+ `Add(bias)`), under the Gemm's output name. ORT's
   weight-only quantizer handles MatMul only ("Unsupported operator Gemm for weight only quantization"), and
   restricting both quantizers to one op type keeps them off everything else. A Gemm with transB = 1 gets its
   constant transposed; one with other alpha/beta/transA, or a weight that is not a constant, is left in fp32.
2. Each `MatMul(x, Transpose(W))` with a constant 2-D `W` gets its own constant `W.T`. Both quantizers need a
   constant weight and skip the tied LM head otherwise, and it is the largest matrix of a small model (38 M of
   GPT-2 small's 124 M parameters; quantizing it is worth ~6 ms/step at batch 1). The embedding Gather keeps the
   fp32 table, so token embeddings are exact; the price is one extra copy of the table in the file (fp32 + int4/8).

Then:

- int8: `quantize_dynamic` restricted to the MatMuls with a constant weight: weights quantized offline, activations
  quantized per call (DynamicQuantizeLinear + MatMulInteger, fused by ORT into DynamicQuantizeMatMul). uint8
  weights, one scale per tensor was the fastest here at equal fidelity (see INT8). Run on the untouched graph it is
  slower than fp32: it quantizes the tied embedding, which is then dequantized and transposed at every step.
- int4: `MatMulNBitsQuantizer`, symmetric 4-bit blocks of 32 along K (MatMulNBits; K is padded to whole blocks by
  the quantizer), with accuracy_level 4 (int8 activations in the kernel: the fp32-activation kernel, level 0, is far
  slower). Blocks of 32 keep clearly more fidelity than 128 on a trained model at little speed cost (see INT4).

The measurements behind these choices are in /work/shared/NOTES.md ("Quantized decoding on this CPU").
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Mapping

from nndf.errors import HarnessError, UsageError
from nndf.workspace import artifact_name, build_dir_artifact, read_metadata, stale_reason

# Bump when a change here changes the graphs produced, so that old quantized graphs are rebuilt rather than reused.
QUANTIZER_REVISION = 1
GRAPH_FILE = "decoder.onnx"

# The parameters of each kind. Every one of them is part of the artifact's settings (and so of its name).
INT8 = {"method": "dynamic", "weight_type": "QUInt8", "per_channel": False, "reduce_range": False}
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
    import onnx
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

    def consumers(value: str) -> list:
        return [n for n in graph.node if value in n.input]

    counts = {"gemm_rewritten": 0, "gemm_left": 0, "transposed_weights": 0}
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
            array = numpy_helper.to_array(inits[weight]).T
            weight = fresh(f"{weight}.transposed")
            tensor = numpy_helper.from_array(np.ascontiguousarray(array), weight)
            graph.initializer.append(tensor)
            inits[weight] = tensor
        has_bias = len(node.input) > 2 and node.input[2] != ""
        product = fresh(f"{node.output[0]}_matmul") if has_bias else node.output[0]
        new_nodes.append(helper.make_node("MatMul", [node.input[0], weight], [product],
                                          name=fresh(f"{node.name or 'gemm'}_MatMul")))
        if has_bias:
            new_nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]],
                                              name=fresh(f"{node.name or 'gemm'}_bias")))
        counts["gemm_rewritten"] += 1
    del graph.node[:]
    graph.node.extend(new_nodes)

    producers = {o: n for n in graph.node for o in n.output}
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.input[1] in inits:
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in inits:
            continue
        source = inits[transpose.input[0]]
        if len(source.dims) != 2 or list(_attr(transpose, "perm", [1, 0])) != [1, 0]:
            continue
        array = numpy_helper.to_array(source).T
        name = fresh(f"{source.name}.transposed")
        tensor = numpy_helper.from_array(np.ascontiguousarray(array), name)
        graph.initializer.append(tensor)
        inits[name] = tensor
        node.input[1] = name
        counts["transposed_weights"] += 1
        if not consumers(transpose.output[0]) and transpose.output[0] not in {o.name for o in graph.output}:
            graph.node.remove(transpose)
            stale = [v for v in graph.value_info if v.name == transpose.output[0]]
            for v in stale:
                graph.value_info.remove(v)
    return counts


def weight_matmuls(model) -> list[str]:
    """Names of the MatMul nodes whose second input is a constant: the ones the quantizers should replace."""
    inits = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


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
    folder = Path(working_dir) / artifact_name(f"{export.folder.name}-{kind}", settings, "")
    io = {"input_names": list(export.input_names), "output_names": list(export.output_names)}
    metadata = dict(settings, **io)
    reason = stale_reason(folder, metadata)
    if reason is None:
        return folder / GRAPH_FILE
    if folder.exists():
        say(f"rebuilding {folder}: {reason}")
    say(f"quantizing {export.graph} to {kind}: {_describe(params)} ...")
    started = time.perf_counter()

    def build(tmp: Path) -> None:
        import onnx

        out = tmp / GRAPH_FILE
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
            left = f"; {counts['gemm_left']} Gemm left in fp32" if counts["gemm_left"] else ""
            say(f"  {len(nodes)} weight MatMuls to quantize ({counts['gemm_rewritten']} from Gemm, "
                f"{counts['transposed_weights']} from a transposed tied weight{left})")
            try:
                if params["method"] == "dynamic":
                    prep = tmp / "prepared"
                    prep.mkdir()
                    onnx.save_model(model, str(prep / GRAPH_FILE), save_as_external_data=True,
                                    all_tensors_to_one_file=True, location=GRAPH_FILE + ".data")
                    del model
                    _quantize_dynamic(prep / GRAPH_FILE, out, nodes, params)
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
            if extra.name not in (GRAPH_FILE, GRAPH_FILE + ".data"):
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()

    build_dir_artifact(folder, build, metadata)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20
    say(f"quantized in {time.perf_counter() - started:.1f} s to {folder} ({size:.0f} MiB)")
    return folder / GRAPH_FILE

