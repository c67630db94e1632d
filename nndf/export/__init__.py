"""Turning PyTorch models into graphs: the flat-tensor wrapper shared by the frameworks backend and ONNX export."""
