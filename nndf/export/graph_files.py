"""The files an exported ONNX graph is made of: the graph itself and the external data files its weights live in
(what a copy of it must carry, and what it weighs on disk)."""

from __future__ import annotations

from pathlib import Path

from nndf.errors import UsageError


def external_data_files(onnx_file: Path) -> dict[str, Path]:
    """{location as the graph names it: file} for the files an ONNX graph keeps its weights in, read without loading
    the weights; a copy keeps their relative names so that the graph finds them."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    model = onnx.load(str(onnx_file), load_external_data=False)
    locations = {ExternalDataInfo(t).location for t in _get_all_tensors(model) if uses_external_data(t)}
    files = {}
    for location in sorted(locations):
        path = onnx_file.parent / location
        if not path.is_file() or ".." in Path(location).parts or Path(location).is_absolute():
            raise UsageError(f"{onnx_file} keeps weights in {location!r}, which is not a file beside it")
        files[location] = path
    return files


def graph_bytes(onnx_file: Path) -> int:
    """The graph's size on disk with its external data (three graphs sharing a folder each count their own)."""
    onnx_file = Path(onnx_file)
    return onnx_file.stat().st_size + sum(path.stat().st_size for path in external_data_files(onnx_file).values())
