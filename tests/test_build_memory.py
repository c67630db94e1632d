"""Weights loaded only to build a graph are let go once it is built (`LoadedModel.weights_for_build`): a run that
exports holds no second copy of the weights beside ONNX Runtime's afterwards, as a run on a graph already built never
had one, while the weights a frameworks backend runs stay as they are."""

from __future__ import annotations

import pytest
import torch

import nndf
from nndf.loading import LoadedModel


@pytest.fixture
def loads(monkeypatch) -> list[torch.nn.Module]:
    """Every PyTorch model `LoadedModel.model` hands out, in order, loaded or not."""
    handed = []
    loading = LoadedModel.model.fget

    def recorded(self):
        model = loading(self)
        if not any(model is seen for seen in handed):
            handed.append(model)
        return model

    monkeypatch.setattr(LoadedModel, "model", property(recorded))
    return handed


def test_weights_loaded_for_an_export_are_let_go_and_load_again_when_needed(tiny_gpt2_dir, tmp_path, loads):
    model = nndf.load("GPT2", backend="onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(tmp_path))
    [exported_from] = loads  # the export loaded the weights ...
    assert model.loaded._model is None  # ... and the loaded model no longer holds them
    # nor does anything else: the exporter's leftovers (onnxscript's rewrite rules keep the last graph they matched,
    # which wraps these very parameters) reach tensors that hold no elements any more
    assert all(tensor.numel() == 0 for tensor in (*exported_from.parameters(), *exported_from.buffers()))
    prompt = torch.tensor([[5, 9, 2, 7]])
    tokens = model.generate(prompt, max_new_tokens=6)
    # the reference needs them again: loaded once more, the same weights (the graph's tokens are generate()'s)
    assert torch.equal(tokens, model.hf_generate(prompt, max_new_tokens=6))
    assert len(loads) == 2 and loads[1] is not exported_from


def test_a_run_that_exports_loads_the_weights_once_for_the_backends_that_run_them(tiny_gpt2_dir, tmp_path, loads):
    """onnxrt named before frameworks: frameworks opens first, the export builds from the weights it holds and
    leaves them alone (emptying them would break frameworks' generation; loading them for the export and again for
    frameworks would double the first run's load)."""
    results = nndf.run("benchmark", "GPT2", "onnxrt", "frameworks", torch_dir=str(tiny_gpt2_dir),
                       working_dir=str(tmp_path), input_seq_len=4, output_seq_len=3, iterations=1, warmup=0)
    assert len(loads) == 1 and all(p.numel() > 0 for p in loads[0].parameters())
    rows = [row["backend"] for row in results[0].rows]
    assert rows[:2] == ["onnxrt", "frameworks"]  # the rows in the order asked, whatever the opening order
