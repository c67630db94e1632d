"""--int8-method / `int8_method`: int8's weight MatMuls as the user chooses, in place of the CPU's choice
(nndf.export.cpu_int8.int8_method): 8-bit MatMulNBits for the shorter decode step, or ONNX Runtime's dynamic
quantization for the faster prompt and batch. Either graph on any CPU; only int8 takes it (usage errors in
tests/test_cli.py)."""

from __future__ import annotations

import onnx
import pytest
import torch

import nndf
from nndf.actions.common import label
from nndf.backends import BackendOptions
from nndf.backends.onnxrt import quantization_notes
from nndf.errors import UsageError
from nndf.export.onnx import export_decoder
from nndf.export.quantize import MATMUL_OP, METHODS, quantize_params, quantized_decoder


def _ops(graph) -> set[str]:
    return {node.op_type for node in onnx.load(str(graph), load_external_data=False).graph.node}


def test_each_method_builds_its_own_graph_whatever_the_cpu(tiny_gpt2_dir, onnx_work_dir):
    loaded = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="frameworks", device="cpu").loaded
    export = export_decoder(loaded, True, onnx_work_dir)
    graphs = {method: quantized_decoder(export, "int8", onnx_work_dir, int8_method=method) for method in METHODS}
    assert len(set(graphs.values())) == len(METHODS)  # one artifact each: the method is part of the name
    for method, graph in graphs.items():
        ops = _ops(graph)
        assert MATMUL_OP[method] in ops and not (set(MATMUL_OP.values()) - {MATMUL_OP[method]}) & ops
    # each with its own default block size; --block-size still sets it
    assert quantize_params("int8", int8_method="matmul_nbits")["block_size"] == 128
    assert quantize_params("int8", 64, "matmul_nbits")["block_size"] == 64
    assert quantize_params("int8", int8_method="dynamic")["method"] == "dynamic"


def test_the_api_runs_the_chosen_method_and_says_so(tiny_gpt2_dir, onnx_work_dir):
    ids = torch.tensor([[464, 3290, 318, 257]])
    tokens = {}
    for method in METHODS:
        m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt-int8", working_dir=str(onnx_work_dir),
                      device="cpu", int8_method=method)
        assert MATMUL_OP[method] in _ops(m.decoder.session.artifacts[0])
        assert label(m) == f"onnxrt int8 {method.replace('_', '-')}"
        note, = quantization_notes(m.options)
        assert note.endswith("(--int8-method)") and ("dynamic" in note) == (method == "dynamic")
        tokens[method] = m.generate(ids, max_new_tokens=4)
    assert all(t.shape == (1, 8) for t in tokens.values())


def test_only_int8_takes_a_method():
    with pytest.raises(UsageError, match="int8_method applies to int8 weights"):
        nndf.load("GPT2", backend="onnxrt-int4", random_weights=True, int8_method="dynamic")
    with pytest.raises(UsageError, match="unknown --int8-method 'fast'; allowed: matmul-nbits, dynamic"):
        BackendOptions(quantize="int8", int8_method="fast")
    with pytest.raises(UsageError, match="applies to int8 weights, not int4"):
        quantize_params("int4", int8_method="dynamic")
