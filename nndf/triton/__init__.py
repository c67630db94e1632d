"""Triton Inference Server model repositories for exported encoder models (text in, embeddings or logits out).

`write_encoder_repository` lays out the three models that ELS-RD's transformer-deploy serves (tokenizer in
Triton's Python backend, the ONNX graph or TensorRT plan, and an ensemble chaining them); `validate_repository`
checks such a folder against Triton's own config schema before a server ever sees it.
"""

from nndf.triton.repository import model_names, write_encoder_repository
from nndf.triton.validate import validate_config, validate_repository

__all__ = ["model_names", "validate_config", "validate_repository", "write_encoder_repository"]
