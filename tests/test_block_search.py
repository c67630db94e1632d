"""int4 blocks with searched ranges (nndf.export.block_search): closer than ONNX Runtime's rounding block by block,
in the layout its MatMulNBits kernel reads, and what the quantizer writes when the parameters ask for them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nndf.errors import UsageError
from nndf.export.block_search import pack_blocks, search_blocks, unpack_blocks
from nndf.export.quantize import KINDS, quantize_params
from nndf.export.quantize import _check_params as check_params
from nndf.export.weight_graph import prepare_graph, weight_matmuls
from nndf.export.weight_quant import quantize_graph


def _weights(k: int, n: int, seed: int = 0) -> np.ndarray:
    """Gaussian weights with a few outliers per column, as trained projections have."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[rng.integers(0, k, n), np.arange(n)] *= 6
    return w


def _matmul_nbits(k: int, n: int, block: int, packed, scales, zeros) -> onnx.ModelProto:
    node = helper.make_node("MatMulNBits", ["x", "b", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=0)  # fp32 compute: the dequantized weights, unrounded
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s"),
                               numpy_helper.from_array(zeros, "z")])
    return helper.make_model(graph, ir_version=10,
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _nearest(w: np.ndarray, block: int) -> np.ndarray:
    """ONNX Runtime's own asymmetric rounding of `w`, dequantized."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    k, n = w.shape
    count = -(-k // block)
    packed = np.zeros((n, count, block // 2), np.uint8)
    zeros = np.zeros((n, -(-count // 2)), np.uint8)
    scales = np.zeros((n, count), np.float32)
    quantize_matmul_4bits(packed, w, scales, zeros, block, n, k, False)
    return unpack_blocks(packed, scales, zeros, k)


@pytest.mark.parametrize("k, block", [(256, 64), (96, 64), (200, 128)])
def test_searched_blocks_are_what_the_kernel_computes_and_closer_than_rounding(k, block):
    """K not a whole number of blocks and an odd block count included: the kernel multiplies by exactly the weights
    `unpack_blocks` reads, every block's squared error is at most ONNX Runtime's rounding's, and in all smaller."""
    import onnxruntime as ort

    n = 48
    w = _weights(k, n)
    packed, scales, zeros = pack_blocks(w, block)
    count = -(-k // block)
    assert packed.shape == (n, count, block // 2) and scales.shape == (n, count) and zeros.shape == (n, -(-count // 2))
    ours = unpack_blocks(packed, scales, zeros, k)
    session = ort.InferenceSession(_matmul_nbits(k, n, block, packed, scales, zeros).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": np.eye(k, dtype=np.float32)})[0], ours, rtol=1e-6, atol=1e-6)

    padded = lambda a: np.pad(a, ((0, count * block - k), (0, 0))).T.reshape(n * count, block)
    searched = ((padded(ours) - padded(w)) ** 2).sum(axis=1)
    nearest = ((padded(_nearest(w, block)) - padded(w)) ** 2).sum(axis=1)
    assert (searched <= nearest * (1 + 1e-5) + 1e-9).all()
    assert searched.sum() < 0.95 * nearest.sum()


def test_zero_stays_exact_and_an_empty_block_is_zero():
    blocks = np.zeros((3, 64), np.float32)
    blocks[0, :32] = np.linspace(-1, 2, 32)  # half a block of weights, half zeros (as K's padding is)
    blocks[2] = 5.0  # one sign only: the range still reaches 0
    levels, scales, zeros = search_blocks(blocks)
    weights = scales[:, None] * (levels.astype(np.float32) - zeros[:, None])
    assert (weights[0, 32:] == 0).all() and (weights[1] == 0).all()
    np.testing.assert_allclose(weights[2], 5.0, rtol=1e-6)


def test_the_quantizer_writes_searched_blocks_where_the_parameters_say(tmp_path):
    """rounding "searched" (int4's default) reaches ONNX Runtime's quantizer: its MatMulNBits weights are
    `pack_blocks`' of the MatMul's weight; "nearest" gives ONNX Runtime's own rounding."""
    w = _weights(96, 40, seed=2)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 96])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    written = {}
    for rounding in ("searched", "nearest"):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
        prepare_graph(model)
        params = dict(quantize_params("int4", block_size=64), rounding=rounding)
        assert params["is_symmetric"] is False and KINDS["int4"]["rounding"] == "searched"
        out = tmp_path / f"{rounding}.onnx"
        quantize_graph(model, weight_matmuls(model), params, out, tmp_path / "scratch")
        quantized = onnx.load(str(out))
        node = next(n for n in quantized.graph.node if n.op_type == "MatMulNBits")
        tensors = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
        written[rounding] = [tensors[name] for name in node.input[1:4]]
    for ours, expected in zip(written["searched"], pack_blocks(w, 64)):
        np.testing.assert_array_equal(ours.reshape(expected.shape), expected)
    nearest = unpack_blocks(*(a.reshape(e.shape) for a, e in zip(written["nearest"], pack_blocks(w, 64))), 96)
    np.testing.assert_allclose(nearest, _nearest(w, 64), rtol=1e-6)


@pytest.mark.parametrize("change", [{"is_symmetric": True}, {"bits": 8}, {"rounding": "stochastic"}])
def test_a_search_is_refused_where_it_is_not_built(change):
    kind = "int8" if change.get("bits") == 8 else "int4"
    params = dict(KINDS["int4"], **change)
    with pytest.raises(UsageError, match="searched block ranges are built for asymmetric 4-bit|rounding must be one"):
        check_params(kind, params)
