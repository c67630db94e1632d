"""The screened LM head (nndf.export.screened_head): on a tied head, greedy search's argmax from int8 logits and a
few exact fp32 dot products must be the fp32 head's, also with tokens banned after; everything else runs the full
head; quantized graphs lose the screen. Synthetic heads with near ties check the bound; the loop's use of it (the tiny
GPT-2, sampling from the candidates): tests/test_screened_loop.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nndf.export.cpu_int8 import screen_weight_levels
from nndf.export.screened_head import (BLOCK, CANDIDATES, INPUT, THRESHOLD, UPPER, screen_constants, screen_head,
                                       strip_screen, topk_takes_no_rows)

WIDTH, VOCAB = 48, 3000


def _table(seed: int = 0) -> np.ndarray:
    """A [vocab, width] table with near twins: columns 2i and 2i + 1 differ by 1e-4 of a weight, far below the int8
    head's error, so that the screen must settle those ties with exact dot products."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32) * 0.05
    table[1::2] = table[0::2] + rng.standard_normal((VOCAB // 2, WIDTH)).astype(np.float32) * 5e-6
    return table


def _tied_model(table: np.ndarray, tied: bool = True):
    """ids -> Gather(table) -> `embedded`; h -> MatMul(h, Transpose(table)) -> `logits` (an untied head: MatMul
    over its own [width, vocab] constant), as the exporter writes GPT-2's."""
    import onnx_ir as ir

    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"])]
    inits = [numpy_helper.from_array(table, "table")]
    if tied:
        nodes += [helper.make_node("Transpose", ["table"], ["head"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "head"], ["logits"])]
    else:
        nodes += [helper.make_node("MatMul", ["h", "head"], ["logits"])]
        inits.append(numpy_helper.from_array(np.ascontiguousarray(table.T), "head"))
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"]),
                        helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "k", WIDTH])],
        [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["b", "s", WIDTH]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "k", VOCAB])], inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)],
                                                        ir_version=10))


