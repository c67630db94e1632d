"""Quantized weights on a prepared graph (`quantize_graph`): the weight MatMuls through ONNX Runtime's quantizers,
the embedding tables as GatherBlockQuantized, the LM head as chosen.

The MatMuls go through `MatMulNBitsQuantizer` (method "matmul_nbits": symmetric or not, blocks along K,
`accuracy_level` from the parameters; `rounding` "searched" gives it `nndf.export.block_search`'s blocks) or `quantize_dynamic` (method "dynamic": int8 weights with per-channel
scales, activations quantized at every call; ORT fuses DynamicQuantizeLinear + MatMulInteger). The embedding
lookups are ours, because ORT 1.32's quantizer quantizes a Gather only to 4
bits, as an int4-typed table: here a table is quantized by the same routine as a MatMul weight (the table's rows
being a MatMul's output columns, its columns K), so that its blocks and rounding are exactly those of a tied LM
head, and stored as uint8 with `bits` 4 or 8, which ORT's CPU GatherBlockQuantized reads (symmetric weights: no
zero points, the op's default 2^(bits-1) is MatMulNBits'; asymmetric weights are refused with embeddings). A
table whose width is not a whole number of blocks stays fp32 and is reported.

Whether the LM head and the embeddings are quantized is a parameter of each (see nndf.export.quantize for what
each costs in agreement with fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from nndf.export.weight_graph import node_attribute, weight_matmuls


def lm_head(model) -> str | None:
    """The weight MatMul that computes `logits` (through at most a few elementwise nodes, e.g. soft-capping), or
    None when the graph has no such output or reaches it otherwise."""
    producers = {o: n for n in model.graph.node for o in n.output}
    weights = set(weight_matmuls(model))
    node = producers.get("logits")
    for _ in range(8):
        if node is None:
            return None
        if node.name in weights:
            return node.name
        node = producers.get(node.input[0]) if node.input else None
    return None


def _quantize_matmuls(model, nodes: list[str], excluded: list[str], params: Mapping):
    """MatMulNBits for `nodes` but not `excluded`; returns ORT's ONNXModel wrapper (its `.model` is the graph).

    (ORT's quantizer takes every MatMul with a constant weight whatever `nodes_to_include` says: only
    `nodes_to_exclude` keeps one out.)"""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(
        block_size=int(params["block_size"]), is_symmetric=bool(params["is_symmetric"]),
        accuracy_level=int(params["accuracy_level"]), op_types_to_quantize=("MatMul",), bits=int(params["bits"]),
    )
    quantizer = MatMulNBitsQuantizer(model, nodes_to_include=nodes, nodes_to_exclude=excluded, algo_config=config)
    if params["rounding"] == "searched":  # ORT's nodes and packing, each block's range searched (block_search)
        from nndf.export.block_search import SearchedBlocks

        quantizer.node_quantizer = SearchedBlocks(config)
    quantizer.process()
    return quantizer.model


def quantize_embeddings(model, bits: int, block_size: int) -> tuple[int, list[str]]:
    """Each Gather (axis 0) from a 2-D fp32 table -> GatherBlockQuantized on a `bits`-bit copy, symmetric blocks of
    `block_size` along the rows; the fp32 tables no longer read are dropped. Returns (Gathers replaced, tables left
    in fp32 because their width is not a multiple of the block)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                  DefaultWeightOnlyQuantizer)

    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=True, bits=bits))
    graph = model.graph
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    inits = {i.name: i for i in graph.initializer}
    quantized: dict[str, tuple[str, str]] = {}  # fp32 table -> (its data, its scales)
    left: list[str] = []
    replaced = 0
    for node in graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" and node.domain in ("", "ai.onnx") else None
        if table is None or len(table.dims) != 2 or table.data_type != TensorProto.FLOAT:
            continue
        if node_attribute(node, "axis", 0) != 0:
            continue
        rows, cols = table.dims
        if cols % block_size:
            left.append(table.name)
            continue
        if table.name not in quantized:
            weight = np.ascontiguousarray(numpy_helper.to_array(table).T)  # K = the table's width, N = its rows
            packed, scales, _ = quantizer.qbits_block_quant(weight)  # [rows, blocks, block bytes], [rows, blocks]
            data = numpy_helper.from_array(packed.reshape(rows, -1), f"{table.name}_Q{bits}")
            scale = numpy_helper.from_array(scales, f"{table.name}_Q{bits}_scales")
            graph.initializer.extend([data, scale])
            quantized[table.name] = (data.name, scale.name)
        data, scale = quantized[table.name]
        node.CopyFrom(helper.make_node(
            "GatherBlockQuantized", [data, node.input[1], scale], list(node.output), name=node.name,
            domain="com.microsoft", bits=bits, block_size=block_size, gather_axis=0, quantize_axis=1))
        replaced += 1
    read = {x for n in graph.node for x in n.input}
    for index in reversed([k for k, i in enumerate(graph.initializer) if i.name in quantized and i.name not in read]):
        del graph.initializer[index]  # by index: remove() would compare weight tensors byte by byte
    return replaced, sorted(set(left))


def _quantize_dynamic(model, nodes: list[str], params: Mapping, out: Path, scratch: Path) -> None:
    """quantize_dynamic on `nodes`, which reads the graph from a file: saved to `scratch` first, removed after."""
    import shutil

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    scratch.mkdir()
    prepared = scratch / out.name
    onnx.save_model(model, str(prepared), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data")
    quantize_dynamic(
        prepared, out, op_types_to_quantize=["MatMul"], nodes_to_quantize=nodes,
        per_channel=bool(params["per_channel"]), weight_type=getattr(QuantType, params["weight_type"]),
        use_external_data_format=True, extra_options={"MatMulConstBOnly": True},
    )
    shutil.rmtree(scratch)


def quantize_graph(model, nodes: list[str], params: Mapping, out: Path, scratch: Path) -> dict[str, object]:
    """Quantize the MatMuls `nodes` of a prepared graph (nndf.export.weight_graph) and its embeddings as `params` say
    (nndf.export.quantize) and write the result to `out` (weights in `out`.data; `scratch`, a folder that must not
    exist, holds the dynamic quantizer's input for a while).

    Returns what was done: the method, MatMuls quantized, whether the LM head was among them, Gathers quantized,
    tables left in fp32."""
    head = lm_head(model)
    excluded = [head] if head is not None and not params["lm_head"] else []
    nodes = [n for n in nodes if n not in excluded]
    report: dict[str, object] = {"method": params["method"], "matmuls": len(nodes),
                                 "lm_head": head is not None and head in nodes, "gathers": 0, "fp32_tables": []}
    if params["embedding"]:
        report["gathers"], report["fp32_tables"] = quantize_embeddings(
            model, int(params["bits"]), int(params["embedding_block_size"]))
    if params["method"] == "dynamic":
        _quantize_dynamic(model, nodes, params, out, scratch)
    else:
        _quantize_matmuls(model, nodes, excluded, params).save_model_to_file(str(out), use_external_data_format=True)
    return report
