"""bench/graph_ab.py: decode speed of several graphs of one model, pooled over processes that load them in turned
orders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nndf
from conftest import REPO, load_bench


def test_graph_ab_pools_processes_that_load_the_graphs_in_turned_orders(family_dirs, onnx_work_dir, tmp_path,
                                                                        capsys):
    """bench/graph_ab.py --processes: each process reports its rounds, the report pools them with each graph's
    paired ratio to the first; a graph given twice is a usage error (a copy times a graph against itself)."""
    model = nndf.load("GPT2", backend="onnxrt", torch_dir=family_dirs["GPT2"], working_dir=onnx_work_dir)
    graph = Path(model.artifacts[0])
    copy = tmp_path / "copy"
    shutil.copytree(graph.parent, copy)
    script = REPO / "bench" / "graph_ab.py"
    common = ["--family", "GPT2", "--torch-dir", str(family_dirs["GPT2"]), "--working-dir", str(onnx_work_dir),
              "--rounds", "2", "--steps", "2", "--prompt-len", "4"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(script), str(graph), str(copy / graph.name), *common,
                           "--processes", "2"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["process 1", "process 2"]
    first, second = lines[2:4]
    assert "paired 1.000x (faster in 0 of 4 rounds)" in first and first.endswith(str(graph))
    assert "of 4 rounds" in second and second.endswith(str(copy / graph.name))
    with pytest.raises(SystemExit) as refused:
        load_bench("graph_ab").parse_args([str(graph), str(graph), *common])
    assert refused.value.code == 2 and "each graph may be given once" in capsys.readouterr().err
