"""The `frameworks` backend: the Hugging Face PyTorch model itself, driven step by step through the same flat-tensor
wrappers the ONNX exporter traces (one for a decoder-only model, three for an encoder-decoder one).

By default the decoder's cache is the one PyTorch's attention returns (`GrowingKVCache`: each step's presents are
the next step's pasts, as in `generate()`), which costs the fewest operations per step. With `--cuda-graph` (CUDA)
it steps over a static KV cache instead (`StaticTorchSession`): buffers of the build's whole length that the model
writes in place, so that a decode step has the same shapes and addresses every time, and replays each decode step
as a CUDA graph. (Eagerly the static step costs more operations than the growing one: its attention masks the
unfilled tail of the buffers.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from nndf.backends import BackendOptions
from nndf.backends.cuda_graphs import StepGraphs
from nndf.errors import HarnessError, UsageError
from nndf.export.wrapper import DecoderWrapper
from nndf.kvcache import PAST_LENGTH, GrowingKVCache, StaticKVCache, past_names
from nndf.loading import LoadedModel
from nndf.progress import say
from nndf.spec import BuildSettings, ShapeSpec

FIRST_PAST = past_names(1)[0]  # the input that tells whose buffers a static step was given
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
        self.info_notes: list[str] = []

    def new_cache(self, shapes: ShapeSpec, rows: int, max_len: int, reads_candidates: bool = False) -> GrowingKVCache:
        """(`reads_candidates`: no screened head here, nothing to read.)"""
        return GrowingKVCache(shapes.num_layers, rows, shapes.kv_heads, shapes.head_dim, max_len, self.dtype,
                              self.device)

    @torch.inference_mode()
    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outputs = self.wrapper(*(feeds[name] for name in self.input_names))
        return dict(zip(self.output_names, outputs))


@dataclass
class _Buffers:
    """One number of rows' static state: KV buffers, the attention mask at their length, the filled length."""

    kv: dict[str, torch.Tensor]
    mask: torch.Tensor
    past_length: torch.Tensor


class StaticTorchSession(TorchSession):
    """A decoder whose steps write a static KV cache in place; the buffers belong to the session, one set per number
    of rows, reused by every generation (so a CUDA graph captured over them stays valid), one generation at a time.

    The loop feeds the attention mask of its tokens so far; the session copies it into a mask of the buffers'
    length whose unfilled tail is 0 (the model attends over the whole buffer and the mask hides the rest).
    """

    def __init__(self, wrapper: torch.nn.Module, model: torch.nn.Module, shapes: ShapeSpec,
                 cuda_graph: bool = False) -> None:
        super().__init__(wrapper, model)
        self.shapes = shapes
        self._buffers: dict[int, _Buffers] = {}
        bound = [i for i, name in enumerate(self.input_names) if name in (*past_names(shapes.num_layers),
                                                                          PAST_LENGTH, "attention_mask")]
        self.graphs = StepGraphs(self.wrapper, self.device, bound) if cuda_graph else None
        self.info_notes = [f"static KV cache of {shapes.total.max} positions per row"
                           + (", decode steps replayed as CUDA graphs" if cuda_graph else "")]

    def new_cache(self, shapes: ShapeSpec, rows: int, max_len: int, reads_candidates: bool = False) -> StaticKVCache:
        """(`reads_candidates`: no screened head here, nothing to read.)"""
        length = max(max_len, shapes.total.max)
        held = self._buffers.get(rows)
        if held is None or held.mask.shape[1] < length:
            shape = (rows, shapes.kv_heads, length, shapes.head_dim)
            with torch.inference_mode(False):  # written in place inside and outside inference mode alike
                kv = {name: torch.zeros(shape, dtype=self.dtype, device=self.device)
                      for name in past_names(shapes.num_layers)}
                mask = torch.zeros((rows, length), dtype=torch.long, device=self.device)
                past_length = torch.zeros((), dtype=torch.long, device=self.device)
            held = self._buffers[rows] = _Buffers(kv, mask, past_length)
        return StaticKVCache(held.kv, shapes.num_layers, held.past_length)

    @torch.inference_mode()
    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = feeds["input_ids"].shape[0]
        held = self._buffers.get(rows)
        if held is None or feeds[FIRST_PAST] is not held.kv[FIRST_PAST]:
            raise HarnessError("a static-cache session runs over the caches it made (new_cache), one at a time")
        args = [feeds[name] for name in self.input_names]
        if "attention_mask" in feeds:
            mask = feeds["attention_mask"]
            if mask.shape[1] == feeds["input_ids"].shape[1]:  # a first step: the tail left by the last one goes
                held.mask.zero_()
            held.mask[:, : mask.shape[1]].copy_(mask)
            args[self.input_names.index("attention_mask")] = held.mask
        decode = feeds["input_ids"].shape[1] == 1
        if self.graphs is not None and decode:
            outputs = self.graphs.run(args)
        else:
            outputs = self.wrapper(*args)
        return dict(zip(self.output_names, outputs))


