"""The quantizer's pieces on small hand-made graphs, and the choices it makes for this CPU: the LM head and
embedding quantization, the Gemm and tied-weight rewrite, the int8 weight type and MatMulNBits accuracy level (the
exported-model tests are in test_quantize.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nndf.export.cpu_int8 import int8_method, int8_weight_type, nbits_accuracy_level, screen_weight_levels
from nndf.export.weight_quant import lm_head, quantize_graph
from nndf.export.quantize import KINDS, MATMUL_OP, quantize_params
from nndf.export.weight_graph import prepare_graph, weight_matmuls


def _tied_graph(rows: int = 40, width: int = 32):
    """Gather from a table, a Gemm, and the tied head MatMul(h, Transpose(table)) -> logits; a second, narrower
    table (width 24) is gathered too. Returns (model, feeds, table): fed h = I, the logits are the head's weights,
    transposed (the head's rows are the table's)."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((rows, width)).astype(np.float32)
    narrow = rng.standard_normal((7, 24)).astype(np.float32)
    w = rng.standard_normal((width, width)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
             helper.make_node("Gather", ["narrow", "ids7"], ["e2"], name="embed2"),
             helper.make_node("Gemm", ["x", "w"], ["y"], name="fc"),
             helper.make_node("Transpose", ["table"], ["tableT"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "tableT"], ["logits"], name="head")]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [width, width]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [width, width]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [rows]),
         helper.make_tensor_value_info("ids7", TensorProto.INT64, [7])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("e", "e2", "y", "logits")],
        [numpy_helper.from_array(a, n) for a, n in ((table, "table"), (narrow, "narrow"), (w, "w"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    feeds = {"x": w, "h": np.eye(width, dtype=np.float32), "ids": np.arange(rows), "ids7": np.arange(7)}
    return model, feeds, table


@pytest.mark.parametrize("method, bits", [("matmul_nbits", 8), ("matmul_nbits", 4), ("dynamic", 8)])
@pytest.mark.parametrize("head, embedding", [(True, True), (False, True), (True, False)])
def test_lm_head_and_embedding_quantization_as_chosen(method, bits, head, embedding, tmp_path):
    """The LM head is quantized or kept fp32 as `lm_head` says; an embedding table becomes GatherBlockQuantized on
    the very blocks a tied MatMulNBits head gets (its rows dequantize to the head's weights exactly), and a table
    whose width is not a whole number of blocks stays fp32 and is reported."""
    import onnxruntime as ort

    model, feeds, table = _tied_graph()
    prepare_graph(model)
    assert lm_head(model) == "head"
    params = dict(quantize_params(f"int{bits}", block_size=16), method=method, lm_head=head, embedding=embedding,
                  accuracy_level=0,  # fp32 compute: the head's output is its dequantized weights, unrounded
                  is_symmetric=True, rounding="nearest")  # quantized tables take symmetric blocks only
    out = tmp_path / "q.onnx"
    report = quantize_graph(model, weight_matmuls(model), params, out, tmp_path / "scratch")
    assert out.is_file() and not (tmp_path / "scratch").exists()
    graph = onnx.load(str(out)).graph
    ops = [n.op_type for n in graph.node]
    quantized_op = MATMUL_OP[method]
    assert report["lm_head"] is head and report["matmuls"] == 1 + head  # the Gemm's MatMul, and the head if chosen
    assert ops.count(quantized_op) == 1 + head and ops.count("MatMul") == (not head)
    assert ops.count("GatherBlockQuantized") == (1 if embedding else 0)
    assert report["fp32_tables"] == (["narrow"] if embedding else [])
    assert ("table" in {i.name for i in graph.initializer}) is (not embedding)  # the head reads its own copy
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    e, e2, _, logits = session.run(None, feeds)
    np.testing.assert_array_equal(e2, numpy_helper.to_array(next(i for i in graph.initializer if i.name == "narrow")))
    step = np.abs(table).max(axis=1, keepdims=True) / (127 if bits == 8 else 7)  # about one quantization step
    if embedding:
        assert 0 < np.abs(e - table).max() <= step.max()
        if head and method == "matmul_nbits":
            np.testing.assert_allclose(e, logits.T, rtol=1e-5, atol=1e-5)  # same blocks, same rounding
    else:
        np.testing.assert_array_equal(e, table)
    if not head:
        np.testing.assert_allclose(logits.T, table, rtol=1e-4, atol=1e-4)


def test_prepare_graph_rewrites_gemm_and_tied_weights_without_changing_results():
    """Gemm (transB 0 and 1, with and without bias) -> MatMul (+Add); MatMul(x, Transpose(W)) -> MatMul(x, W.T);
    a Gemm with alpha != 1 is left alone. ORT gives the same outputs before and after."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w1, b1, w2, w3 = (rng.standard_normal(s).astype(np.float32) for s in [(8, 6), (6,), (6, 5), (6, 6)])
    emb = rng.standard_normal((11, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="g1"),  # (3,8)@(8,6)+b
        helper.make_node("Gemm", ["x5", "w2"], ["h2"], name="g2", transB=1),  # (3,5)@(6,5)^T
        helper.make_node("Gemm", ["h1", "w3"], ["h3"], name="g3", alpha=0.5),  # left alone
        helper.make_node("Add", ["h2", "h3"], ["h"]),
        helper.make_node("Gather", ["emb", "ids"], ["e"]),  # tied: the embedding table is also the head
        helper.make_node("Transpose", ["emb"], ["embT"], perm=[1, 0]),
        helper.make_node("MatMul", ["x5", "embT"], ["logits"], name="head"),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in [(w1, "w1"), (b1, "b1"), (w2, "w2"), (w3, "w3"), (emb, "emb")]]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8]),
         helper.make_tensor_value_info("x5", TensorProto.FLOAT, [3, 5]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("h", [3, 6]), ("e", [4, 5]),
                                                                        ("logits", [3, 11]))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32),
             "x5": rng.standard_normal((3, 5)).astype(np.float32), "ids": np.array([0, 3, 10, 3])}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    before = run(model)

    counts = prepare_graph(model)
    assert counts == {"gemm_rewritten": 2, "gemm_left": 1, "transposed_weights": 1, "reshapes_removed": 0}
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Gemm") == 1 and "Transpose" not in ops
    inits_after = {i.name for i in model.graph.initializer}
    weights = {n.name: n.input[1] for n in model.graph.node if n.op_type == "MatMul"}
    assert len(weights) == 3 and set(weights.values()) <= inits_after
    assert "emb" in inits_after  # the Gather keeps the table
    for a, b in zip(before, run(model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_int8_weight_type_follows_the_cpu():
    """int8 weights only where ORT's uint8 x int8 kernel is exact: x86 with VNNI or AMX, and non-x86 CPUs."""
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    avx512 = "flags\t\t: fpu avx2 avx512f avx512bw avx512vl\n"
    assert int8_weight_type("x86_64", avx2) == "QUInt8"
    assert int8_weight_type("AMD64", avx512) == "QUInt8"  # AVX-512 without VNNI saturates too
    assert int8_weight_type("x86_64", avx512.replace("avx512vl", "avx512vl avx512_vnni")) == "QInt8"
    assert int8_weight_type("x86_64", avx2.replace("fma", "fma avx_vnni")) == "QInt8"
    assert int8_weight_type("x86_64", "") == "QUInt8"  # flags unknown: the exact kernel
    assert int8_weight_type("aarch64", "") == "QInt8" and int8_weight_type("arm64", None) == "QInt8"
    # the screened head's int8 weights: 8-bit where those products are exact, 7-bit (no saturation) elsewhere
    assert screen_weight_levels("x86_64", avx2) == screen_weight_levels("x86_64", avx512) == 63
    assert screen_weight_levels("x86_64", avx512.replace("avx512vl", "amx_int8")) == 127
    assert screen_weight_levels("aarch64", "") == 127


def test_int8_method_follows_the_cpu():
    """int8 by 8-bit MatMulNBits where the CPU has VNNI and no AMX (its block kernel beats MatMulInteger's at one
    row there), else by dynamic quantization (AMX's GEMM, or no int8 dot products)."""
    avx512 = "flags\t\t: fpu avx2 avx512f avx512bw avx512vl\n"
    vnni = avx512.replace("avx512vl", "avx512vl avx512_vnni")
    assert int8_method("x86_64", vnni) == "matmul_nbits"
    assert int8_method("x86_64", avx512.replace("avx2", "avx2 avx_vnni")) == "matmul_nbits"
    assert int8_method("x86_64", vnni.replace("avx512vl", "avx512vl amx_int8")) == "dynamic"
    assert int8_method("x86_64", avx512) == "dynamic"
    assert int8_method("x86_64", "") == int8_method("aarch64", vnni) == "dynamic"


def test_nbits_accuracy_level_is_int8_compute_where_mlas_has_it():
    """Level 4 (int8 dot products) on x86-64 with AVX2 and ARM64 with dot products; fp32 compute elsewhere."""
    assert nbits_accuracy_level("x86_64", "flags\t: fpu sse2 avx avx2 fma\n") == 4
    assert nbits_accuracy_level("x86_64", "flags\t: fpu sse2 sse4_2 avx\n") == 1  # Sandy Bridge: no AVX2 kernels
    assert nbits_accuracy_level("x86_64", "") == 4  # flags unknown: every x86-64 since 2013 has AVX2
    assert nbits_accuracy_level("aarch64", "Features\t: fp asimd aes crc32 asimddp\n") == 4
    assert nbits_accuracy_level("aarch64", "Features\t: fp asimd aes crc32\n") == 1  # Cortex-A72: no dot product
    assert nbits_accuracy_level("riscv64", "") == 1
    assert KINDS["int8"]["accuracy_level"] == KINDS["int4"]["accuracy_level"] == nbits_accuracy_level()


def test_default_int8_weight_type_multiplies_exactly_on_this_cpu():
    """The kernel that nndf.convert's dynamic int8 graphs run on this CPU sums large uint8 x weight products
    without saturating.

    (uint8 x int8 on x86 without VNNI: VPMADDUBSW's int16 pair sums saturate and this is off by ~40%.)"""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    m, k, n = 8, 64, 32
    a = rng.integers(200, 256, (m, k)).astype(np.uint8)
    w = rng.integers(100, 128, (k, n))
    if int8_weight_type() == "QInt8":
        b, zero, elem = w.astype(np.int8), np.zeros(n, np.int8), TensorProto.INT8
    else:
        b, zero, elem = (w + 128).astype(np.uint8), np.full(n, 128, np.uint8), TensorProto.UINT8
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b", "a_zero", "b_zero"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [m, n])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array(0, np.uint8), "a_zero"),
         numpy_helper.from_array(zero, "b_zero")])
    assert graph.initializer[0].data_type == elem
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"a": a})[0], a.astype(np.int64) @ w)


# tied head, untied head, Gemm and MatMul mixed; Llama: a tied head as SmolLM2's, Qwen2.5-0.5B's and Gemma's
