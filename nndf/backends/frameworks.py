"""The `frameworks` backend: the Hugging Face PyTorch model itself, driven step by step through the same flat-tensor
wrappers the ONNX exporter traces (one for a decoder-only model, three for an encoder-decoder one)."""

from __future__ import annotations

from typing import Mapping

import torch

from nndf.backends import BackendOptions
from nndf.export.wrapper import DecoderWrapper
from nndf.loading import LoadedModel
from nndf.spec import BuildSettings

DESCRIPTION = "PyTorch via transformers (CPU or CUDA); also measured through Hugging Face generate()"


class TorchSession:
    """Runs a wrapper module under inference mode; inputs and outputs are named as in the ONNX graphs."""

    def __init__(self, wrapper: torch.nn.Module, model: torch.nn.Module) -> None:
        self.wrapper = wrapper
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
    model = loaded.model
    return TorchSession(DecoderWrapper(model, loaded.spec.hooks.num_layers(model.config), settings.use_cache), model)


def open_seq2seq(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> dict[str, TorchSession]:
    """An encoder-decoder model's three sessions (encoder, cross-attention cache generator, decoder): the modules
    of its graph set, the very ones the ONNX exporter traces."""
    from nndf.seq2seq.export import graph_set

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    model = loaded.model
    wrappers = graph_set(loaded).wrappers(model, loaded.spec.hooks, settings.use_cache)
    return {graph: TorchSession(wrapper, model) for graph, wrapper in wrappers.items()}

# Benchmarks also time Hugging Face generate() on the same PyTorch model: the figure users compare against.
MEASURE_HF_GENERATE = True