def static_steps(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> bool:
    """Whether the decoder steps over a static KV cache: with --cuda-graph, which needs one (a UsageError says why
    it cannot apply)."""
    if not options.cuda_graph:
        return False
    model, device = loaded.model, next(loaded.model.parameters()).device
    if device.type != "cuda":
        raise UsageError(f"--cuda-graph replays decode steps on a CUDA GPU; the frameworks backend runs on "
                         f"{device.type} here")
    if not settings.use_cache:
        raise UsageError("--cuda-graph replays decode steps over the KV cache; it cannot apply without it")
    refusal = loaded.spec.hooks.static_cache_refusal(model)
    if refusal is not None:
        raise UsageError(f"--cuda-graph needs a static KV cache, and {refusal}")
    return True


def decoder_session(wrapper_of, loaded: LoadedModel, settings: BuildSettings, options: BackendOptions,
                    static: bool | None = None) -> TorchSession:
    """The decoder's session over `wrapper_of(static)` (a flat-tensor wrapper, static or not); `static` None
    decides by `static_steps`."""
    if settings.fp16 and loaded.model.device.type == "cpu":
        say("note: fp16 (--fp16, fp16=True) on the CPU: PyTorch computes half precision far slower than fp32 here "
            "(GPT-2 small: a 64-token prompt in 12 s against 0.16 s, then 230 against 50 ms a token); fp16 is for GPUs")
    static = static_steps(loaded, settings, options) if static is None else static
    if not static:
        return TorchSession(wrapper_of(False), loaded.model)
    from nndf.architectures import architecture

    shapes = architecture(loaded.spec).derive_shapes(settings, loaded.spec, loaded.config)
    return StaticTorchSession(wrapper_of(True), loaded.model, shapes, cuda_graph=options.cuda_graph)


def open_session(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions,
                 static: bool | None = None) -> TorchSession:
    """The frameworks backend needs no artifacts; it runs the PyTorch model as loaded (fp32 or fp16), so the
    ONNX-only options (quantization, a given ONNX file) leave it as it is: it stays the reference beside them."""
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    model = loaded.model
    layers = loaded.spec.hooks.num_layers(model.config)
    return decoder_session(lambda s: DecoderWrapper(model, layers, settings.use_cache, static=s), loaded, settings,
                           options, static)


def open_seq2seq(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions,
                 static: bool | None = None) -> dict[str, TorchSession]:
    """An encoder-decoder model's three sessions (encoder, cross-attention cache generator, decoder): the modules
    of its graph set, the very ones the ONNX exporter traces."""
    from nndf.seq2seq.export import graph_set

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    model, graphs, hooks = loaded.model, graph_set(loaded), loaded.spec.hooks
    wrappers = graphs.wrappers(model, hooks, settings.use_cache)
    sessions = {graph: TorchSession(wrapper, model) for graph, wrapper in wrappers.items() if graph != "decoder"}
    sessions["decoder"] = decoder_session(
        lambda s: graphs.wrappers(model, hooks, settings.use_cache, static=s)["decoder"], loaded, settings, options,
        static)
    return sessions

# Benchmarks also time Hugging Face generate() on the same PyTorch model: the figure users compare against.
MEASURE_HF_GENERATE = True
