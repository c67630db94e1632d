"""PyTorch decoder -> ONNX, once per set of settings, kept in the working dir with metadata that says what built it.

The graph is `DecoderWrapper` traced by torch's default (dynamo) exporter with dynamic batch and sequence
dimensions: with cache, one graph serves the context phase (empty past) and the generation phase (one new token);
without cache, the graph has no past inputs at all. Weights go to an external data file beside the graph (one
file, so the 2 GB protobuf limit never matters: gpt2-xl is 6 GB in fp32), and tied embeddings are stored once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from nndf.errors import HarnessError
from nndf.export.attention_inputs import kernel_reads_query_seqlens
from nndf.export.cpu_int8 import screen_weight_levels
from nndf.export.fused_attention import GROWING, LAYOUTS, SHARED, layout_refusal
from nndf.export.graph_files import external_data_files
from nndf.export.graph_reads import first_line
from nndf.export.kept_rows import last_layer_on_kept_rows
from nndf.export.screened_head import topk_takes_no_rows
from nndf.export.torchlib_registry import torchlib_registry_built_once
from nndf.export.wrapper import DecoderWrapper, decoder_io
from nndf.heap import empty_tensors
from nndf.loading import LoadedModel
from nndf.page_cache import drop_from_page_cache
from nndf.progress import say, ticking
from nndf.workspace import artifact_lock, artifact_name, build_dir_artifact, read_metadata, stale_reason

# Bump when a change here changes the graphs produced, so that old exports are rebuilt rather than reused.
EXPORTER_REVISION = 14  # shared layout (ort_fusions): 4 fused normalizations, 5 rotary embeddings, 6 sibling MatMuls,
# 7 the LM head in chunks, 8 the screened head, 9 its candidates as an output; 10 the last layer on the kept rows;
# 11 the screen's candidates found block by block; 12 LayerNorms left apart from their residual Add;
# 13 packed QKV into GroupQueryAttention; 14 rotary inside GroupQueryAttention
GRAPH_FILE = "decoder.onnx"


def _versions() -> dict[str, str]:
    import onnx
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
            "exporter_revision": str(EXPORTER_REVISION)}


@dataclasses.dataclass(frozen=True)
class DecoderExport:
    """Where an exported graph lives (a file in a folder artifact) and what it takes and returns."""

    folder: Path
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    graph_file: str = GRAPH_FILE
    layout: str = GROWING  # the KV layout (nndf.export.fused_attention): growing pasts, or shared whole-length buffers
    kept_rows: bool = False  # its last layer past the attention runs on the kept rows only (nndf.export.kept_rows)

    @property
    def graph(self) -> Path:
        return self.folder / self.graph_file


def export_settings(loaded: LoadedModel, use_cache: bool, layout: str = GROWING) -> dict:
    """Every setting that shapes the exported graph; its hash names the artifact. The shared layout's graph holds
    this CPU's int8 precision (`screen_weight_levels`) and is fused for the installed ONNX Runtime's kernels, so a
    working dir used by another CPU kind or version gets its own graph rather than one refused or killed there."""
    settings = {
        "kind": "onnx-decoder",
        "family": loaded.spec.family,
        "variant": loaded.variant.name,
        "weights": loaded.weights_id,
        "use_cache": use_cache,
        "kv_layout": layout,
        "versions": _versions(),
    }
    if layout == SHARED:
        settings["screen_weight_levels"] = screen_weight_levels()
        settings["onnxruntime_kernels"] = {"gqa_query_seqlens": kernel_reads_query_seqlens(),
                                           "topk_no_rows": topk_takes_no_rows()}
    return settings


def asked_layout(use_cache: bool, requested: str) -> str:
    """The layout `requested` asks for, before the model has its say: a graph without a cache has no KV layout to
    share, so it is growing."""
    if requested not in LAYOUTS:
        raise HarnessError(f"unknown KV layout '{requested}'; allowed: {', '.join(LAYOUTS)}")
    return GROWING if requested == GROWING or not use_cache else SHARED


def kv_layout(loaded: LoadedModel, use_cache: bool, requested: str) -> tuple[str, str | None]:
    """The KV layout a decoder export of this model gets when `requested` is asked for, and why it differs if so."""
    if asked_layout(use_cache, requested) == GROWING:
        return GROWING, None
    refusal = layout_refusal(loaded.model_class)
    return (GROWING, refusal) if refusal else (SHARED, None)


def dynamic_dims(max_positions: int, use_cache: bool) -> dict[str, object]:
    """Named dynamic dimensions shared by every input, with ranges that keep past + new within the model's positions.

    Each past tensor with a dimension of its own, or ranges that allow past + new beyond the model's positions, make
    the exporter carry every layer's `Min(max_positions, past + new)` slice bound into the next layer's shapes: the
    expressions nest once per layer and sympy takes minutes over them (GPT-Neo's local attention: 6 layers 52 s,
    12 layers over 5 minutes; tied and bounded: 6 layers 9 s). The ranges are tracing facts only: the graph has no
    range checks, and its maths is exact for any past + new within the model's positions.
    """
    from torch.export import Dim

    new_max = max(max_positions // 2, 3) if use_cache else max_positions  # the example has 3 new, 4 past positions
    sequence = Dim("sequence", max=new_max)
    return {"batch": Dim("batch"), "sequence": sequence,
            "past_sequence": Dim("past_sequence", max=max(max_positions - new_max, 4)),
            # without a cache the mask covers exactly the new tokens
            "total_sequence": Dim("total_sequence", max=max(max_positions, 7)) if use_cache else sequence,
            "kept": Dim("kept", max=new_max)}


def _example_inputs(wrapper: DecoderWrapper, config, hooks) -> tuple[tuple, dict]:
    """Example tensors (batch 2, 3 new tokens, 4 past positions; shared buffers of 10) and their dynamic dimensions."""
    from torch.export import Dim

    dims = dynamic_dims(hooks.max_positions(config), wrapper.use_cache)
    if wrapper.shared:  # whole-length buffers: their length is a dimension of its own, larger than past + new
        dims["past_sequence"] = Dim("cache_length")
    batch_dim, new_dim = dims["batch"], dims["sequence"]
    batch, new, past_len = 2, 3, 4 if wrapper.use_cache else 0
    ids = torch.randint(0, int(config.vocab_size), (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.long)
    args = [ids, mask]
    dyn_rest = []
    if wrapper.with_position_ids:
        args.append(torch.arange(past_len, past_len + new).expand(batch, new).contiguous())
        dyn_rest.append({0: batch_dim, 1: new_dim})
    args.append(torch.arange(new))
    dyn_rest.append({0: dims["kept"]})
    if wrapper.use_cache:
        shape = (batch, hooks.kv_heads(config), past_len + new + 3 if wrapper.shared else past_len,
                 hooks.head_dim(config))
        for _ in range(2 * wrapper.num_layers):
            args.append(torch.randn(shape))
            dyn_rest.append({0: batch_dim, 2: dims["past_sequence"]})
    dynamic = {"input_ids": {0: batch_dim, 1: new_dim}, "attention_mask": {0: batch_dim, 1: dims["total_sequence"]}}
    if dyn_rest:
        dynamic["rest"] = tuple(dyn_rest)
    return tuple(args), dynamic


@contextlib.contextmanager
def eager_attention(model, implementation: str = "eager"):
    """Trace the model's eager attention, not SDPA, and put the model back as it was afterwards (`implementation`:
    another registered attention, the shared-buffer layout's).

    SDPA's exported form transposes the whole key cache at every step (Reshape -> Transpose -> Reshape) where ONNX
    Runtime cannot fold it into the MatMul; measured on GPT-2 small the eager graph decodes 0.78x HF's step time
    at batch 1 (SDPA graph: 0.84x) and gives 1.86x its tokens/s at batch 4 (1.61x). The maths is the same.
    """
    before = getattr(model.config, "_attn_implementation", None)
    if before in (None, implementation) or not hasattr(model, "set_attn_implementation"):  # eager-only (BLIP)
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def attributes_kept(model):
    """Put back every module attribute the trace set or replaced, so that the PyTorch model runs as before.

    A forward may cache a tensor on its module (transformers' longrope rotary stores `long_inv_freq` on its first
    call): under the exporter that tensor is a FakeTensor, and the model's later forwards (Hugging Face
    `generate()`, the frameworks backend) read it and compute garbage. Only plain attributes are restored;
    parameters and buffers are the model's own (the exporter does not write them).
    """
    before = {module: dict(vars(module)) for module in model.modules()}
    try:
        yield
    finally:
        for module, attributes in before.items():
            state = vars(module)
            for name in [name for name in state if name not in attributes]:
                del state[name]
            for name, value in attributes.items():
                if state.get(name) is not value:
                    state[name] = value


def dynamic_rope_fixed(model) -> None:
    """Trace 'dynamic' (NTK-aware) RoPE with the frequencies it has. transformers recomputes them in Python when a
    sequence outgrows `max_position_embeddings` (a branch on the largest position id, which torch.export cannot
    trace: the export failed); no sequence of ours does (ShapeSpec refuses longer ones), so up to there the
    module's own frequencies are what every forward of it uses, and the graph is exact. Call it inside
    `attributes_kept`, which puts each `rope_type` back."""
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if not hasattr(module, "original_max_seq_len") or not isinstance(kinds, (str, dict)):
            continue
        per_layer = dict(kinds) if isinstance(kinds, dict) else {None: kinds}
        for layer, kind in per_layer.items():  # a layer type's own frequencies (Gemma 3's) are its own cache's
            cached = getattr(module, f"{layer}_max_seq_len_cached" if layer else "max_seq_len_cached",
                             module.max_seq_len_cached)
            if "dynamic" in kind and cached == module.original_max_seq_len:  # not grown: the original frequencies
                per_layer[layer] = "default"
        fixed = per_layer if isinstance(kinds, dict) else per_layer[None]
        if fixed != kinds:
            module.rope_type = fixed


def model_io(loaded: LoadedModel, use_cache: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The input and output names a decoder graph of this model must have (its weights are not loaded for it)."""
    return decoder_io(loaded.model_class, loaded.spec.hooks.num_layers(loaded.config), use_cache)


