"""int8 / int4 quantized decoder graphs: what is in them, that they run, when they are reused, and (on the trained
tiny GPT-2 from ../shared/data) how close their logits stay to fp32 PyTorch."""

from __future__ import annotations

import json
import random

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import nndf
from conftest import LAMBADA_FILE, TRAINED_TINY_GPT2, build_tiny, needs_shared
from family_examples import FAMILY_EXAMPLES
from nndf.errors import HarnessError, UsageError
from nndf.export.onnx import export_decoder
from nndf.export.quantize import KINDS, int8_weight_type, quantized_decoder
from nndf.export.weight_graph import prepare_graph
from nndf.workspace import metadata_path

QUANT_OPS = {"int8": "MatMulInteger", "int4": "MatMulNBits"}


@pytest.fixture(scope="module")
def tiny(tiny_gpt2_dir, onnx_work_dir):
    """(loaded tiny GPT-2, its fp32 export with cache); the export lives in the session's shared working dir."""
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="frameworks", device="cpu")
    return model.loaded, export_decoder(model.loaded, True, onnx_work_dir)


def _ops(graph) -> dict[str, int]:
    model = onnx.load(str(graph), load_external_data=False)
    ops: dict[str, int] = {}
    for node in model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


def _fp32_weight_matmuls(graph) -> list[str]:
    """MatMul/Gemm nodes still multiplying by a float constant (directly or through a Transpose) of >= 1024 values."""
    model = onnx.load(str(graph), load_external_data=False)
    g = model.graph
    floats = {i.name for i in g.initializer if i.data_type == TensorProto.FLOAT and int(np.prod(i.dims)) >= 1024}
    producers = {o: n for n in g.node for o in n.output}

    def constant(name):
        node = producers.get(name)
        return name in floats or (node is not None and node.op_type == "Transpose" and node.input[0] in floats)

    return [n.name for n in g.node if n.op_type in ("MatMul", "Gemm") and any(constant(x) for x in n.input[:2])]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_graph_has_quantized_weights_and_the_same_names(tiny, kind, tmp_path, capsys):
    loaded, export = tiny
    graph = quantized_decoder(export, kind, tmp_path)
    err = capsys.readouterr().err
    assert "quantizing" in err and "9 weight MatMuls" in err and "done in" in err
    assert graph.parent.parent == tmp_path and graph.parent.name.startswith(f"{export.folder.name}-{kind}-")
    ops = _ops(graph)
    # 2 layers x (qkv, attention output, MLP up, MLP down) + the LM head
    assert ops.get(QUANT_OPS[kind]) == 9, ops
    if kind == "int8":
        assert ops.get("DynamicQuantizeLinear", 0) >= 1
    assert "Gemm" not in ops
    assert _fp32_weight_matmuls(graph) == []
    model = onnx.load(str(graph), load_external_data=False)
    assert tuple(i.name for i in model.graph.input) == export.input_names
    assert tuple(o.name for o in model.graph.output) == export.output_names
    if kind == "int4":
        heads = [n for n in model.graph.node if n.op_type == "MatMulNBits"
                 and helper.get_attribute_value(next(a for a in n.attribute if a.name == "N")) == 50257]
        assert len(heads) == 1  # the tied LM head got its own weight and was quantized
        attrs = {a.name: helper.get_attribute_value(a) for a in heads[0].attribute}
        assert attrs["block_size"] == KINDS["int4"]["block_size"] and attrs["accuracy_level"] == 4
    # the fp32 embedding table stays for the Gather; the LM head's copy is quantized
    data = lambda folder: (folder / "decoder.onnx.data").stat().st_size
    assert data(graph.parent) < 1.35 * data(export.folder)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_generates_and_stays_near_fp32(tiny, kind, onnx_work_dir):
    loaded, _ = tiny
    fp32 = nndf.load("GPT2", backend="onnxrt", loaded=loaded, working_dir=str(onnx_work_dir))
    quant = nndf.load("GPT2", backend="onnxrt", loaded=loaded, working_dir=str(onnx_work_dir), quantize=kind)
    ids = torch.randint(0, 50257, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    out = quant.generate(ids, mask, max_new_tokens=5, min_new_tokens=5)
    assert out.shape == (2, 12) and torch.equal(out[:, :7], ids)
    ref, got = fp32.logits(ids[:1]), quant.logits(ids[:1])
    assert got.shape == ref.shape == (1, 7, 50257)
    error = float((got - ref).abs().max()) / float(ref.abs().max())
    assert 0 < error < 0.5, error  # quantized (not the fp32 graph) yet close


def test_artifact_is_reused_then_rebuilt_when_stale_or_truncated(tiny, tmp_path, capsys):
    _, export = tiny
    graph = quantized_decoder(export, "int4", tmp_path)
    assert "quantizing" in capsys.readouterr().err
    stamp = graph.stat().st_mtime_ns

    assert quantized_decoder(export, "int4", tmp_path) == graph
    err = capsys.readouterr().err
    assert "quantizing" not in err and "rebuilding" not in err and graph.stat().st_mtime_ns == stamp

    meta_file = metadata_path(graph.parent)
    meta = json.loads(meta_file.read_text())
    meta["versions"]["onnxruntime"] = "0.0.1"  # built by another ONNX Runtime
    meta_file.write_text(json.dumps(meta))
    assert quantized_decoder(export, "int4", tmp_path) == graph
    err = capsys.readouterr().err
    assert f"rebuilding {graph.parent}: it was built with a different versions" in err and "quantizing" in err

    data = graph.parent / "decoder.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    quantized_decoder(export, "int4", tmp_path)
    err = capsys.readouterr().err
    assert f"rebuilding {graph.parent}: decoder.onnx.data is missing or truncated" in err
    assert json.loads(meta_file.read_text())["files"]["decoder.onnx.data"] == data.stat().st_size


def test_kinds_and_parameters_name_different_artifacts(tiny, tmp_path):
    _, export = tiny
    int8 = quantized_decoder(export, "int8", tmp_path)
    int4 = quantized_decoder(export, "int4", tmp_path)
    int4_128 = quantized_decoder(export, "int4", tmp_path, dict(KINDS["int4"], block_size=128))
    assert len({int8.parent, int4.parent, int4_128.parent}) == 3
    assert {p.name for p in tmp_path.iterdir() if p.is_dir()} == {int8.parent.name, int4.parent.name,
                                                                  int4_128.parent.name}
    assert json.loads(metadata_path(int4_128.parent).read_text())["params"]["block_size"] == 128


def test_unknown_kind_and_bad_parameters_are_errors(tiny, tmp_path):
    _, export = tiny
    with pytest.raises(UsageError, match="unknown quantization 'int3'; allowed: int8, int4"):
        quantized_decoder(export, "int3", tmp_path)
    with pytest.raises(UsageError, match="block_size"):
        quantized_decoder(export, "int4", tmp_path, dict(KINDS["int4"], block_size=48))
    with pytest.raises(UsageError, match="int4 must quantize to 4 bits, but the parameters give 8"):
        quantized_decoder(export, "int4", tmp_path, KINDS["int8"])
    with pytest.raises(UsageError, match="unknown quantization"):
        nndf.load("GPT2", backend="onnxrt", loaded=tiny[0], working_dir=str(tmp_path), quantize="fp8")
    assert not any(tmp_path.iterdir())


def test_a_graph_without_weights_to_quantize_is_a_harness_error(tiny, tmp_path):
    _, export = tiny
    broken = tmp_path / "src"
    broken.mkdir()
    x = helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 2])
    relu = helper.make_graph([helper.make_node("Relu", ["input_ids"], ["logits"])], "g", [x], [y])
    onnx.save(helper.make_model(relu), broken / "decoder.onnx")
    fake = type(export)(broken, ("input_ids",), ("logits",))
    with pytest.raises(HarnessError, match="no MatMul or Gemm with a constant weight"):
        quantized_decoder(fake, "int8", tmp_path / "work")


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
    assert KINDS["int8"]["weight_type"] == int8_weight_type()


