"""`export`: build (or verify and reuse) every artifact the given backends run, and say which and where they are."""

from __future__ import annotations

import time
from pathlib import Path

from nndf.actions.common import describe, label, open_models
from nndf.actions.export_command import onnx_export_command
from nndf.backends import split_backend
from nndf.errors import UsageError
from nndf.export.graph_files import graph_bytes
from nndf.measure import format_bytes
from nndf.export.standalone import check_replaceable
from nndf.paths import check_output_folder
from nndf.registry import resolve
from nndf.results import Column, Result
from nndf.workspace import metadata_path


# Flags that shape an export only through TensorRT's profiles (onnxrt's graphs take any batch and length); the
# flags that shape nothing but engines are refused without trt for every action (nndf.cli.ENGINE_ONLY_FLAGS)
ENGINE_FLAGS = ("batch_size", "num_beams", "input_seq_len", "output_seq_len")
BACKENDS_HELP = ("the backends whose graphs and engines to build: onnxrt, onnxrt-int8, onnxrt-int4 and/or trt "
                 "(frameworks runs the PyTorch model and has nothing to export)")
UNUSED_FLAGS = {  # nndf.cli.check_unused_flags
    "use_mask": "the graphs take an attention mask whether or not a run feeds one; give it to the run",
    "tgt_lang": "the target language is a forced first token of a generation, not part of any graph or engine",
    "seed": "it draws nothing at random (--weights-seed seeds --random-weights)",
}
STATUS_NOTE = ("status: built (by this command, or by another process it waited for), reused (found built with "
               "these settings and its files at their recorded sizes; their bytes are not read) or given (a file "
               "named by a flag, used as it is).")


def add_arguments(parser) -> None:
    """The build flags say what to export; -o also copies it into a folder of its own."""
    parser.add_argument("-o", "--output", metavar="DIR",
                        help="also write the onnxrt model as a standalone folder (graphs with their weights, config, "
                             "tokenizer; no PyTorch checkpoint) that nndf.load_exported(DIR) runs anywhere: the role of "
                             "Optimum's save_pretrained, in this harness's layout (Optimum's ORTModel does not read "
                             "it)")
    parser.set_defaults(engine_flag_defaults={dest: parser.get_default(dest) for dest in ENGINE_FLAGS})


def run(args) -> list[Result]:
    kinds = {split_backend(name)[0] for name in args.backends}
    if kinds == {"frameworks"}:  # before the (slow) load
        raise UsageError("export builds the ONNX graphs and engines of onnxrt and trt; frameworks runs the PyTorch "
                         "model itself and has nothing to export: name onnxrt or trt")
    changed = [dest for dest, default in args.engine_flag_defaults.items() if getattr(args, dest) != default]
    if changed and "trt" not in kinds:
        raise UsageError(f"--{changed[0].replace('_', '-')} shapes TensorRT engines (their profiles); the ONNX graphs "
                         "of onnxrt take any batch and length, so without trt it changes nothing: name trt or drop it")
    if args.output is not None:
        if kinds != {"onnxrt"} or len(args.backends) != 1:
            raise UsageError("-o writes one onnxrt model (onnxrt, onnxrt-int8 or onnxrt-int4) as a folder: name that "
                             "one backend (trt engines are tied to the GPU they were built on)")
        check_output_folder("-o/--output", args.output, into=True)
        check_replaceable("-o/--output", args.output)
    started = time.time_ns()
    models = _open(args, needs_text=args.output is not None)  # -o saves the tokenizer: a missing one said first
    rows = []
    for model in models:
        files = model.artifacts or [None]
        for artifact in files:
            size = _size(Path(artifact)) if artifact else None
            rows.append({"backend": label(model), "artifact": artifact or "(runs the PyTorch model; nothing to export)",
                         "status": _status(Path(artifact), started) if artifact else "-",
                         "size": format_bytes(size) if size else "-", "bytes": size})
    columns = [Column("backend", "backend"), Column("artifact", "artifact"), Column("status", "status"),
               Column("size", "size")]
    first = models[0]
    notes = ["Artifacts are reused only when their metadata matches these settings, library versions and weights.",
             STATUS_NOTE,
             "size: an ONNX graph's with its external data (the weights beside it), an engine's file (bytes: the "
             "same in bytes, in --json)."]
    if args.output is not None:
        from nndf.export.standalone import write_standalone

        folder = write_standalone(first, args.output)
        notes.append(f"standalone folder: {folder} (graphs with their weights, config, generation config and "
                     f"tokenizer; no PyTorch checkpoint): nndf.load_exported({str(folder)!r}) runs it without the "
                     "PyTorch model or the hub.")
    return [Result("export", f"export {first.spec.family} {first.loaded.name}", columns, rows, describe(*models), notes)]


def _open(args, needs_text: bool) -> list:
    """`open_models`, which builds or reuses every artifact. Where the trt backend cannot run, its refusal ends in
    what export can do here instead of a run's alternatives: the ONNX files a TensorRT build reads."""
    from nndf.backends.trt.availability import TrtUnavailable

    try:
        return open_models(args, needs_text=needs_text)
    except TrtUnavailable as exc:
        spec, _ = resolve(args.model, args.variant)
        raise exc.instead(f"export the ONNX files that a TensorRT build reads, on any machine, with the onnxrt "
                          f"backend: {onnx_export_command(args, spec)}") from None


def _status(artifact: Path, started_ns: int) -> str:
    """built, reused or given: an artifact's metadata file is written last, after its build, and never on reuse
    (a folder artifact's metadata sits beside the folder, its graphs inside it)."""
    for candidate in (artifact, artifact.parent):
        meta = metadata_path(candidate)
        if meta.is_file():
            return "built" if meta.stat().st_mtime_ns >= started_ns else "reused"
    return "given"


def _size(artifact: Path) -> int:
    """What one artifact weighs on disk: an encoder-decoder's three graphs share a folder, each counting its own."""
    return graph_bytes(artifact) if artifact.suffix == ".onnx" else artifact.stat().st_size
