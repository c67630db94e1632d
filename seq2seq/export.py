"""An encoder-decoder model -> three ONNX graphs in one folder artifact, as the decoder-only export does for one.

`encoder.onnx`, `cross.onnx` (the cross-attention cache generator) and `decoder.onnx` are the three wrappers of
`nndf.seq2seq.wrappers` traced by the same exporter as decoder-only graphs (dynamo, eager attention, weights in an
external data file per graph), with named dynamic dimensions shared by every input: batch, encoder_sequence,
sequence (new decoder tokens), past_sequence and kept (logits to keep). The folder is named from a hash of every
setting that shaped it and carries the same metadata (settings, library versions, each graph's input and output
names, every file's size), so a stale, foreign or truncated export is rebuilt with the reason, never reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nndf.export.onnx import DecoderExport, export_settings, fp32_cpu_model, say, trace_to_onnx
from nndf.loading import LoadedModel
from nndf.seq2seq.wrappers import CrossCacheWrapper, DecoderWrapper, EncoderWrapper, graph_io
from nndf.workspace import artifact_name, build_dir_artifact, stale_reason

GRAPHS = ("encoder", "cross", "decoder")
ROLES = {"encoder": "encoder", "cross": "cross-attention cache generator", "decoder": "decoder"}  # in messages


@dataclass(frozen=True)
class Seq2SeqExport:
    """The folder of the three graphs; `graphs[name]` is each one's file and names (as for a decoder export)."""

    folder: Path
    graphs: dict[str, DecoderExport]


def seq2seq_io(loaded: LoadedModel, use_cache: bool) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Every graph's (inputs, outputs), known without loading the weights."""
    return graph_io(loaded.spec.hooks.num_layers(loaded.config), use_cache)


def _dims(positions: int, use_cache: bool) -> dict:
    """Named dimensions with ranges that keep every length within the model's positions (tracing facts only)."""
    from torch.export import Dim

    new_max = max(positions // 2, 3) if use_cache else positions
    return {"batch": Dim("batch"), "encoder_sequence": Dim("encoder_sequence", max=max(positions, 5)),
            "sequence": Dim("sequence", max=new_max), "kept": Dim("kept", max=new_max),
            "past_sequence": Dim("past_sequence", max=max(positions - new_max, 4))}


def _examples(model, hooks, use_cache: bool) -> dict[str, tuple[tuple, dict]]:
    """Example inputs (batch 2, 5 encoder tokens, 3 new decoder tokens, 4 past) and dynamic shapes per graph."""
    config = model.config
    layers, heads, head_dim = hooks.num_layers(config), hooks.kv_heads(config), hooks.head_dim(config)
    d = _dims(hooks.max_positions(config), use_cache)
    batch, enc, new, past = 2, 5, 3, 4 if use_cache else 0
    ids = torch.randint(0, int(config.vocab_size), (batch, enc))
    mask = torch.ones(batch, enc, dtype=torch.long)
    hidden = EncoderWrapper(model)(ids, mask)[0].detach()
    cross = [torch.randn(batch, heads, enc, head_dim) for _ in range(2 * layers)]
    pasts = [torch.randn(batch, heads, past, head_dim) for _ in range(2 * layers)] if use_cache else []
    seq = {0: d["batch"], 1: d["encoder_sequence"]}
    rest = tuple([{0: d["batch"], 2: d["encoder_sequence"]}] * len(cross) + [{0: d["batch"], 2: d["past_sequence"]}] * len(pasts))
    decoder_args = (torch.randint(0, int(config.vocab_size), (batch, new)), mask, torch.arange(new), *cross, *pasts)
    return {
        "encoder": ((ids, mask), {"input_ids": seq, "attention_mask": seq}),
        "cross": ((hidden,), {"encoder_hidden_states": seq}),
        "decoder": (decoder_args, {"input_ids": {0: d["batch"], 1: d["sequence"]}, "encoder_attention_mask": seq,
                                   "logits_to_keep": {0: d["kept"]}, "rest": rest}),
    }


def export_seq2seq(loaded: LoadedModel, use_cache: bool, working_dir: str | Path) -> Seq2SeqExport:
    """The three exported graphs for these settings: reused when the metadata matches, else (re)built."""
    settings = dict(export_settings(loaded, use_cache), kind="onnx-seq2seq")
    folder = Path(working_dir) / artifact_name(f"{loaded.spec.family}-{loaded.variant.name}-seq2seq", settings, "")
    io = seq2seq_io(loaded, use_cache)
    names = {graph: {"input_names": list(i), "output_names": list(o)} for graph, (i, o) in io.items()}
    result = Seq2SeqExport(folder, {graph: DecoderExport(folder, i, o, f"{graph}.onnx") for graph, (i, o) in io.items()})
    metadata = dict(settings, graphs=names)
    reason = stale_reason(folder, metadata)
    if reason is None:
        return result
    if folder.exists():
        say(f"rebuilding {folder}: {reason}")
    hooks = loaded.spec.hooks
    model = fp32_cpu_model(loaded.model)
    layers = hooks.num_layers(model.config)
    wrappers = {"encoder": EncoderWrapper(model), "cross": CrossCacheWrapper(model, layers),
                "decoder": DecoderWrapper(model, layers, use_cache)}
    say(f"exporting {loaded.variant.name} to ONNX: encoder, cross-attention cache generator and decoder "
        f"({'with' if use_cache else 'without'} KV cache) ...")
    started = time.perf_counter()

    def build(tmp: Path) -> None:
        with torch.no_grad():
            examples = _examples(model, hooks, use_cache)
        for graph in GRAPHS:
            args, dynamic = examples[graph]
            if "rest" in dynamic:
                dynamic = dict(dynamic, rest=dynamic["rest"])
            trace_to_onnx(wrappers[graph], args, dynamic, names[graph], tmp / f"{graph}.onnx", model,
                          f"{loaded.variant.name} ({graph})")
            say(f"  {graph}.onnx exported ({time.perf_counter() - started:.1f} s)")

    build_dir_artifact(folder, build, metadata)
    say(f"exported in {time.perf_counter() - started:.1f} s to {folder}")
    return result
