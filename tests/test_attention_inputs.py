"""GroupQueryAttention rotating its own queries and keys (nndf.export.attention_inputs.rotate_in_attention), on a
graph of one attention layer as the shared layout's export leaves it (a packed projection's Split, two
RotaryEmbeddings, the node): the rewritten graph gives the same outputs and the same cache as the original on a
left-padded prompt and the decode step after it, where the step's tables hold fewer entries than the total length.
The families' exports are checked against generate() in tests/test_kv_layout.py."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nndf.export import attention_inputs

ROWS, HEADS, KV_HEADS, SIZE, LENGTH = 2, 4, 2, 16, 16
WIDTH = (HEADS + 2 * KV_HEADS) * SIZE


def _layer(size: int = SIZE) -> onnx.ModelProto:
    def typed(name, kind, shape):
        return helper.make_tensor_value_info(name, kind, shape)

    widths = helper.make_tensor("widths", TensorProto.INT64, [3], [HEADS * size, KV_HEADS * size, KV_HEADS * size])
    nodes = [
        helper.make_node("Split", ["qkv", "widths"], ["q", "k", "v"], axis=-1),
        helper.make_node("RotaryEmbedding", ["q", "positions", "cos", "sin"], ["q_rotated"], domain="com.microsoft",
                         num_heads=HEADS, interleaved=0),
        helper.make_node("RotaryEmbedding", ["k", "positions", "cos", "sin"], ["k_rotated"], domain="com.microsoft",
                         num_heads=KV_HEADS, interleaved=0),
        helper.make_node("GroupQueryAttention", ["q_rotated", "k_rotated", "v", "past_key", "past_value",
                                                 "seqlens_k", "total", "", "", "", "bias"],
                         ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=HEADS,
                         kv_num_heads=KV_HEADS)]
    inputs = [typed("qkv", TensorProto.FLOAT, ["rows", "new", (HEADS + 2 * KV_HEADS) * size]),
              typed("positions", TensorProto.INT64, ["rows", "new"]),
              typed("cos", TensorProto.FLOAT, ["entries", size // 2]),
              typed("sin", TensorProto.FLOAT, ["entries", size // 2]),
              typed("past_key", TensorProto.FLOAT, ["rows", KV_HEADS, LENGTH, size]),
              typed("past_value", TensorProto.FLOAT, ["rows", KV_HEADS, LENGTH, size]),
              typed("seqlens_k", TensorProto.INT32, ["rows"]), typed("total", TensorProto.INT32, []),
              typed("bias", TensorProto.FLOAT, ["rows", 1, "new", "all"])]
    outputs = [typed(name, TensorProto.FLOAT, None) for name in ("out", "present_key", "present_value")]
    graph = helper.make_graph(nodes, "layer", inputs, outputs, initializer=[widths])
    return helper.make_model(graph, ir_version=10,
                             opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def _rewritten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    graph = ir.from_proto(model)
    count = attention_inputs.rotate_in_attention(graph)
    return ir.to_proto(graph), count


def _step(positions: np.ndarray, padding: list[int], total: int, seed: int) -> dict[str, np.ndarray]:
    """A step's inputs as the export computes them: each token's own table entry (rows x new entries, from its
    position in its row, pads at position 1 as transformers puts them) and the additive mask of left padding."""
    rng = np.random.default_rng(seed)
    rows, new = positions.shape
    frequencies = 1.0 / (10000 ** (np.arange(0, SIZE, 2) / SIZE))
    angles = positions.reshape(-1, 1) * frequencies
    masked = np.zeros((rows, 1, new, total), bool)
    for row, pads in enumerate(padding):
        masked[row, :, :, :pads] = True
    masked |= np.triu(np.ones((new, total), bool), k=total - new + 1)  # causal: no later position
    bias = np.where(masked, np.finfo(np.float32).min, 0).astype(np.float32)
    return {"qkv": rng.standard_normal((rows, new, WIDTH)).astype(np.float32),
            "positions": np.arange(rows * new).reshape(rows, new),
            "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32),
            "seqlens_k": np.full(rows, total - 1, np.int32), "total": np.array(total, np.int32), "bias": bias}


def _generate(model: onnx.ModelProto) -> list[np.ndarray]:
    """A left-padded prompt of 5 (the second row 2 pads), then one decode step; outputs of both and the cache."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    padding = [0, 2]
    prompt = np.array([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]])
    cache = {name: np.zeros((ROWS, KV_HEADS, LENGTH, SIZE), np.float32) for name in ("past_key", "past_value")}
    out, key, value = session.run(None, {**_step(prompt, padding, 5, seed=0), **cache})
    cache = {"past_key": key, "past_value": value}
    step_out, key, value = session.run(None, {**_step(np.array([[5], [3]]), padding, 6, seed=1), **cache})
    return [out, step_out, key[:, :, :6], value[:, :, :6]]


def test_attention_rotating_its_inputs_equals_the_rotary_nodes_on_a_left_padded_batch():
    if not attention_inputs.kernel_reads_query_seqlens():  # the rewrite declines there (the next test)
        pytest.skip(f"ONNX Runtime {ort.__version__}'s GroupQueryAttention has no query_seqlens input (1.32 has)")
    original = _layer()
    rewritten, count = _rewritten(original)
    assert count == 1
    kinds = [node.op_type for node in rewritten.graph.node]
    assert "RotaryEmbedding" not in kinds and "Split" not in kinds
    attention = next(node for node in rewritten.graph.node if node.op_type == "GroupQueryAttention")
    assert {a.name: helper.get_attribute_value(a) for a in attention.attribute}["do_rotary"] == 1
    assert "widths" not in {tensor.name for tensor in rewritten.graph.initializer}
    for theirs, ours in zip(_generate(original), _generate(rewritten)):
        np.testing.assert_allclose(ours, theirs, atol=2e-6, rtol=0)


def test_without_query_seqlens_in_the_kernel_the_rotary_nodes_stay(monkeypatch):
    """An ONNX Runtime whose kernel has no `query_seqlens` would rotate a left-padded prompt's rows from the first
    row's position: the graph keeps its RotaryEmbeddings there."""
    monkeypatch.setattr(attention_inputs, "kernel_reads_query_seqlens", lambda: False)
    rewritten, count = _rewritten(_layer())
    assert count == 0 and [node.op_type for node in rewritten.graph.node].count("RotaryEmbedding") == 2


@pytest.mark.parametrize("size", [8, 24])
def test_head_sizes_the_kernels_rotary_refuses_keep_the_rotary_nodes(size):
    """The kernel rotates heads in sizes of 16 only (ONNX Runtime 1.32's CPU kernel refuses 8 and 24)."""
    assert _rewritten(_layer(size))[1] == 0
