"""What a generative Triton model folder (`run.py triton`) runs: its `nndf.json` read and its model loaded from the
files beside it, a standalone folder (`nndf.export.standalone`) with serving settings added. Kept apart from
`generation_model.py` (which needs Triton's `triton_python_backend_utils`) so that a written folder can be loaded
and checked without a server."""

from __future__ import annotations

from pathlib import Path

from nndf.export.standalone import SETTINGS_FILE, load_exported, read_settings

__all__ = ["SETTINGS_FILE", "load_served"]


def load_served(version: str | Path, working_dir: str) -> tuple[dict, object]:
    """The folder's settings and its `nndf.Model`: the config, generation config and tokenizer in `hf/` (no
    weights), and each graph the model runs (the decoder's, and an encoder-decoder's encoder and cross-attention
    cache generator) given as a file to run, so nothing is exported or read from the hub (the target language,
    `run.py triton --tgt-lang`, included: `load_exported` reads it from the settings)."""
    return read_settings(version), load_exported(version, working_dir)