def _session(model_proto):
    import onnxruntime as ort

    return ort.InferenceSession(model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _screened_proto(table, **kwargs):
    import onnx_ir as ir

    model = _tied_model(table)
    assert screen_head(model, **kwargs) == 1
    return ir.serde.serialize_model(model)


def _hidden(rows: int, seed: int) -> np.ndarray:
    """Hidden states with a few large dimensions, as a trained model's final norm gives (they set the int8 scale)."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, 3, WIDTH)).astype(np.float32)
    h[..., :2] *= 20
    return h


def _run(session, h, k):
    ids = np.zeros((1, 1), np.int64)
    return session.run(["logits"], {"ids": ids, "h": h, INPUT: np.array([k], np.int64)})[0]


def test_the_screened_argmax_is_the_fp32_heads_also_with_banned_tokens():
    table = _table()
    session = _session(_screened_proto(table))
    h = _hidden(40, seed=1)
    full = _run(session, h, 0)
    np.testing.assert_allclose(full, h @ table.T, rtol=1e-5, atol=1e-5)  # 0: the full head, every row, same shape
    # the top two of many rows are twins closer than the int8 error: only the exact dot products tell them apart
    top2 = np.sort(full, axis=-1)[..., -2:]
    assert ((top2[..., 1] - top2[..., 0]) < 1e-3).sum() >= 10
    for k in (1, 2, 4):
        screened = _run(session, h, k)
        assert screened.shape == full.shape
        assert np.array_equal(screened.argmax(-1), full.argmax(-1)), k
        winners = full.argmax(-1)[..., None]
        np.testing.assert_allclose(np.take_along_axis(screened, winners, -1), np.take_along_axis(full, winners, -1),
                                   rtol=1e-6, atol=1e-6)
        # the loop bans up to k - 1 tokens after the step (EOS before min_new_tokens): ban each row's k - 1 best
        banned = np.argsort(full, axis=-1)[..., ::-1][..., : k - 1]
        allowed = full.copy()
        for scores in (screened, allowed):
            np.put_along_axis(scores, banned, -np.inf, -1)
        assert np.array_equal(screened.argmax(-1), allowed.argmax(-1)), k
    # where the int8 logits are not the winners, they are approximations: a screened output is not a full one
    assert not np.allclose(_run(session, h, 1), full, atol=1e-4)


def test_an_empty_batch_and_one_row_run_either_way():
    session = _session(_screened_proto(_table()))
    for rows in (0, 1):
        h = _hidden(rows, seed=2)[:, :1]
        for k in (0, 2):
            assert _run(session, h, k).shape == (rows, 1, VOCAB)


def _topk_ranks(proto) -> str:
    """The kind of node whose output the screen's TopK ranks."""
    producers = {output: node.op_type for node in proto.graph.node for output in node.output}
    return producers[next(node for node in proto.graph.node if node.op_type == "TopK").input[0]]


def test_for_an_onnx_runtime_whose_topk_dies_on_no_rows_the_screen_ranks_a_zero_row_and_gives_the_same():
    """ONNX Runtime 1.20-1.30 kill the process (SIGFPE) on a TopK over no rows, which every full-head step of a
    screened graph asks for (beam search, scoring): graphs for those versions give TopK a zero row instead and cut
    its result back. The outputs equal the plain graph's, whichever part is empty (the crash itself is checked
    by running the suite under ONNX Runtime 1.30)."""
    table = _table()
    plain, guarded = (_screened_proto(table, topk_no_rows=flag) for flag in (True, False))
    assert (_topk_ranks(plain), _topk_ranks(guarded)) == ("Mul", "Pad")  # the int8 logits, or them padded
    plain, guarded = _session(plain), _session(guarded)
    for rows in (0, 1, 3):
        h = _hidden(rows, seed=3)
        for k in (0, 1, 4):
            feeds = {"ids": np.zeros((1, 1), np.int64), "h": h, INPUT: np.array([k], np.int64)}
            logits, candidates = guarded.run(["logits", CANDIDATES], feeds)
            if rows and k:  # the screen has rows: the plain graph runs on every version
                expected = plain.run(["logits", CANDIDATES], feeds)
                assert np.array_equal(logits, expected[0]) and np.array_equal(candidates, expected[1]), (rows, k)
            else:  # the full head over every row (the plain graph's TopK would have none)
                np.testing.assert_allclose(logits, h @ table.T, rtol=1e-5, atol=1e-5)
                assert candidates.shape == (0, 2)


def test_the_screen_follows_the_installed_onnx_runtime_unless_told(monkeypatch):
    """Without `topk_no_rows`, the screen asks the installed ONNX Runtime (`topk_takes_no_rows`): an export made
    under 1.30 gets the zero row, one made under 1.32 the plain TopK."""
    import nndf.export.screened_head as screened_head

    for takes, expected in ((False, "Pad"), (True, "Mul")):
        monkeypatch.setattr(screened_head, "topk_takes_no_rows", lambda takes=takes: takes)
        assert _topk_ranks(_screened_proto(_table())) == expected


@pytest.mark.parametrize("version, takes", [("1.30.0", False), ("1.20.1", False), ("1.31.0", True),
                                            ("1.32.0", True), ("1.33.0.dev20261101", True), ("2.0.0", True)])
def test_the_topk_guard_follows_the_installed_version(monkeypatch, version, takes):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", version)
    assert topk_takes_no_rows() is takes


def _search_outputs(proto):
    """The screened graph, also giving out each column's upper bound and each row's threshold (their node names)."""
    names = []
    for name in (UPPER, THRESHOLD):
        [node] = [node for node in proto.graph.node if node.name == name]
        proto.graph.output.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None))
        names.append(node.output[0])
    return proto, names


def test_the_candidates_are_every_column_whose_bound_reaches_the_threshold():
    """The blocked search (`_columns_reaching`) finds what a NonZero over whole rows would: every (row, column)
    whose upper bound reaches its row's threshold, row-major, none past the vocabulary (whose last block is padded
    with -inf), also in that partial block, where a whole row reaches it (a -inf threshold) and where none does."""
    from onnx.utils import Extractor

    proto, (upper_name, threshold_name) = _search_outputs(_screened_proto(_table()))
    session = _session(proto)
    h = _hidden(6, seed=7)[:, :2]  # 12 screened rows
    for k in (1, 4, 51):
        feed = {"ids": np.zeros((1, 1), np.int64), "h": h, INPUT: np.array([k], np.int64)}
        found, upper, threshold = session.run([CANDIDATES, upper_name, threshold_name], feed)
        assert threshold.shape == (12, 1) and len(found) >= 12 * k
        assert np.array_equal(found, np.argwhere(upper >= threshold))
    assert VOCAB % BLOCK  # the synthetic graph's last block is partial
    search = _session(Extractor(proto).extract_model([upper_name, threshold_name], [CANDIDATES]))
    upper[0, -3:] = threshold[0] + 1  # the partial last block
    upper[1, :BLOCK + 1] = threshold[1]  # ties, across a block's edge
    threshold[2] = -np.inf  # every column of row 2, none past the vocabulary
    upper[3] = np.nan  # none of row 3
    found = search.run([CANDIDATES], {upper_name: upper, threshold_name: threshold})[0]
    assert np.array_equal(found, np.argwhere(upper >= threshold))
    assert (found[:, 0] == 2).sum() == VOCAB and not (found[:, 0] == 3).any()


