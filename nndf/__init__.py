"""nndf: run Hugging Face generative models on PyTorch, ONNX Runtime and TensorRT with one decoding loop.

The public API: `nndf.load(...)` (one model on one backend, see `nndf.model`) and `nndf.run(ACTION, MODEL,
BACKEND..., **flags)` (any command-line action, its tables returned, see `nndf.api`); both are imported lazily so
that `import nndf` stays cheap.
"""

from __future__ import annotations

__all__ = ["load", "Model", "run"]


def __getattr__(name: str):
    if name == "run":
        from nndf.api import run

        return run
    if name in __all__:
        from nndf import model

        return getattr(model, name)
    raise AttributeError(f"module 'nndf' has no attribute {name!r}")
