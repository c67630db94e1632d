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


RUN_INSTEAD = "choose the frameworks or onnxrt backend"  # what a run can do here instead


def unavailable_reason(cuda_available: bool, tensorrt_installed: bool, instead: str = RUN_INSTEAD) -> str | None:
    """One sentence on why the trt backend cannot run here, or None when it can; `instead` says what the action
    can do on this machine instead (an action that runs nothing, such as `export`, has its own)."""
    if not cuda_available:
        return ("the trt backend needs an NVIDIA GPU with CUDA, and none is visible to PyTorch here; run it on a "
                f"GPU machine with a CUDA build of torch and {INSTALL_HINT}, or {instead}")
    if not tensorrt_installed:
        return ("the trt backend needs TensorRT and Polygraphy, which are not installed here; on this CUDA "
                "machine run " + INSTALL_HINT)
    return None


class TrtUnavailable(HarnessError):
    """The trt backend cannot run here (`unavailable_reason`). Raised where every action checks its backends
    (nndf.actions.common.open_models); an action whose alternative is not a run's rewords it with `instead`, so
    that generic code never asks which action it serves."""

    def __init__(self, cuda_available: bool, tensorrt_installed: bool) -> None:
        super().__init__(unavailable_reason(cuda_available, tensorrt_installed))
        self.cuda_available, self.tensorrt_installed = cuda_available, tensorrt_installed

    def instead(self, what: str) -> HarnessError:
        """The same refusal, ending in `what` the action can do on this machine instead."""
        return HarnessError(unavailable_reason(self.cuda_available, self.tensorrt_installed, what))


def check_available() -> None:
    """Raise a one-sentence TrtUnavailable unless a CUDA device is visible and TensorRT is installed.

    The device is checked first and TensorRT is only looked up (`find_spec` imports nothing), never imported here.
    """
    cuda = torch.cuda.is_available()
    installed = cuda and importlib.util.find_spec("tensorrt") is not None
    if unavailable_reason(cuda, installed) is not None:
        raise TrtUnavailable(cuda, installed)


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
