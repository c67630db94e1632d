"""A disk that refuses what a command writes (full, over quota, read-only, another user's folder): one sentence
naming the folder, exit 1, nothing half-written kept (nndf.errors.storage_sentence)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from test_cli import run_cli


@pytest.mark.parametrize("code, named, said", [
    (errno.ENOSPC, True, "no space left on device in {work}; nothing half-written was kept: free some space or write "
                         "elsewhere"),
    (errno.ENOSPC, False, "no space left on device in {work}; nothing half-written was kept"),
    (errno.EROFS, True, "read-only file system in {work}; nothing half-written was kept: write elsewhere"),
    (errno.EACCES, True, "permission denied in {work}: check its permissions, or for an output write elsewhere")])
def test_a_disk_that_refuses_the_export_is_one_sentence(capsys, monkeypatch, tiny_gpt2_dir, tmp_path, code, named,
                                                       said):
    """A full (or read-only) disk under --working-dir, -o or --json ended the run with the OSError's traceback from
    deep inside the ONNX save or a copy; now one sentence naming where, exit 1, and the half-written export gone.
    Where the failing write names no file (a file object's `write`, as ONNX's save meets a full disk), the folder
    being written is named."""
    import nndf.export.onnx as onnx_export

    def fill_the_disk(wrapper, args, dynamic, io, path, model, label):
        Path(path).write_bytes(b"half a graph")
        raise OSError(code, os.strerror(code), *[str(Path(path).parent / "decoder.onnx.data")] * named)

    monkeypatch.setattr(onnx_export, "trace_to_onnx", fill_the_disk)
    work = tmp_path / "work"
    result, _, err = run_cli(capsys, "export", "GPT2", "onnxrt", "--torch-dir", tiny_gpt2_dir, "--working-dir", work)
    assert result == 1
    assert err.splitlines()[-1].startswith("error: " + said.format(work=work)) and "Traceback" not in err
    assert list(work.iterdir()) == []


def test_a_full_disk_under_convert_is_said_as_the_disk_not_as_a_failed_export(minilm_dir, tmp_path, capsys,
                                                                               monkeypatch):
    """convert's exporter wraps any failure as "ONNX export failed: ..."; a full disk under its save is the disk's."""
    import torch

    from nndf.convert.cli import main as convert_model

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out" / "model.onnx"))

    monkeypatch.setattr(torch.onnx, "export", full)
    code = convert_model(["-m", str(minilm_dir), "--task", "embedding", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err.startswith(f"error: no space left on device in {tmp_path}"), err
