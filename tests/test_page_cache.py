"""Graph files we write (a folder artifact) or read whole (the source of a derived graph) leave the page cache, so
that the session a first run opens maps them as every later run does (nndf.page_cache). Residency is read with
mincore(2) on a mapping of the file, which faults nothing in."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save_model

from nndf.export.onnx import DecoderExport, derived_graph
from nndf.page_cache import drop_from_page_cache
from nndf.workspace import build_dir_artifact

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page-cache advice is Linux's")
SIZE = 8 * 2**20


def resident_share(path: Path) -> float:
    """The share of the file's pages that are in the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: writable for ctypes, file unchanged
        try:
            window = (ctypes.c_char * size).from_buffer(view)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(ctypes.addressof(window), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            del window
        finally:
            view.close()
    return sum(byte & 1 for byte in vec.raw) / pages


def _written(path: Path) -> Path:
    path.write_bytes(os.urandom(SIZE))
    return path


@pytest.fixture
def drops_here(tmp_path):
    """Skip where the file system does not cache what is written, or keeps its pages whatever we advise (tmpfs):
    nothing to check there."""
    control = _written(tmp_path / "control")
    cached = resident_share(control)
    drop_from_page_cache([control])
    if cached < 0.9 or resident_share(control) > 0.1:
        pytest.skip(f"{tmp_path}'s file system does not cache written files, or keeps them whatever we advise")
    return tmp_path


def test_a_built_folder_artifact_is_written_out_and_not_left_in_the_page_cache(drops_here):
    folder = build_dir_artifact(drops_here / "artifact", lambda tmp: _written(tmp / "graph.onnx.data"), {"k": 1})
    assert (folder / "graph.onnx.data").stat().st_size == SIZE
    assert resident_share(folder / "graph.onnx.data") < 0.1


def test_a_derived_graph_leaves_its_source_out_of_the_page_cache(drops_here):
    """The source graph and its external data, read whole by the build (as a quantizer's `onnx.load` reads them)."""
    source = drops_here / "source"
    source.mkdir()
    weights = numpy_helper.from_array(np.frombuffer(os.urandom(SIZE), np.float32).reshape(-1, 1024), "w")
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weights])
    save_model(helper.make_model(graph, ir_version=10), source / "decoder.onnx", save_as_external_data=True,
               location="decoder.onnx.data", size_threshold=0)
    export = DecoderExport(source, ("x",), ("y",))

    def build(out: Path) -> None:
        for path in source.iterdir():
            path.read_bytes()
        assert resident_share(source / "decoder.onnx.data") > 0.9  # the read left it cached
        out.write_bytes(b"a derived graph")

    derived_graph(export, "copy", {"kind": "test-derived"}, drops_here, build, "deriving a test graph")
    assert resident_share(source / "decoder.onnx.data") < 0.1
