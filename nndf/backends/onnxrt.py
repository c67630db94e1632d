"""The `onnxrt` backend: the exported decoder graph in ONNX Runtime, with the KV cache kept as ORT values.

A graph has one of two KV layouts (`nndf.export.fused_attention`), which the session reads from the graph itself
and the loop never sees:
- growing: a step's `present.*` outputs become the next step's `past_key_values.*` inputs as they are: with IO
  binding the runtime allocates each present once and we hand the same OrtValue back, so no cache tensor is
  converted between steps (the attention inside the graph concatenates past and new, as in every backend);
- shared: one buffer per past, of the generation's whole length, bound as both the past input and the present
  output (`SharedBufferCache`); the graph's GroupQueryAttention writes the new positions in place, so a step
  copies no cache, and beam search reorders the buffers in place.
Plain `session.run` with numpy arrays is kept as an alternative (`io_binding=False`) for measurement; the shared
layout always binds (its point is that past and present are one buffer).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from nndf.backends import BackendOptions
from nndf.errors import UsageError
from nndf.export.graph_reads import GraphLoadError, rebuilt_once
from nndf.export.screened_head import CANDIDATES as SCREEN_CANDIDATES, INPUT as SCREEN_INPUT
from nndf.hugepages import HugePageReport, huge_pages_for_load
from nndf.backends.ort_cache import PresentCache, SharedBufferCache, SharedStep, as_numpy
from nndf.backends.ort_runtime import CPU_DISABLED_OPTIMIZERS, ort_module, session_options
from nndf.kvcache import KINDS, past_name, present_name
from nndf.loading import LoadedModel
from nndf.spec import BuildSettings, ShapeSpec

OPTIONAL_INPUTS = frozenset({SCREEN_INPUT})
OPTIONAL_OUTPUTS = frozenset({SCREEN_CANDIDATES})  # returned as numpy arrays, after the role's outputs

DESCRIPTION = "ONNX Runtime on the exported graph (CPU; CUDA with onnxruntime-gpu and a GPU)"


def graph_layout(graph: Path) -> str:
    """The KV layout of a graph file: shared when its attention is ONNX Runtime's GroupQueryAttention (exported,
    quantized or given with --decoder-onnx alike), else growing. Reads the graph without its weights."""
    import onnx

    from nndf.export.fused_attention import GROWING, OP_TYPE, SHARED

    model = onnx.load(str(graph), load_external_data=False)
    return SHARED if any(node.op_type == OP_TYPE for node in model.graph.node) else GROWING


def default_threads() -> int | None:
    """The intra-op thread count of a session not given `--threads`: OMP_NUM_THREADS where it is a positive whole
    number, as PyTorch reads it, so that both runtimes of one run get the same count (a user who limits PyTorch with
    it, or several processes sharing a machine, limit ONNX Runtime too); else None, ONNX Runtime's own default of
    one thread per physical core."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