@contextlib.contextmanager
def quiet_logger(name: str):
    """Keep a library logger's warnings off the user's screen for the block (the exporter warns, once per optional
    operator library it looks for, that torchvision is not installed)."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def trace_to_onnx(wrapper, args, dynamic, io: dict, path: Path, model, label: str) -> None:
    """Trace `wrapper` with torch's dynamo exporter (eager attention, or the shared-buffer layout's fused one; named
    dynamic dimensions) and save the graph with its weights in one external data file beside it; any exporter
    failure is one HarnessError."""
    attention, translation = "eager", None
    if getattr(wrapper, "shared", False):
        from nndf.export.fused_attention import ATTENTION, CUSTOM_TRANSLATION, register

        register()
        attention, translation = ATTENTION, CUSTOM_TRANSLATION
    with ticking(f"exporting {label}"):  # the trace, ONNX Runtime's fusions and the save (a large model's minute)
        try:
            with contextlib.redirect_stdout(sys.stderr), eager_attention(model, attention), attributes_kept(model), \
                    warnings.catch_warnings(), quiet_logger("torch.onnx._internal.exporter._registration"), \
                    torchlib_registry_built_once():
                dynamic_rope_fixed(model)
                # shared named dimensions make the exporter say, once per input, that it keeps the first name
                warnings.filterwarnings("ignore", message=r".*axis name: .* will not be used")
                # a forward that caches a tensor on its module (longrope's `long_inv_freq`): `attributes_kept` undoes it
                warnings.filterwarnings("ignore", message=r"The tensor attribute .* was assigned during export")
                # torch's pytree deprecation inside the exporter, not ours to act on
                warnings.filterwarnings("ignore", category=FutureWarning, message=r".*LeafSpec.*")
                program = torch.onnx.export(
                    wrapper, args, dynamo=True, dynamic_shapes=dynamic, input_names=list(io["input_names"]),
                    output_names=list(io["output_names"]), optimize=True, verbose=False,
                    custom_translation_table=translation,
                )
        except Exception as exc:  # the exporter raises many types; the user needs one sentence and the cause
            raise HarnessError(f"ONNX export of {label} failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        if getattr(wrapper, "shared", False):  # ONNX Runtime's alone: its fused normalizations
            from nndf.export import ort_fusions

            try:
                ort_fusions.fuse_for_onnxruntime(program.model)
            except Exception as exc:  # a rewrite or the optimizer after them: onnxscript raises many types
                raise HarnessError(f"ONNX Runtime's fusions on the export of {label} failed "
                                   f"({first_line(exc, with_type=True)}); --kv-layout growing exports without "
                                   "them") from exc
        program.save(path, external_data=True)
        drop_weights(program.model)


def drop_weights(model) -> None:
    """Let an exported onnx_ir model's initializers go once it is saved. onnxscript's default rewrite rules, which
    the exporter's optimizer applies, are module-level objects whose matchers keep the last graph they matched:
    that graph wraps the PyTorch parameters (and the new arrays the fusions made), which would otherwise stay in
    memory for the rest of the process, a second copy of the weights beside the session that runs the saved graph."""
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            value.const_value = None


@contextlib.contextmanager
def fp32_cpu_model(model):
    """The model itself when it is fp32 on the CPU, else an fp32 CPU copy: graphs are exported from one. A copy's
    tensors are emptied when the block ends, since the exporter's leftovers keep it referenced
    (`nndf.heap.empty_tensors`): a CUDA fp16 model's export would otherwise keep an fp32 copy in host memory."""
    first = next(model.parameters())
    if first.dtype == torch.float32 and first.device.type == "cpu":
        yield model
        return
    copied = copy.deepcopy(model).to(device="cpu", dtype=torch.float32)
    try:
        yield copied
    finally:
        empty_tensors(copied)


