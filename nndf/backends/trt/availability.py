"""Whether the trt backend can run here, and the first touch of TensorRT and the CUDA device.

Only an NVIDIA GPU runs the backend. No module of the package imports TensorRT or any CUDA library at import time:
`check_available` looks for a CUDA device through PyTorch first (creating a `trt.Runtime` without a GPU can crash
the process) and only then is `tensorrt` imported, through `_tensorrt()`, by the code that needs it.
"""

from __future__ import annotations

import importlib.util

import torch

from nndf.errors import HarnessError

INSTALL_HINT = "pip install -e '.[tensorrt]' (or pip install tensorrt polygraphy)"


def unavailable_reason(cuda_available: bool, tensorrt_installed: bool) -> str | None:
    """One sentence on why the trt backend cannot run here, or None when it can."""
    if not cuda_available:
        return ("the trt backend needs an NVIDIA GPU with CUDA, and none is visible to PyTorch here; run it on a "
                "GPU machine with a CUDA build of torch and " + INSTALL_HINT + ", or choose the frameworks or "
                "onnxrt backend")
    if not tensorrt_installed:
        return ("the trt backend needs TensorRT and Polygraphy, which are not installed here; on this CUDA "
                "machine run " + INSTALL_HINT)
    return None


def check_available() -> None:
    """Raise a one-sentence HarnessError unless a CUDA device is visible and TensorRT is installed.

    The device is checked first and TensorRT is only looked up (`find_spec` imports nothing), never imported here.
    """
    cuda = torch.cuda.is_available()
    installed = cuda and importlib.util.find_spec("tensorrt") is not None
    reason = unavailable_reason(cuda, installed)
    if reason is not None:
        raise HarnessError(reason)


def _tensorrt():
    """The tensorrt module; call only after `check_available`."""
    import tensorrt

    return tensorrt


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _device_info(trt, device: torch.device):
    from nndf.export.engine_cache import DeviceInfo

    major, minor = torch.cuda.get_device_capability(device)
    return DeviceInfo(str(trt.__version__), torch.cuda.get_device_name(device), f"{major}.{minor}")


def _free_gpu_memory(device: torch.device) -> int | None:
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