class OrtSession:
    """An InferenceSession with the same call as every backend: named tensors in, named torch tensors out."""

    def __init__(self, graph: Path, input_names, output_names, threads: int | None = None,
                 io_binding: bool | None = True, use_gpu: bool | None = None, torch_outputs: bool = False,
                 role: str = "decoder", layout: str | None = None, layout_note: str | None = None,
                 notes: tuple[str, ...] = ()) -> None:
        ort = ort_module()
        options = session_options(threads or default_threads())
        providers = ["CPUExecutionProvider"]
        if use_gpu is None:
            use_gpu = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
        if use_gpu:
            providers.insert(0, "CUDAExecutionProvider")
        self.huge_pages = HugePageReport()
        state = ort.capi.onnxruntime_pybind11_state
        with huge_pages_for_load(self.huge_pages):  # the weights ONNX Runtime holds, on 2 MiB pages
            try:
                # on the CPU alone, residual Adds and LayerNorms stay apart (ort_runtime: its fused kernel is slower)
                self.session = ort.InferenceSession(str(graph), options, providers=providers,
                                                    disabled_optimizers=None if use_gpu else CPU_DISABLED_OPTIMIZERS)
            except (state.InvalidProtobuf, state.InvalidGraph, state.NoSuchFile, state.Fail) as exc:
                raise GraphLoadError(Path(graph), exc) from exc
        self.artifacts = [Path(graph)]
        # onnxruntime-gpu lists CUDA as available even without a GPU and then silently falls back: trust only
        # the providers the session really got.
        self.provider = self.session.get_providers()[0]
        self.output_device = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        graph_inputs = tuple(i.name for i in self.session.get_inputs())
        graph_outputs = tuple(o.name for o in self.session.get_outputs())
        # inputs a graph may have beyond its role's: the screened head's choice (`nndf.export.screened_head`)
        optional = tuple(name for name in graph_inputs if name in OPTIONAL_INPUTS and name not in input_names)
        extra = tuple(name for name in graph_outputs if name in OPTIONAL_OUTPUTS and name not in output_names)
        if set(graph_inputs) != set(input_names) | set(optional) or set(graph_outputs) != set(output_names) | set(extra):
            raise UsageError(f"{graph} does not have the {role}'s inputs and outputs: "
                             + _name_difference(set(input_names) | set(output_names),
                                                set(graph_inputs) | set(graph_outputs)))
        self.name = "onnxrt"
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.input_names = tuple(input_names) + optional
        self.output_names = tuple(output_names) + extra
        self.extra_outputs = extra
        # None: bind only on the CUDA provider (where it saves host-device copies); see `open_seq2seq`.
        self.io_binding = io_binding if io_binding is not None else self.provider == "CUDAExecutionProvider"
        self.torch_outputs = torch_outputs  # every output as a torch tensor (graphs whose outputs the loop reads)
        self.host_threads = 1  # see Decoder.host_threads: the loop's small ops must not wake PyTorch's pool
        layers = sum(name.startswith("past_key_values.") for name in self.input_names) // len(KINDS)
        self.layout = layout or (graph_layout(graph) if layers else "growing")
        self.kv_layout = self.layout if layers else None  # the layout this run has (--kv-layout is only asked for)
        # shared layout: each present output is bound to the buffer its past input was fed
        self.shared_presents = {present_name(i, k): past_name(i, k) for i in range(layers) for k in KINDS} \
            if self.layout == "shared" else {}
        self.shared_pasts = set(self.shared_presents.values())
        # The SharedBufferCaches made here, by their first past's OrtValue: a step fed from one runs through the
        # cache's own binding (SharedStep); the entry goes with the cache. A continuous batch's rows, given as
        # tensors, take the generic path.
        self.shared_caches = weakref.WeakValueDictionary() if self.shared_presents and not torch_outputs else None
        self.first_shared_past = past_name(0, KINDS[0])
        self.info_notes = []  # what --info shows: the KV layout of a graph with a self-attention cache, huge pages
        if layers:
            note = f" ({layout_note})" if layout_note else ""
            self.info_notes.append(f"KV layout: {self._describe_layout()}{note}")
        if SCREEN_INPUT in optional:
            self.info_notes.append("LM head: screened for greedy search and top-k sampling (int8 logits, exact fp32 "
                                   "dot products for the columns that can be among the highest: fp32's tokens from "
                                   "a quarter of the head's bytes)")
        self.info_notes += [*notes, f"{role} {self.huge_pages.describe()}"]

    def _describe_layout(self) -> str:
        if self.layout == "shared":
            return ("shared: one buffer per layer of the generation's length, past and present bound to it, written in "
                    "place by ONNX Runtime's GroupQueryAttention")
        return "growing: each step's presents (past + new, concatenated in the graph) are the next step's pasts"

    def new_cache(self, shapes: ShapeSpec, rows: int, max_len: int,
                  reads_candidates: bool = False) -> PresentCache | SharedBufferCache:
        """`reads_candidates`: whether the loop reads a screened head's candidates after each step; a shared
        cache's binding fetches them only then (binding that output costs 55 us of a GPT-2 step)."""
        kind = SharedBufferCache if self.layout == "shared" else PresentCache
        cache = kind(shapes.num_layers, rows, shapes.kv_heads, shapes.head_dim, max_len)
        if kind is SharedBufferCache and self.shared_caches is not None:
            cache.reads_candidates = reads_candidates
            self.shared_caches[id(cache.values[self.first_shared_past])] = cache
        return cache

    def as_feed(self, tensor: torch.Tensor):
        """An input that every step feeds unchanged (cross-attention keys and values), converted once."""
        if not self.io_binding:
            return as_numpy(tensor)
        return ort_module().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(as_numpy(tensor)))

    def run(self, feeds: Mapping[str, object]) -> dict:
        if self.shared_caches is not None:  # a generation over one of our SharedBufferCaches: its own binding
            first_past = feeds.get(self.first_shared_past)
            cache = self.shared_caches.get(id(first_past))
            if cache is not None and cache.values[self.first_shared_past] is first_past:
                if cache.step is None:
                    cache.step = SharedStep(self.session, cache.values, self.shared_presents,
                                            SCREEN_CANDIDATES in self.extra_outputs and cache.reads_candidates)
                return cache.step.run(self.session, feeds)
        if not self.io_binding and not self.shared_presents:
            arrays = self.session.run(list(self.output_names), {name: as_numpy(v) for name, v in feeds.items()})
            outputs = dict(zip(self.output_names, arrays))
        else:
            ort = ort_module()
            binding = self.session.io_binding()
            if self.shared_presents:  # a buffer given as a tensor (a continuous batch's rows): an OrtValue over it
                feeds = {name: value if isinstance(value, ort.OrtValue) or name not in self.shared_pasts else
                         ort.OrtValue.ortvalue_from_numpy(as_numpy(value)) for name, value in feeds.items()}
            for name, value in feeds.items():
                if isinstance(value, ort.OrtValue):
                    binding.bind_ortvalue_input(name, value)
                else:
                    binding.bind_cpu_input(name, np.ascontiguousarray(as_numpy(value)))
            for name in self.output_names:
                if name in self.shared_presents:  # the past's own buffer: written in place
                    binding.bind_ortvalue_output(name, feeds[self.shared_presents[name]])
                    continue
                on_host = name == "logits" or name in OPTIONAL_OUTPUTS or self.torch_outputs
                binding.bind_output(name, "cpu" if on_host else self.output_device)
            self.session.run_with_iobinding(binding)
            outputs = dict(zip(self.output_names, binding.get_outputs()))
        for name in self.output_names if self.torch_outputs else ("logits", *self.extra_outputs):
            value = outputs[name]
            value = value if isinstance(value, np.ndarray) else value.numpy()
            outputs[name] = value if name in self.extra_outputs else torch.from_numpy(value)
        return outputs


