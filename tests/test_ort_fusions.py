"""Graph rewrites of the shared layout that change how ONNX Runtime loads a graph rather than what it computes
(nndf.export.ort_fusions): the LM head's weight in chunks, so that loading a session no longer peaks at the largest
weight (a tied head, screened, reads its table instead). The results must be the same numbers: on a hand-made graph
(a tied head behind a Transpose, an untied one) and in real exports against Hugging Face `generate()`."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import nndf
from nndf.export import ort_fusions


def _heads_graph(vocab: int, hidden: int):
    """ids -> Gather(table) -> h; logits = h @ table^T (tied, through a Transpose) and other = h @ untied."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, hidden), dtype=np.float32)
    untied = rng.standard_normal((hidden, vocab + 3), dtype=np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h"]),
             helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "table_t"], ["logits"]),
             helper.make_node("MatMul", ["h", "untied"], ["other"])]
    graph = helper.make_graph(
        nodes, "heads", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]),
         helper.make_tensor_value_info("other", TensorProto.FLOAT, ["batch", "seq", vocab + 3])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(untied, "untied")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _run(model, ids):
    proto = model if not isinstance(model, ir.Model) else ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits", "other"], {"ids": ids})


def test_large_weights_are_split_into_chunks_with_the_same_results():
    vocab, hidden = 1000, 16  # weights of 64000 and 64192 bytes
    proto = _heads_graph(vocab, hidden)
    ids = np.array([[1, 999, 500], [3, 4, 5]], dtype=np.int64)
    expected = _run(proto, ids)
    model = ir.serde.deserialize_model(proto)
    assert ort_fusions.split_large_weights(model, chunk_bytes=20_000) == 2
    ops = [node.op_type for node in model.graph]
    assert ops.count("MatMul") == 4 + 4 and ops.count("Concat") == 2  # ceil(64000 / 20000) chunks each
    assert [value.name for value in model.graph.outputs] == ["logits", "other"]
    for got, want in zip(_run(model, ids), expected):
        assert got.shape == want.shape and np.array_equal(got, want)  # the same dot products, bit for bit
    from onnxscript.optimizer import optimize

    optimize(model)  # as fuse_for_onnxruntime ends: an untied weight goes with its MatMul, the tied table stays
    assert "untied" not in model.graph.initializers and "table" in model.graph.initializers
    untouched = ir.serde.deserialize_model(proto)
    assert ort_fusions.split_large_weights(untouched, chunk_bytes=64_192) == 0  # at the limit: kept whole


@pytest.mark.parametrize("family", ["GPT2", "Mistral"])
def test_a_real_export_holds_its_head_once_and_equals_generate(family, family_dirs, tmp_path, monkeypatch):
    """Exported with a chunk limit below the head's size: GPT-2's tied head reads its embedding table itself (the
    screened head's full MatMul, `nndf.export.screened_head`: no transposed copy, no chunks), the table read by the
    embedding, the screen's two lookups of exact rows and that MatMul; Mistral's untied head is chunk MatMuls over copies written
    pre-transposed. The tokens are generate()'s either way."""
    import onnx

    monkeypatch.setattr(ort_fusions, "WEIGHT_CHUNK_BYTES", 40_000)
    m = nndf.load(family, backend="onnxrt", torch_dir=str(family_dirs[family]), working_dir=str(tmp_path),
                  device="cpu", kv_layout="shared")
    graph = onnx.load(str(m.decoder.session.artifacts[0]), load_external_data=False).graph
    chunks = [node for node in graph.node if node.op_type == "MatMul" and "_chunk" in node.name]
    table = max(graph.initializer, key=lambda init: int(np.prod(init.dims)))  # the token embedding table
    assert int(np.prod(table.dims)) * 4 > 40_000
    readers = sorted(node.op_type for node in graph.node if table.name in node.input)
    if family == "GPT2":
        assert not chunks and readers == ["Gather", "Gather", "Gather", "MatMul"]
        assert not [node for node in graph.node if node.op_type == "Transpose" and table.name in node.input]
    else:
        assert len(chunks) >= 2 and readers == ["Gather"]
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(m.generate(prompt, max_new_tokens=8), m.hf_generate(prompt, max_new_tokens=8))


def test_merged_sibling_weights_that_are_then_split_keep_their_types():
    """gate and up (or q, k and v) merged into one MatMul whose weight is then over the chunk limit: the merged
    MatMul's output had no type, its chunks' Concat got an empty one, and the optimizer that ends the fusions
    failed ("serialize_type_into ... Tensor(None)") on Qwen2.5-0.5B, Llama-3.2-1B and gemma-3-1b's real sizes."""
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((16, 500), dtype=np.float32) for _ in range(2))
    nodes = [helper.make_node("MatMul", ["x", "gate"], ["g"]), helper.make_node("MatMul", ["x", "up"], ["u"]),
             helper.make_node("Mul", ["g", "u"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 500])],
                              [numpy_helper.from_array(gate, "gate"), numpy_helper.from_array(up, "up")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    x = rng.standard_normal((3, 16), dtype=np.float32)
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    model = ir.serde.deserialize_model(proto)
    assert ort_fusions.merge_sibling_matmuls(model) == 1
    assert ort_fusions.split_large_weights(model, chunk_bytes=40_000) == 1  # the merged weight: 64000 bytes
    from onnxscript.optimizer import optimize

    optimize(model)
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected[0], rtol=1e-5, atol=1e-5)


def test_a_failing_fusion_is_one_sentence_naming_the_way_around(family_dirs, tmp_path, monkeypatch):
    """A rewrite or the optimizer after them failing (as on real-size merged weights did) was onnxscript's
    traceback; the growing layout exports without the fusions."""
    from nndf.errors import HarnessError

    def fail(model):
        raise RuntimeError("a rule went wrong\nwith details")

    monkeypatch.setattr(ort_fusions, "fuse_for_onnxruntime", fail)
    with pytest.raises(HarnessError, match=r"^ONNX Runtime's fusions on the export of tiny-gpt2 failed \(RuntimeError: "
                                           r"a rule went wrong\); --kv-layout growing exports without them$"):
        nndf.load("GPT2", backend="onnxrt", torch_dir=str(family_dirs["GPT2"]), working_dir=str(tmp_path),
                  device="cpu", kv_layout="shared")
    assert not list(tmp_path.rglob("*.onnx"))  # no half-written graph left to be reused
