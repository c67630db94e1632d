"""A model's ONNX graphs as a folder of their own, run later without the PyTorch weights or the hub, as Optimum's
`save_pretrained` / `ORTModel.from_pretrained` do: `run.py export ... -o DIR` writes it, `nndf.load_exported(DIR)`
runs it, and a Triton generation model (`nndf.triton.generative`) is the same folder with its serving files.

    DIR/nndf.json       family, variant, backend, graphs (nndf.load keyword -> file), use_cache, threads, and
                        the target language's forced first token (mBART-50's --tgt-lang)
    DIR/hf/             the model's config, generation config and tokenizer (an image model's processor; no weights)
    DIR/decoder/...     the decoder graph the onnxrt backend runs (fp32, int8 or int4), its external data beside it
    DIR/encoder/, cross/  the encoder (BLIP's vision encoder) and cross-attention cache generator graphs of an
                        encoder-decoder or image-to-text model
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from nndf.errors import UsageError
from nndf.export.graph_files import external_data_files
from nndf.paths import holds_other_files

SETTINGS_FILE = "nndf.json"


def standalone_files(model, scratch: Path) -> tuple[dict[str, Path], dict]:
    """What the folder holds for `model` (an `nndf.Model` on onnxrt, its graphs built): relative path -> source
    file (`hf/` written into `scratch`), and the settings `nndf.json` records."""
    from nndf.backends.onnxrt import SEQ2SEQ_OVERRIDES  # graph -> the nndf.load keyword that runs a given file

    if model.backend != "onnxrt":
        raise UsageError(f"a standalone folder holds the onnxrt backend's graphs; {model.backend}'s "
                         + ("engines are tied to the GPU they were built on" if model.backend == "trt" else
                            "model is the PyTorch checkpoint itself"))
    files, graphs = {}, {}
    for role, session in model.decoder.graphs.items():  # each in a folder of its own, with its external data
        graph = Path(session.artifacts[0])
        files[f"{role}/{graph.name}"] = graph
        files.update({f"{role}/{rel}": path for rel, path in external_data_files(graph).items()})
        graphs[SEQ2SEQ_OVERRIDES[role]] = f"{role}/{graph.name}"
    hf = Path(scratch) / "hf"
    model.loaded.config.save_pretrained(hf)
    # the loaded model's generation config, read without its weights (a reused export loads none)
    model.loaded.generation_config.save_pretrained(hf)
    # an image-to-text model's processor holds its image settings too (and saves its tokenizer with them)
    (model.processor if model.architecture.takes_images else model.tokenizer).save_pretrained(hf)
    files.update({f"hf/{f.name}": f for f in hf.iterdir()})
    settings = {"family": model.spec.family, "variant": model.variant.name, "backend": model.backend,
                "graph": graphs["decoder_onnx"], "graphs": graphs, "use_cache": model.settings.use_cache,
                "threads": model.options.threads,
                # the target language (--tgt-lang, tgt_lang=) is the Model's: no graph or config file holds it
                "forced_bos_token_id": model.forced_bos_token_id}
    return files, settings


def copy_files(files: dict[str, Path], folder: Path, same_as: Path | None = None) -> None:
    """Each source file to its relative path under `folder` (a standalone folder's, a Triton model version's).

    `same_as`: a folder written from the same `files` just before (a Triton model's streaming twin): each file is a
    hard link to its copy there, so the graph's weights are on disk once (626 MB twice for GPT-2 otherwise); a
    later rewrite of either folder makes new files and leaves the other's alone. Copied where linking fails."""
    for relative, source in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        if same_as is None or not _linked(same_as / relative, folder / relative):
            shutil.copyfile(source, folder / relative)


def _linked(existing: Path, link: Path) -> bool:
    """Whether `link` could be made a hard link to `existing` (not on a file system without them, nor when
    `existing` is not a file)."""
    if not existing.is_file():
        return False
    try:
        os.link(existing, link)
    except OSError:
        return False
    return True


def check_replaceable(flag: str, folder: str | Path) -> None:
    """`folder` may be new, empty, or a standalone folder written before (it is replaced as a whole), but not a
    folder of something else, which replacing would delete."""
    folder = Path(folder)
    if holds_other_files(folder, SETTINGS_FILE):
        raise UsageError(f"{flag} {folder} is a folder of other files, which writing the export there would replace: "
                         "give a new or empty folder (a folder an export wrote is replaced)")


def write_standalone(model, folder: str | Path) -> Path:
    """The standalone folder of `model` at `folder`, built beside it and renamed in (a failure leaves the old one,
    or nothing)."""
    import tempfile

    from nndf.progress import say
    from nndf.workspace import locked_atomic_dir

    folder = Path(folder)
    check_replaceable("-o/--output", folder)
    with tempfile.TemporaryDirectory() as scratch, locked_atomic_dir(folder, say) as tmp:
        files, settings = standalone_files(model, Path(scratch))
        copy_files(files, tmp)
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
    return folder


def read_settings(folder: str | Path) -> dict:
    """`nndf.json` of a standalone folder, or one sentence saying the folder is not one."""
    path = Path(folder) / SETTINGS_FILE
    if not path.is_file():
        raise UsageError(f"{folder} holds no {SETTINGS_FILE}: give a folder that `run.py export ... -o DIR` (or "
                         "`run.py triton`, its version folder) wrote")
    return json.loads(path.read_text())


def load_exported(folder: str | Path, working_dir: str | None = None, threads: int | None = None):
    """The `nndf.Model` of a standalone folder: its graphs run as given files (nothing exported, no weights read,
    no hub), with the config, generation config and tokenizer of `hf/`. `threads`: ONNX Runtime's intra-op threads
    (default: those recorded at export, else its own)."""
    from nndf.model import load

    folder = Path(folder)
    settings = read_settings(folder)
    graphs = settings.get("graphs") or {"decoder_onnx": settings["graph"]}  # folders written before "graphs"
    model = load(settings["family"], settings["variant"], backend=settings["backend"], torch_dir=str(folder / "hf"),
                 working_dir=working_dir or str(folder), use_cache=settings["use_cache"],
                 threads=threads if threads is not None else settings.get("threads"), device="cpu",
                 **{keyword: str(folder / file) for keyword, file in graphs.items()})

    def no_weights():
        raise UsageError(f"{folder} is an exported folder: it holds the graphs, not the PyTorch weights that this "
                         "needs (hf_generate, a fidelity check, a new export); nndf.load(..., torch_dir=CHECKPOINT) "
                         "has them")

    model.loaded.loader = no_weights  # else `hf/`'s missing weight file is the message
    model.forced_bos_token_id = settings.get("forced_bos_token_id")
    return model
