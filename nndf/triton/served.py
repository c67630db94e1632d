"""What a generative Triton model folder (`run.py triton`) runs: its `nndf.json` read and its model loaded from the
files beside it. Kept apart from `generation_model.py` (which needs Triton's `triton_python_backend_utils`) so that
a written folder can be loaded and checked without a server."""

from __future__ import annotations

import json
from pathlib import Path

SETTINGS_FILE = "nndf.json"


def load_served(version: str | Path, working_dir: str) -> tuple[dict, object]:
    """The folder's settings and its `nndf.Model`: the config, generation config and tokenizer in `hf/` (no
    weights), and each graph the model runs (the decoder's, and an encoder-decoder's encoder and cross-attention
    cache generator) given as a file to run, so nothing is exported or read from the hub."""
    import nndf

    version = Path(version)
    settings = json.loads((version / SETTINGS_FILE).read_text())
    graphs = settings.get("graphs") or {"decoder_onnx": settings["graph"]}  # folders written before "graphs"
    model = nndf.load(settings["family"], settings["variant"], backend=settings["backend"],
                      torch_dir=str(version / "hf"), working_dir=working_dir, use_cache=settings["use_cache"],
                      threads=settings.get("threads"), device="cpu",
                      **{keyword: str(version / file) for keyword, file in graphs.items()})
    return settings, model