def _export_folder(loaded: LoadedModel, settings: dict, working_dir: str | Path) -> Path:
    """The folder of the export with these `export_settings`."""
    layout = settings["kv_layout"]
    stem = f"{loaded.spec.family}-{loaded.name}-decoder" + ("-shared-kv" if layout == SHARED else "")
    return Path(working_dir) / artifact_name(stem, settings, "")


def decoder_export_location(loaded: LoadedModel, use_cache: bool, working_dir: str | Path,
                            layout: str = GROWING) -> DecoderExport:
    """Where the exported decoder for these settings lives (built or not), and its names: no weights are loaded.
    `layout` is the one the export gets (`kv_layout`)."""
    folder = _export_folder(loaded, export_settings(loaded, use_cache, layout), working_dir)
    return DecoderExport(folder, *model_io(loaded, use_cache), layout=layout)


def built_export(loaded: LoadedModel, use_cache: bool, working_dir: str | Path, layout: str) -> DecoderExport | None:
    """The decoder export with `layout`, when one is built for these settings and intact, found from its settings
    and metadata alone (its tensor names are those it was built with), else None.

    Why: deciding the layout (`kv_layout`) and the names (`model_io`) asks the model's class, and importing it
    imports transformers' modeling code, about 1.5 s and 110 MB of peak memory that running an already exported
    graph does not need. A built shared-layout export is proof enough that the model allows that layout: the
    settings it was built with name transformers' version, the weights and everything else that shapes it."""
    settings = export_settings(loaded, use_cache, layout)
    folder = _export_folder(loaded, settings, working_dir)
    if stale_reason(folder, settings) is not None:
        return None
    meta = read_metadata(folder)
    if not isinstance(meta.get("input_names"), list) or not isinstance(meta.get("output_names"), list):
        return None
    return DecoderExport(folder, tuple(meta["input_names"]), tuple(meta["output_names"]), layout=layout,
                         kept_rows=meta.get("kept_rows") is True)


