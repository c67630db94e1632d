"""nndf: run Hugging Face generative models on PyTorch, ONNX Runtime and TensorRT with one decoding loop.

The public API is `nndf.load(...)` (see `nndf.model`); it is imported lazily so that `import nndf` stays cheap.
"""

from __future__ import annotations

__all__ = ["load", "Model"]


def __getattr__(name: str):
    if name in __all__:
        from nndf import model

        return getattr(model, name)
    raise AttributeError(f"module 'nndf' has no attribute {name!r}")