def test_an_untied_head_is_not_screened():
    """Its exact dot products would need a second copy of the head in rows: the graph is left as it is."""
    model = _tied_model(_table(), tied=False)
    assert screen_head(model) == 0
    assert INPUT not in [value.name for value in model.graph.inputs]


def test_stripping_the_screen_leaves_the_full_head_and_no_input():
    table = _table()
    proto = _screened_proto(table)
    transposed = [node for node in proto.graph.node if node.op_type == "Transpose" and "table" in node.input]
    assert not transposed  # screened, the full head reads the table itself: nothing for ONNX Runtime to prepack
    assert strip_screen(proto) and not strip_screen(proto)
    # stripped, the head is MatMul(h, Transpose(table)) again, the form the quantizers take a tied head in
    [transpose] = [node for node in proto.graph.node if node.op_type == "Transpose" and "table" in node.input]
    assert [node.op_type for node in proto.graph.node if transpose.output[0] in node.input] == ["MatMul"]
    assert INPUT not in [value.name for value in proto.graph.input]
    assert CANDIDATES not in [value.name for value in proto.graph.output]
    screen_ops = {"MatMulInteger", "ScatterND", "NonZero", "ReduceMax", "Pad"}
    assert not screen_ops & {node.op_type for node in proto.graph.node}
    left = {init.name for init in proto.graph.initializer}
    assert not left & {f"screened_head.{name}" for name in ("weight", "scale", "norms")}
    h = _hidden(3, seed=3)
    out = _session(proto).run(["logits"], {"ids": np.zeros((1, 1), np.int64), "h": h})[0]
    np.testing.assert_allclose(out, h @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("levels", [63, 127])
def test_the_bound_covers_the_weight_rounding(levels):
    """Weights within the levels (63: no int16 saturation on AVX2) and a norm of each column's rounding error that
    bounds it."""
    table = _table()
    constants = screen_constants(table, levels)
    assert constants["weight"].shape == (WIDTH, VOCAB) and np.abs(constants["weight"]).max() == levels
    error = table.T - constants["weight"] * constants["scale"]
    assert np.all(np.linalg.norm(error, axis=0) <= constants["error_norm"])


def test_this_cpus_int8_kernel_is_exact_at_the_levels_it_is_given():
    """The screen's bound holds only if ONNX Runtime's u8 x s8 products are exact at `screen_weight_levels`: the
    worst case (every activation 255 with zero point 0, every weight +-levels, so a saturating int16 pair shows) at
    one and four rows, GPT-2's hidden width, against numpy's int64 products."""
    levels = screen_weight_levels()
    rng = np.random.default_rng(0)
    weight = (rng.choice([-1, 1], size=(768, 512)) * levels).astype(np.int8)
    weight[:, :8] = levels  # columns where every pair of products has the same sign
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "zero"], ["y"])], "int8",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", 768])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", 512])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(0, np.uint8), "zero")])
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10))
    for rows in (1, 4):
        a = np.full((rows, 768), 255, np.uint8)
        a[1:, ::3] = rng.integers(0, 256, size=a[1:, ::3].shape)
        expected = a.astype(np.int64) @ weight.astype(np.int64)
        assert np.array_equal(session.run(None, {"a": a})[0], expected), (levels, rows)


@pytest.mark.parametrize("io_binding", [False, True])
def test_a_session_returns_the_candidates_as_numpy_beside_its_roles_outputs(io_binding, tmp_path):
    """OrtSession takes the candidates output as optional (a graph without a screen has none) and returns it as a
    numpy array of (row, column) pairs, row-major, that hold each row's argmax; torch tensors for the role's own."""
    from nndf.backends.onnxrt import OrtSession

    table = _table()
    graph = tmp_path / "screened.onnx"
    graph.write_bytes(_screened_proto(table).SerializeToString())
    session = OrtSession(graph, ["ids", "h"], ["embedded", "logits"], io_binding=io_binding)
    assert session.output_names == ("embedded", "logits", CANDIDATES)
    h = _hidden(4, seed=5)[:, :1]
    outputs = session.run({"ids": torch.zeros((1, 1), dtype=torch.int64), "h": torch.from_numpy(h),
                           INPUT: torch.tensor([1])})
    assert isinstance(outputs["logits"], torch.Tensor) and isinstance(outputs[CANDIDATES], np.ndarray)
    found = outputs[CANDIDATES]
    assert found.shape[1] == 2 and np.array_equal(found, found[np.lexsort((found[:, 1], found[:, 0]))])
    best = (h[:, 0] @ table.T).argmax(-1)
    assert all(((found[:, 0] == row) & (found[:, 1] == column)).any() for row, column in enumerate(best))
