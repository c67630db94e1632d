"""The exporter's ATen -> ONNX table, built once per process (nndf.export.torchlib_registry): each export gets a copy
of its own, so a custom translation one export registers (the shared-buffer attention's) is not seen by the next;
outside an export, torch's own builder is back. (bench/export_time.py measures what it saves and checks that the
graphs are the same.)"""

from __future__ import annotations

import torch
from torch.onnx._constants import ONNX_DEFAULT_OPSET
from torch.onnx._internal.exporter import _registration

from nndf.export.torchlib_registry import torchlib_registry_built_once


def test_each_export_gets_its_own_copy_of_one_table():
    torch_builder = _registration.ONNXRegistry.__dict__["from_torchlib"]
    target = torch.ops.aten.add.Tensor
    with torchlib_registry_built_once():
        with torchlib_registry_built_once():  # overlapping exports (threads): one cache, put back by the last
            first = _registration.ONNXRegistry().from_torchlib(opset_version=ONNX_DEFAULT_OPSET)  # as export calls it
        assert _registration.ONNXRegistry.__dict__["from_torchlib"] is not torch_builder
        entries = list(first.functions[target.name()])
        first.register_op(target, lambda x, y: x)  # a custom translation goes first in its list
        second = _registration.ONNXRegistry.from_torchlib(opset_version=ONNX_DEFAULT_OPSET)
    assert second is not first and first.opset_version == second.opset_version == ONNX_DEFAULT_OPSET
    assert second.functions.keys() == first.functions.keys() and second.functions[target.name()] == entries
    assert len(first.functions[target.name()]) == len(entries) + 1
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is torch_builder
