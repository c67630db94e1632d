"""fp16 copies of exported graphs for ONNX Runtime on a GPU, with the layers that overflow fp16 kept in fp32.

ONNX Runtime has no fp16 build flag: the graph itself is converted, with its own converter
(`onnxruntime.transformers.float16.convert_float_to_float16`). T5's feed-forward output projection overflows
fp16's range (users of NVIDIA's demo see NaN outputs; transformers keeps the same module in fp32), so the nodes
traced inside a family's `fp32_modules` (found from the exporter's node metadata, `nndf.export.precision`) go on
the converter's node block list: they keep fp32 weights and run in fp32, with casts around them. Graph inputs and
outputs stay fp32 (`keep_io_types`), so the sessions, the KV caches and the loop are the same as in fp32.

The fp16 graph is a folder artifact like a quantized one: named from a hash of its source export, the block list
and the library versions, with metadata beside it, reused while all of that matches and rebuilt otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from nndf.errors import HarnessError
from nndf.export.onnx import derived_graph
from nndf.export.precision import module_nodes
from nndf.workspace import read_metadata

# Bump when a change here changes the graphs produced.
HALF_REVISION = 1


def fp16_settings(export, keep_fp32: Sequence[str]) -> dict:
    import onnx
    import onnxruntime

    return {"kind": "onnx-fp16", "source": export.folder.name, "graph": export.graph.name,
            "source_files": (read_metadata(export.folder) or {}).get("files"), "keep_fp32": list(keep_fp32),
            "versions": {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                         "half_revision": str(HALF_REVISION)}}


def fp16_graph(export, fp32_modules: Sequence[str], working_dir: str | Path) -> Path:
    """The fp16 graph (.onnx path) of `export`, the nodes of `fp32_modules` kept in fp32; reused or (re)built."""
    keep = module_nodes(export.graph, fp32_modules)  # may be none: a cache generator has no feed-forward layers
    settings = fp16_settings(export, keep)

    def build(path: Path) -> None:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = onnx.load(str(export.graph), load_external_data=True)
        try:
            half = convert_float_to_float16(model, keep_io_types=True, node_block_list=list(keep),
                                            disable_shape_infer=True)
        except Exception as exc:  # the converter raises many types; the user needs one sentence and the cause
            raise HarnessError(f"fp16 conversion of {export.graph} failed: {type(exc).__name__}: {exc}") from exc
        onnx.save_model(half, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data")

    return derived_graph(export, "fp16", settings, working_dir, build,
                         f"converting {export.graph} to fp16 ({len(keep)} nodes kept in fp32) ...")
