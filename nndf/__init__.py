"""nndf: run Hugging Face generative models on PyTorch, ONNX Runtime and TensorRT with one decoding loop.

The public API: `nndf.load(...)` (one model on one backend, see `nndf.model`), `nndf.load_exported(DIR)` (the
onnxrt model a `run.py export ... -o DIR` wrote, without its weights: `nndf.export.standalone`) and
`nndf.run(ACTION, MODEL, BACKEND..., **flags)` (any command-line action, its tables returned, see `nndf.api`); all
are imported lazily so that `import nndf` stays cheap.
"""

from __future__ import annotations

__all__ = ["load", "load_exported", "Model", "run"]


def __getattr__(name: str):
    if name == "run":
        from nndf.api import run

        return run
    if name == "load_exported":  # a folder `run.py export ... -o DIR` wrote (nndf.export.standalone)
        from nndf.export.standalone import load_exported

        return load_exported
    if name in __all__:
        from nndf import model

        return getattr(model, name)
    raise AttributeError(f"module 'nndf' has no attribute {name!r}")