def test_default_int8_weight_type_multiplies_exactly_on_this_cpu():
    """The kernel the int8 graphs run on this CPU sums large uint8 x weight products without saturating.

    (uint8 x int8 on x86 without VNNI: VPMADDUBSW's int16 pair sums saturate and this is off by ~40%.)"""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    m, k, n = 8, 64, 32
    a = rng.integers(200, 256, (m, k)).astype(np.uint8)
    w = rng.integers(100, 128, (k, n))
    if KINDS["int8"]["weight_type"] == "QInt8":
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
@pytest.mark.parametrize("family", ["GPTNeo", "GPTJ", "OPT", "Llama"])
def test_every_family_quantizes_every_weight_matmul(family, tmp_path_factory, onnx_work_dir):
    """Other families' graphs (nn.Linear, untied heads, OPT's projections, a Llama-class tied head) lose every fp32
    weight MatMul too."""
    folder = build_tiny(tmp_path_factory.mktemp("family"), family, FAMILY_EXAMPLES[family])
    work = tmp_path_factory.mktemp("quant")
    for kind in ("int8", "int4"):
        m = nndf.load(family, torch_dir=str(folder), backend="onnxrt", working_dir=str(onnx_work_dir), device="cpu")
        graph = quantized_decoder(export_decoder(m.loaded, True, onnx_work_dir), kind, work)
        assert _fp32_weight_matmuls(graph) == [], kind
        assert _ops(graph).get(QUANT_OPS[kind], 0) >= 2 * 4 + 1
        q = nndf.load(family, backend="onnxrt", loaded=m.loaded, working_dir=str(work), decoder_onnx=str(graph))
        ids = torch.randint(0, 1000, (1, 4), generator=torch.Generator().manual_seed(0))
        assert q.generate(ids, max_new_tokens=3, min_new_tokens=3).shape == (1, 7)


