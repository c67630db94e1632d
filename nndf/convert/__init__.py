"""Convert encoder models (transformer-deploy's convert_model): ONNX Runtime, TensorRT, checks, benchmarks, Triton."""