def export_decoder(loaded: LoadedModel, use_cache: bool, working_dir: str | Path,
                   layout: str = GROWING) -> DecoderExport:
    """The exported decoder for these settings: reused when its metadata matches, else (re)built with a message.
    `layout` is the KV layout asked for; a model that cannot have it gets the growing one (`kv_layout`)."""
    layout, _ = kv_layout(loaded, use_cache, layout)
    settings = export_settings(loaded, use_cache, layout)
    location = decoder_export_location(loaded, use_cache, working_dir, layout)
    folder = location.folder
    input_names, output_names = location.input_names, location.output_names
    io = {"input_names": list(input_names), "output_names": list(output_names)}
    with artifact_lock(folder, say):  # another process may be building it: wait, then reuse it
        reason = stale_reason(folder, dict(settings, **io))
        if reason is None:
            return dataclasses.replace(location, kept_rows=read_metadata(folder).get("kept_rows") is True)
        if folder.exists():
            say(f"rebuilding {folder}: {reason}")
        hooks = loaded.spec.hooks
        with fp32_cpu_model(loaded.model) as model, \
                last_layer_on_kept_rows(model, hooks.num_layers(model.config), hooks.pre_attention) as keeps_rows:
            wrapper = DecoderWrapper(model, hooks.num_layers(model.config), use_cache, layout=layout)
            wrapper.keeps_rows = keeps_rows
            args, dynamic = _example_inputs(wrapper, model.config, hooks)
            cache = f"with {'a shared-buffer' if layout == SHARED else 'a'} KV cache" if use_cache else \
                "without KV cache"
            say(f"exporting {loaded.name} to ONNX ({cache}) ...")
            started = time.perf_counter()

            def build(tmp: Path) -> None:
                trace_to_onnx(wrapper, args, dynamic, io, tmp / GRAPH_FILE, model, loaded.name)

            build_dir_artifact(folder, build, dict(settings, **io, kept_rows=keeps_rows))
        say(f"exported in {time.perf_counter() - started:.1f} s to {folder}")
        return dataclasses.replace(location, kept_rows=keeps_rows)