def _cuda_provider() -> bool:
    """Whether sessions here run on ONNX Runtime's CUDA provider (onnxruntime-gpu and a GPU)."""
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort_module().get_available_providers()


def check_settings(settings: BuildSettings, options: BackendOptions) -> None:
    """What the actions check of this backend's settings before anything loads (`nndf.actions.plans`)."""
    check_fp16(settings, options)


def check_fp16(settings: BuildSettings, options: BackendOptions) -> None:
    """--fp16 runs fp16 graphs on ONNX Runtime's CUDA provider; on the CPU its kernels are fp32."""
    if not settings.fp16:
        return
    if options.quantize is not None:
        raise UsageError(f"--fp16 and --{options.quantize} exclude each other on the onnxrt backend; choose one")
    if not _cuda_provider():
        raise UsageError("--fp16 on the onnxrt backend needs ONNX Runtime's CUDA provider (the onnxruntime-gpu extra "
                         "and a GPU); on the CPU fp16 graphs are not faster than fp32: use --int8 or --int4 for smaller "
                         "weights there, or the trt backend for fp16")


def given_graph(path: str, flag: str, loaded: LoadedModel) -> Path:
    """A file the user gave for a graph, checked to be an ONNX model of this model's sizes before ONNX Runtime reads
    it (whose refusal is a page of C++ traceback, or, for another model's graph with the same tensor names, an
    error in the middle of the first run); its tensor names are checked when it is opened."""
    import onnx

    graph = Path(path)
    if graph.is_dir():  # an export's folder, as Optimum takes: name the graph file in it
        inside = sorted(p.name for p in graph.glob("*.onnx"))
        raise UsageError(f"{flag} {path} is a folder; it takes the .onnx file itself"
                         + (f" (this folder holds {', '.join(inside)})" if inside else ""))
    if not graph.is_file():
        raise UsageError(f"{flag} {path} does not exist")
    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends: not an ONNX file
        raise UsageError(f"{flag} {path} is not an ONNX model ({type(exc).__name__} while reading it)") from None
    if not model.graph.node:
        raise UsageError(f"{flag} {path} is not an ONNX model (it holds no graph)")
    _check_sizes(model.graph, loaded, f"{flag} {path}")
    return graph


