"""Which nodes of an exported graph come from which PyTorch modules, read from the exporter's node metadata.

torch's dynamo exporter records on every node the module scopes it was traced in: `pkg.torch.onnx.name_scopes`
is a list of module paths, outermost first, ending with the op's own name (`['', 'encoder', 'encoder.block.0',
..., 'encoder.block.0.layer.1.DenseReluDense.wo', 'linear_5']`), and `namespace` says the same as one string
(`path: class/path: class/.../op: aten.op`). A family names modules whose layers must stay fp32 in fp16 builds
(`FamilyHooks.fp32_modules`, dotted suffixes such as T5's "DenseReluDense.wo"); `module_nodes` finds their nodes,
so that the TensorRT build can pin those layers (the ONNX parser names each layer after its node). Only the graph
is read, never its weights; nothing here needs TensorRT.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Sequence

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
NAMESPACE_KEY = "namespace"


def node_scopes(metadata: dict[str, str]) -> list[str]:
    """The module paths a node was traced in (outermost first, the op's own name left out), from its metadata."""
    if SCOPES_KEY in metadata:
        try:
            scopes = ast.literal_eval(metadata[SCOPES_KEY])
        except (ValueError, SyntaxError):
            scopes = []
        return [str(scope) for scope in scopes[:-1]]
    if NAMESPACE_KEY in metadata:
        return [part.split(": ", 1)[0] for part in metadata[NAMESPACE_KEY].split("/")[:-1]]
    return []


def in_modules(path: str, modules: Sequence[str]) -> bool:
    """Whether a module path is inside one of `modules`: names them as whole dotted parts, anywhere in the path
    ("encoder.block.0.layer.1.DenseReluDense.wo" is inside "DenseReluDense.wo" and inside "DenseReluDense")."""
    parts = path.split(".")
    for module in modules:
        wanted = module.split(".")
        if any(parts[i:i + len(wanted)] == wanted for i in range(len(parts) - len(wanted) + 1)):
            return True
    return False


def module_nodes(onnx_path: str | Path, modules: Sequence[str]) -> tuple[str, ...]:
    """Names of the graph's nodes traced inside any of `modules` (or inside a module below one of them)."""
    if not modules:
        return ()
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return tuple(
        node.name for node in graph.node
        if any(in_modules(scope, modules) for scope in node_scopes({p.key: p.value for p in node.metadata_props}))
    )
