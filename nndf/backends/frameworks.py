"""The `frameworks` backend: the Hugging Face PyTorch model itself, driven step by step through DecoderWrapper."""

from __future__ import annotations

from typing import Mapping

import torch

from nndf.backends import BackendOptions
from nndf.export.wrapper import DecoderWrapper
from nndf.loading import LoadedModel
from nndf.spec import BuildSettings

DESCRIPTION = "PyTorch via transformers (CPU or CUDA); also measured through Hugging Face generate()"


class TorchSession:
    """Runs the wrapped model under inference mode; inputs and outputs are named as in the ONNX graphs."""

    def __init__(self, loaded: LoadedModel, use_cache: bool) -> None:
        model = loaded.model
        self.wrapper = DecoderWrapper(model, loaded.spec.hooks.num_layers(model.config), use_cache)
        self.name = "frameworks"
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.input_names = self.wrapper.input_names
        self.output_names = self.wrapper.output_names

    @torch.inference_mode()
    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outputs = self.wrapper(*(feeds[name] for name in self.input_names))
        return dict(zip(self.output_names, outputs))


def open_session(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> TorchSession:
    """The frameworks backend needs no artifacts; it runs the PyTorch model as loaded (fp32 or fp16), so the
    ONNX-only options (quantization, a given ONNX file) leave it as it is: it stays the reference beside them."""
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    return TorchSession(loaded, settings.use_cache)

# Benchmarks also time Hugging Face generate() on the same PyTorch model: the figure users compare against.
MEASURE_HF_GENERATE = True