def derived_graph(export: DecoderExport, label: str, settings: dict, working_dir: str | Path,
                  build: Callable[[Path], None], doing: str) -> Path:
    """A graph made from an exported one (quantized, fp16), as a folder artifact of its own: named from its
    settings, the source's tensor names in its metadata, reused while all of it matches, else rebuilt with the
    reason. `build(path)` writes the graph (and its external data beside it) to `path`; `doing` is the progress line.
    """
    graph_file = export.graph.name
    stem = export.folder.name if graph_file == GRAPH_FILE else f"{export.folder.name}-{export.graph.stem}"
    folder = Path(working_dir) / artifact_name(f"{stem}-{label}", settings, "")
    metadata = dict(settings, input_names=list(export.input_names), output_names=list(export.output_names))
    with artifact_lock(folder, say):
        reason = stale_reason(folder, metadata)
        if reason is None:
            return folder / graph_file
        if folder.exists():
            say(f"rebuilding {folder}: {reason}")
        say(doing)
        started = time.perf_counter()
        with ticking(f"building the {label} graph"):
            build_dir_artifact(folder, lambda tmp: build(tmp / graph_file), metadata)
        # the source was read whole by the build (`nndf.page_cache`)
        drop_from_page_cache([export.graph, *external_data_files(export.graph).values()])
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20
        say(f"done in {time.perf_counter() - started:.1f} s: {folder} ({size:.0f} MiB)")
        return folder / graph_file
