"""An encoder-decoder model -> three ONNX graphs in one folder artifact, as the decoder-only export does for one.

`encoder.onnx`, `cross.onnx` (the cross-attention cache generator) and `decoder.onnx` are the three wrappers of
the model's graph set (`TextGraphs` in `nndf.seq2seq.wrappers` for T5 and BART, `ImageGraphs` in
`nndf.seq2seq.image_graphs` for BLIP: the architecture strategy names it) traced by the same exporter as
decoder-only graphs (dynamo, eager attention, weights in an external data file per graph), with named dynamic
dimensions shared by every input (batch, sequence lengths, kept logits) that the graph set's examples declare. The folder is named from a hash of every
setting that shaped it and carries the same metadata (settings, library versions, each graph's input and output
names, every file's size), so a stale, foreign or truncated export is rebuilt with the reason, never reused. Only
the decoder's graph depends on the KV cache: an export for one cache setting copies the other two graphs from the
other setting's export when that one is built and intact.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nndf.export.onnx import DecoderExport, export_settings, fp32_cpu_model, trace_to_onnx
from nndf.progress import say
from nndf.loading import LoadedModel
from nndf.workspace import artifact_lock, artifact_name, build_dir_artifact, read_metadata, stale_reason

GRAPHS = ("encoder", "cross", "decoder")
ROLES = {"encoder": "encoder", "cross": "cross-attention cache generator", "decoder": "decoder"}  # in messages


@dataclass(frozen=True)
class Seq2SeqExport:
    """The folder of the three graphs; `graphs[name]` is each one's file and names (as for a decoder export)."""

    folder: Path
    graphs: dict[str, DecoderExport]


def graph_set(loaded: LoadedModel):
    """The model's kind of three graphs (text or image encoder), from its architecture strategy."""
    from nndf.architectures import architecture

    return architecture(loaded.spec).graphs


def graph_roles(loaded: LoadedModel) -> dict[str, str]:
    """How messages name each graph ("vision encoder" for an image model's encoder)."""
    return dict(ROLES, encoder=graph_set(loaded).encoder_role)


def seq2seq_io(loaded: LoadedModel, use_cache: bool) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Every graph's (inputs, outputs), known without loading the weights."""
    return graph_set(loaded).io(loaded.spec.hooks, loaded.config, use_cache)


def _settings(loaded: LoadedModel, use_cache: bool) -> dict:
    return dict(export_settings(loaded, use_cache), kind=f"onnx-{graph_set(loaded).kind}")


def seq2seq_export_location(loaded: LoadedModel, use_cache: bool, working_dir: str | Path) -> Seq2SeqExport:
    """Where the three exported graphs for these settings live (built or not), and their names: no weights loaded."""
    stem = f"{loaded.spec.family}-{loaded.name}-{graph_set(loaded).kind}"
    folder = Path(working_dir) / artifact_name(stem, _settings(loaded, use_cache), "")
    io = seq2seq_io(loaded, use_cache)
    return Seq2SeqExport(folder, {graph: DecoderExport(folder, i, o, f"{graph}.onnx") for graph, (i, o) in io.items()})


def _metadata(loaded: LoadedModel, use_cache: bool) -> dict:
    """What an export's metadata must say for these settings: the settings and each graph's tensor names."""
    io = seq2seq_io(loaded, use_cache)
    names = {graph: {"input_names": list(i), "output_names": list(o)} for graph, (i, o) in io.items()}
    return dict(_settings(loaded, use_cache), graphs=names)


def _copy_from_sibling(loaded: LoadedModel, use_cache: bool, working_dir: str | Path, graph: str, tmp: Path) -> bool:
    """Copy `graph` (the encoder or the cross-attention cache generator) from the intact export of the other cache
    setting, when there is one, into `tmp`; whether it did.

    Why: only the decoder's graph depends on the cache (its wrapper, inputs and example shapes); the other two are
    traced from the same wrappers on the same examples either way, so a model exported with the cache and then
    without it (or the other way round) traces them once. Not under the sibling's lock (two processes building
    the two settings would wait on each other): a copy that does not match the sizes the sibling's metadata
    records is dropped, and the graph traced instead."""
    sibling = seq2seq_export_location(loaded, not use_cache, working_dir).folder
    if stale_reason(sibling, _metadata(loaded, not use_cache)) is not None:
        return False
    recorded = (read_metadata(sibling) or {}).get("files") or {}  # none while another process rebuilds it
    names = [name for name in recorded if name == f"{graph}.onnx" or name.startswith(f"{graph}.onnx.")]
    if f"{graph}.onnx" not in names:
        return False
    try:
        for name in names:
            shutil.copyfile(sibling / name, tmp / name)
        copied = all((tmp / name).stat().st_size == recorded[name] for name in names)
    except OSError:
        copied = False
    if not copied:
        for name in names:
            (tmp / name).unlink(missing_ok=True)
        return False
    say(f"  {graph}.onnx copied from {sibling} (the same graph {'without' if use_cache else 'with'} KV cache)")
    return True


def export_seq2seq(loaded: LoadedModel, use_cache: bool, working_dir: str | Path) -> Seq2SeqExport:
    """The three exported graphs for these settings: reused when the metadata matches, else (re)built, with the
    encoder's and the cache generator's graphs copied from the other cache setting's export when it has them."""
    result = seq2seq_export_location(loaded, use_cache, working_dir)
    folder = result.folder
    metadata = _metadata(loaded, use_cache)
    names = metadata["graphs"]
    with artifact_lock(folder, say):  # another process may be building it: wait, then reuse it
        reason = stale_reason(folder, metadata)
        if reason is None:
            return result
        if folder.exists():
            say(f"rebuilding {folder}: {reason}")
        hooks, graphs = loaded.spec.hooks, graph_set(loaded)
        with fp32_cpu_model(loaded.model) as model:
            wrappers = graphs.wrappers(model, hooks, use_cache)
            say(f"exporting {loaded.name} to ONNX: {graphs.encoder_role}, cross-attention cache generator and "
                f"decoder ({'with' if use_cache else 'without'} KV cache) ...")
            started = time.perf_counter()

            def build(tmp: Path) -> None:
                with torch.no_grad():
                    examples = graphs.examples(model, hooks, use_cache)
                for graph in GRAPHS:
                    if graph != "decoder" and _copy_from_sibling(loaded, use_cache, working_dir, graph, tmp):
                        continue
                    args, dynamic = examples[graph]
                    trace_to_onnx(wrappers[graph], args, dynamic, names[graph], tmp / f"{graph}.onnx", model,
                                  f"{loaded.name} ({graph})")
                    say(f"  {graph}.onnx exported ({time.perf_counter() - started:.1f} s)")

            build_dir_artifact(folder, build, metadata)
        say(f"exported in {time.perf_counter() - started:.1f} s to {folder}")
        return result