def _check_sizes(graph, loaded: LoadedModel, given: str) -> None:
    """The fixed sizes of a graph's cache tensors (KV heads, head size) and logits (vocabulary) against the model's."""
    from nndf.spec import cache_dims

    sizes = cache_dims(loaded.spec.hooks, loaded.config)
    cache_axes = {1: ("KV heads", sizes["kv_heads"]), 3: ("head size", sizes["head_dim"])}
    for value in [*graph.input, *graph.output]:
        shape = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
        if value.name.startswith(("past_key_values.", "present.")):
            axes = cache_axes
        elif value.name == "logits" and shape:
            axes = {len(shape) - 1: ("a vocabulary", sizes["vocab_size"])}
        else:
            continue
        for axis, (what, size) in axes.items():
            if axis < len(shape) and shape[axis] not in (None, size):
                raise UsageError(f"{given} is another model's graph: its {value.name} has {what} of {shape[axis]} "
                                 f"where {loaded.name} has {size}")


def runnable_graph(export, loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> Path:
    """The file a session runs for an exported graph: the fp32 export, its int8/int4 copy, or its fp16 copy (the
    family's overflow-prone modules kept in fp32, `nndf.export.half`)."""
    if options.quantize is not None:
        from nndf.export.quantize import quantized_decoder

        return quantized_decoder(export, options.quantize, options.working_dir, block_size=options.block_size,
                                 int8_method=options.int8_kernel)
    if settings.fp16:
        from nndf.export.half import fp16_graph

        return fp16_graph(export, loaded.spec.hooks.fp32_modules(), options.working_dir)
    return export.graph


def open_session(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> OrtSession:
    """Export (or reuse) the decoder graph for these settings, quantize it if asked, and open it.

    `options.decoder_onnx` runs a given file instead, after checking its input and output names.
    """
    from nndf.export.onnx import model_io

    check_fp16(settings, options)
    if options.decoder_onnx is not None:
        path = given_graph(options.decoder_onnx, "--decoder-onnx", loaded)
        inputs, outputs = model_io(loaded, settings.use_cache)
        return OrtSession(path, inputs, outputs, options.threads, options.io_binding)
    return rebuilt_once(lambda: _open_exported(loaded, settings, options))


def _open_exported(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> OrtSession:
    """`open_session` on the decoder it exports (or reuses) for these settings."""
    from nndf.export.onnx import asked_layout, built_export, export_decoder, kv_layout

    on_cuda = _cuda_provider()
    wanted = "growing" if on_cuda else asked_layout(settings.use_cache, options.kv_layout)
    export, refusal = built_export(loaded, settings.use_cache, options.working_dir, wanted), None
    if export is None:  # not built yet, or the model may not allow the layout: ask its class
        layout, refusal = kv_layout(loaded, settings.use_cache, options.kv_layout)
        if layout == "shared" and on_cuda:
            layout, refusal = "growing", ("on ONNX Runtime's CUDA provider graphs keep the growing layout: the "
                                          "shared buffers are host memory, and GroupQueryAttention's CUDA kernel is "
                                          "fp16/bf16")
        export = export_decoder(loaded, settings.use_cache, options.working_dir, layout)
    graph = runnable_graph(export, loaded, settings, options)
    notes = ("last layer: past its attention, only the rows whose logits are kept (the last position while "
             "generating), as llama.cpp's output ids",) if export.kept_rows else ()
    return OrtSession(graph, export.input_names, export.output_names, options.threads, options.io_binding,
                      layout=export.layout, layout_note=refusal, notes=notes + quantization_notes(options))


def quantization_notes(options: BackendOptions) -> tuple[str, ...]:
    """--info's line on how the weights were quantized, if they were (int8's method depends on the CPU)."""
    if options.quantize is None:
        return ()
    from nndf.export.quantize import describe_quantization

    return (f"weights: {describe_quantization(options.quantize, options.block_size, options.int8_kernel)}",)


SEQ2SEQ_OVERRIDES = {"encoder": "encoder_onnx", "cross": "cache_generator_onnx", "decoder": "decoder_onnx"}


def open_seq2seq(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> dict[str, OrtSession]:
    """An encoder-decoder model's three graphs, exported (or reused) in one folder, quantized if asked, and opened.

    `--encoder-onnx`, `--cache-generator-onnx` and `--decoder-onnx` run given files instead, each checked by its
    tensor names; the graphs not given are exported. The encoder's and the cache generator's outputs are read by
    the loop (once per generation), so they come back as torch tensors; the decoder's presents stay ORT values.

    On the CPU the three sessions use plain `session.run` with numpy arrays, not IO binding: with the decoder's
    many fixed inputs (every layer's cross keys and values) binding them each step costs more than it saves
    (t5-small, 64 + 64 tokens, 1 thread, same process, interleaved: 888 vs 1016 ms at batch 4, 601 vs 638 ms at
    batch 1). `io_binding=False` in the options forces plain runs on CUDA too.
    """
    from nndf.seq2seq.export import export_seq2seq, graph_roles, seq2seq_io

    check_fp16(settings, options)
    given = {graph: getattr(options, flag) for graph, flag in SEQ2SEQ_OVERRIDES.items()}
    for graph, path in given.items():
        if path is not None:
            given_graph(path, f"--{SEQ2SEQ_OVERRIDES[graph].replace('_', '-')}", loaded)
    io = seq2seq_io(loaded, settings.use_cache)

    def open_graphs() -> dict[str, OrtSession]:
        export = None if all(given.values()) else export_seq2seq(loaded, settings.use_cache, options.working_dir)
        sessions = {}
        for graph, (inputs, outputs) in io.items():
            path = Path(given[graph]) if given[graph] else runnable_graph(export.graphs[graph], loaded, settings,
                                                                           options)
            sessions[graph] = OrtSession(path, inputs, outputs, options.threads,
                                         None if options.io_binding else False, torch_outputs=graph != "decoder",
                                         role=graph_roles(loaded)[graph],
                                         notes=quantization_notes(options) if graph == "decoder" and not given[graph]
                                         else ())
        return sessions

    return rebuilt_once(open_graphs, given.values())


def _name_difference(expected: set[str], found: set[str], shown: int = 4) -> str:
    """What a graph lacks and has too many, a few names of each (a 30-layer model has 120 cache tensors)."""
    def some(names: set[str]) -> str:
        ordered = sorted(names)
        more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
        return ", ".join(ordered[:shown]) + more

    parts = [f"{len(expected)} tensors expected, {len(found)} found"]
    if expected - found:
        parts.append(f"missing {some(expected - found)}")
    if found - expected:
        parts.append(f"not expected {some(found - expected)}")
    return "; ".join(parts)
