"""The dynamo exporter's table of ATen -> ONNX functions, built once per process instead of once per graph.

`torch.onnx.export(..., dynamo=True)` starts every call by building an `ONNXRegistry` from torchlib: it walks every
ONNX Script function and inspects its signature, 2-3 s on this 2-core machine, which is a fifth to a third of a
small model's export and is repeated for every graph (an encoder-decoder export traces three, the test suite
about a hundred). The table depends only on the opset and on which libraries' operators exist, so the first one
built is kept, and each export gets a copy of its own (its lists copied: `register_op` inserts a custom
translation, such as the shared-buffer attention's, at the front of a list; the entries themselves are shared
and only cache what they compute).

This reaches into the exporter's private module (`torch.onnx._internal.exporter._registration`): where a torch
version lacks it, the export runs as torch ships it, only slower.
"""

from __future__ import annotations

import contextlib
import threading

_BUILT: dict[int, object] = {}  # opset -> the registry torchlib gave
_BUILD_LOCK = threading.Lock()
_LOCK = threading.Lock()  # guards the two below
_USERS = 0  # blocks inside `torchlib_registry_built_once`
_ORIGINAL = None  # torch's own `from_torchlib` while the cached one stands in


def _registration_module():
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        return None
    registry = getattr(_registration, "ONNXRegistry", None)
    constants = getattr(_registration, "_constants", None)
    if registry is None or not isinstance(vars(registry).get("from_torchlib"), classmethod) \
            or not isinstance(getattr(constants, "TORCHLIB_OPSET", None), int):
        return None  # not the exporter this was written against: torch's own builder stays
    return _registration


def _copy(registry):
    """A registry with the same entries whose lists are its own."""
    twin = object.__new__(type(registry))
    vars(twin).update(vars(registry))
    twin.functions = {target: list(entries) for target, entries in registry.functions.items()}
    return twin


@contextlib.contextmanager
def torchlib_registry_built_once():
    """Within the block, the exporter's `ONNXRegistry.from_torchlib(opset_version=N)` returns a copy of the one
    built first for N in this process. Blocks may overlap (exports in several threads): the first one in puts the
    cached builder in place, the last one out puts torch's back."""
    global _USERS, _ORIGINAL
    module = _registration_module()
    if module is None:
        yield
        return
    cls = module.ONNXRegistry
    with _LOCK:
        if _USERS == 0:
            _ORIGINAL = cls.__dict__["from_torchlib"]
            cls.from_torchlib = classmethod(_cached_builder(module, cls, _ORIGINAL.__func__))
        _USERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _USERS -= 1
            if _USERS == 0:
                cls.from_torchlib = _ORIGINAL


def _cached_builder(module, cls, build):
    def from_torchlib(klass, opset_version=None, **kwargs):
        opset = module._constants.TORCHLIB_OPSET if opset_version is None else opset_version
        if kwargs or klass is not cls:  # a call this cache does not know: torch's own build
            return build(klass, *(() if opset_version is None else (opset_version,)), **kwargs)
        with _BUILD_LOCK:
            if opset not in _BUILT:
                _BUILT[opset] = build(klass, opset)
            return _copy(_BUILT[opset])

    return from_torchlib
