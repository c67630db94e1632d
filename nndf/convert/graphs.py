"""The ONNX graphs `convert_model` writes: the plain export, ONNX Runtime's optimized graph, and int8 graphs.

- `export_graph`: torch's TorchScript exporter (`dynamo=False`) over eager attention, dynamic batch and sequence.
  That combination is what ONNX Runtime's transformer optimizer recognises: on all-MiniLM-L6-v2 it fuses the
  embeddings (EmbedLayerNormalization), all 6 attentions (Attention), 12 SkipLayerNormalization (on a GPU: on the
  CPU each residual Add and LayerNorm stay apart, `optimize_graph`) and 6 BiasGelu;
  the dynamo exporter's graph (SDPA or eager) gets no attention fusion at all (measured here, ORT 1.32).
- `optimize_graph`: `onnxruntime.transformers.optimizer.optimize_model` (model type from the config, "bert" for
  the BERT-like families it does not list), converted to fp16 on a GPU with fp32 inputs and outputs kept.
- `quantize_dynamic_int8` (CPU): ONNX Runtime's dynamic quantization of the optimized graph's MatMuls and fused
  Attentions, per channel; int8 or uint8 weights as `nndf.export.cpu_int8.int8_weight_type` decides for this CPU.
- `quantize_static_qdq` (GPU, for TensorRT): ONNX Runtime's static quantization in QDQ format, symmetric int8
  activations and weights (what TensorRT consumes), calibrated on tokenized sample sentences.

Every graph is written to a temporary name and renamed into place, so a failure leaves no half-written file. Each
is one file, weights inside, so protobuf's 2 GB cap on a message caps the model: a larger one is refused before the
export (`check_graph_size`) rather than failing in the optimizer's save.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import torch

from nndf.convert.tasks import TaskModule, eager_attention, transformer_of
from nndf.errors import HarnessError, refused_by_the_disk
from nndf.workspace import atomic_path

OPSET = 17


@contextlib.contextmanager
def quiet(verbose: bool):
    """The exporters and optimizers print pages of warnings; `-v` shows them, otherwise they go."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime")]  # the quantizers log on the root logger
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


MAX_GRAPH_BYTES = 2**31 - 2**24  # protobuf's cap on one message (a whole ONNX file), less room for the graph itself


def check_graph_size(module: torch.nn.Module, name: str) -> None:
    """Refuse, with its size, a model whose weights cannot fit in one ONNX file."""
    weights = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    if weights > MAX_GRAPH_BYTES:
        raise HarnessError(f"{name} holds {weights / 2**30:.2f} GiB of weights; convert writes each ONNX graph as "
                           "one file, which protobuf caps at 2 GiB, so a model this large is not converted yet")


def export_graph(module: TaskModule, example: Mapping[str, torch.Tensor], path: Path,
                 verbose: bool = False) -> tuple[str, ...]:
    """The task module as ONNX at `path`, inputs and outputs named, batch and sequence dynamic; returns the graph's
    inputs, which lack any the model ignores (sentence-transformers does not pass `token_type_ids` on)."""
    check_graph_size(module, getattr(transformer_of(module.model), "name_or_path", "") or "the model")
    eager_attention(module.model)
    names = list(module.input_names)
    axes = {name: {0: "batch", 1: "sequence"} for name in names}
    for output in module.task.outputs:
        axes[output] = {0: "batch", 1: "sequence"} if module.task.per_token else {0: "batch"}
    args = tuple(example[name].cpu() for name in names)
    try:
        with quiet(verbose), atomic_path(path) as tmp, torch.inference_mode(False), torch.no_grad():
            torch.onnx.export(module.cpu(), args, str(tmp), input_names=names, output_names=list(module.task.outputs),
                              dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False)
    except HarnessError:
        raise
    except Exception as exc:  # the exporter raises many types; one sentence with the cause
        if refused_by_the_disk(exc):  # a full or read-only disk: said as the disk's (nndf.errors), not the graph's
            raise
        raise HarnessError(f"ONNX export failed: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    import onnx

    return tuple(value.name for value in onnx.load(str(path), load_external_data=False).graph.input)


def optimizer_model_type(config) -> str:
    from onnxruntime.transformers.optimizer import MODEL_TYPES

    kind = getattr(config, "model_type", "bert")
    return kind if kind in MODEL_TYPES else "bert"


def attention_sizes(config) -> tuple[int, int]:
    """(heads, hidden size) under the names the BERT-like configs use (DistilBERT: n_heads, dim)."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", 0)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", 0)
    return int(heads), int(hidden)


def optimize_graph(source: Path, target: Path, config, use_gpu: bool, fp16: bool,
                   verbose: bool = False) -> dict[str, int]:
    """ONNX Runtime's transformer optimizer on `source`, written to `target`; returns the fusions it made."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    kind = optimizer_model_type(config)
    options = FusionOptions(kind)
    options.enable_gelu_approximation = False  # exact GELU: the outputs stay PyTorch's
    # SkipLayerNormalization's CPU kernel is slower than the Add and LayerNormalization it fuses
    # (`nndf.backends.ort_runtime`): on the CPU they stay apart, and the sessions do not fuse them at load either
    options.enable_skip_layer_norm = use_gpu
    heads, hidden = attention_sizes(config)
    with quiet(verbose):
        model = optimizer.optimize_model(str(source), model_type=kind, num_heads=heads, hidden_size=hidden,
                                         opt_level=1 if kind == "bert" else 0, use_gpu=use_gpu,
                                         optimization_options=options)
        if fp16:
            model.convert_float_to_float16(keep_io_types=True)
        with atomic_path(target) as tmp:
            model.save_model_to_file(str(tmp))
    return {name: count for name, count in model.get_fused_operator_statistics().items() if count}


def quantize_dynamic_int8(source: Path, target: Path, verbose: bool = False) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from nndf.export.cpu_int8 import int8_weight_type

    # The optimizer's fused operators (com.microsoft domain) defeat ONNX shape inference: their outputs are float.
    with quiet(verbose), atomic_path(target) as tmp:
        quantize_dynamic(source, tmp, op_types_to_quantize=["MatMul", "Attention"], per_channel=True,
                         weight_type=getattr(QuantType, int8_weight_type()),
                         extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})


class _Batches:
    """ONNX Runtime's calibration reader over a list of feeds."""

    def __init__(self, feeds: Iterable[Mapping[str, np.ndarray]]) -> None:
        self._feeds = iter(list(feeds))

    def get_next(self):
        return next(self._feeds, None)


def quantize_static_qdq(source: Path, target: Path, calibration: list[Mapping[str, np.ndarray]],
                        verbose: bool = False) -> None:
    """Symmetric int8 QDQ for TensorRT, activation ranges from `calibration` (the tokenized sample sentences)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    reader = type("Reader", (_Batches, CalibrationDataReader), {})(calibration)
    with quiet(verbose), atomic_path(target) as tmp:
        quantize_static(source, tmp, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=["MatMul", "Gemm"],
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