# ----------------------------------------------------------------------------------------------------------------
# Fidelity on the trained tiny GPT-2 (memorised LAMBADA passages 2500-2999), against fp32 PyTorch
# ----------------------------------------------------------------------------------------------------------------

# Measured on these 50 passages (ORT 1.31.1): int8 agreement 0.9998, KL 0.0007, acc 1.000, ppl 1.119; int4 0.9953,
# 0.0327, 1.000, 1.191 (fp32: acc 1.000, ppl 1.118). int4 with blocks of 128 (0.9913, 0.0512, 0.980, 1.282) and
# int8 with one scale per tensor (KL 0.0016) fail these bounds, and so do int8 weights (QInt8) on x86 without VNNI
# (0.9960, KL 0.0137: saturating kernel, see nndf.export.quantize) and 7-bit weights there (KL 0.0012).
FIDELITY_BOUNDS = {
    # kind: (min top-1 agreement with fp32, max mean KL, min lm-eval accuracy, max lm-eval perplexity)
    "int8": (0.997, 0.0012, 0.98, 1.14),
    "int4": (0.993, 0.042, 0.98, 1.24),
}


@pytest.fixture(scope="module")
def trained(onnx_work_dir):
    from nndf.lambada import read_jsonl_texts

    reference = nndf.load("GPT2", torch_dir=str(TRAINED_TINY_GPT2), backend="frameworks", device="cpu")
    texts = read_jsonl_texts(LAMBADA_FILE)
    sample = [texts[i] for i in sorted(random.Random(0).sample(range(2500, 3000), 50))]
    return reference, sample


@needs_shared(TRAINED_TINY_GPT2)
@needs_shared(LAMBADA_FILE)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fidelity_on_the_trained_tiny_gpt2(trained, kind, onnx_work_dir):
    reference, texts = trained
    quant = nndf.load("GPT2", backend="onnxrt", loaded=reference.loaded, working_dir=str(onnx_work_dir), quantize=kind)
    # as `accuracy` scores them: against the PyTorch model's logits, passages of one length in batches
    fidelity = quant.architecture.fidelity(texts, quant, batch_size=16)
    lambada = quant.architecture.lambada(texts, quant, 1, 5, batch_size=16)
    min_agreement, max_kl, min_accuracy, max_perplexity = FIDELITY_BOUNDS[kind]
    assert fidelity.top1_agreement >= min_agreement, fidelity
    assert fidelity.mean_kl <= max_kl, fidelity
    assert lambada.lm_eval_accuracy >= min_accuracy, lambada
    assert lambada.lm_eval_perplexity <= max_perplexity, lambada
