"""A real Triton Inference Server for the tests, on this CPU machine, and the tiny encoder it serves.

The server is the `tritonserver` binary (core 2.51) that PyPI's nvidia-pytriton 0.7.0 ships with the Python backend
only. Models of platform `onnxruntime_onnx` load through a *Python-based backend* named `onnxruntime`: Triton looks
for `<backend-dir>/onnxruntime/model.py` when that backend has no shared library, and runs it with the Python
backend's stub. This very file is that model.py (the `TritonPythonModel` class at the bottom, which runs the graph
with CPU ONNX Runtime): the repository under test loads unchanged, as it would in NVIDIA's container.

pytriton pins numpy<2, and means it: its Python backend stub is built against numpy 1's ABI (under numpy 2 it
misreads string tensors and crashes). The project's environment has numpy 2, so the binary lives in its own venv
under ~/.cache, created once and reused: only numpy<2 and pytriton (without its client-side dependencies) are
installed there, and a .pth file appends this environment's site-packages, which lends it transformers, tokenizers
and onnxruntime (they import with numpy 1.26). A .pth rather than `--system-site-packages`, which would lend the
base interpreter's packages instead of this environment's when the tests run inside a venv.

Module-level imports are the standard library and numpy only, because the server imports this file too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import site
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

PYTRITON = "nvidia-pytriton==0.7.0"
NUMPY = "numpy<2"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
VENV = Path(os.environ.get("NNDF_TRITON_VENV", Path.home() / ".cache" / "nndf-triton-venv" /
                           f"py{PY}-{PYTRITON.replace('==', '-')}-numpy1"))


def convert_tiny_encoder(root: Path, max_batch: int, tokenizer_dir: Path) -> tuple[Path, Path, Path]:
    """(repository, served graph, tokenizer folder): a seeded 2-layer BERT over the real uncased BERT vocabulary
    (`tokenizer_dir`: all-MiniLM-L6-v2's, the conftest `minilm_dir`) with mean pooling, saved as a
    sentence-transformers model and converted by `convert_model --task embedding` itself, which writes the Triton
    repository (`output` [batch, 32] float32) and its graphs."""
    import torch
    from sentence_transformers import SentenceTransformer
    try:  # sentence-transformers 6.2 moved the module classes and deprecates the old path
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models
    from transformers import AutoModel, AutoTokenizer, BertConfig

    from nndf.convert.cli import main as convert_model

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512)
    AutoModel.from_config(config).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    SentenceTransformer(modules=[models.Transformer(str(root / "bert")), models.Pooling(32, "mean")],
                        device="cpu").save(str(root / "st"))
    repository = root / "models"
    code = convert_model(["-m", str(root / "st"), "--task", "embedding", "-o", str(repository), "-d", "cpu",
                          "-b", "1", "1", str(max_batch), "-s", "1", "16", "64", "--atol", "1e-4",
                          "--nb-measures", "1", "--warmup", "0"])
    assert code == 0, "convert_model failed"
    import onnx

    graph = repository / "model.onnx"
    # token_type_ids too where sentence-transformers passes them on to BERT: the tests read the graph's own list
    inputs = {i.name for i in onnx.load(str(graph), load_external_data=False).graph.input}
    assert {"input_ids", "attention_mask"} <= inputs
    return repository, graph, tokenizer_dir


def triton_venv() -> Path:
    """The venv holding pytriton's tritonserver, created on first use (pip: numpy 1.26 and pytriton's 55 MB wheel);
    pytest.skip with the reason when it cannot be created (offline without the wheels in pip's cache, no venv...)."""
    import fcntl

    import pytest

    VENV.parent.mkdir(parents=True, exist_ok=True)
    done = VENV / ".nndf-complete"
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers wait for the one that creates it
        if not done.exists():
            shutil.rmtree(VENV, ignore_errors=True)
            steps = [[sys.executable, "-m", "venv", str(VENV)],
                     [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", NUMPY, PYTRITON]]
            for step in steps:
                run = subprocess.run(step, capture_output=True, text=True)
                if run.returncode != 0:
                    shutil.rmtree(VENV, ignore_errors=True)
                    said = (run.stderr or run.stdout).strip().splitlines()[-1:]
                    pytest.skip(f"cannot create Triton's venv {VENV} (offline? `{' '.join(step[2:])}` said {said})")
            done.write_text(PYTRITON + "\n")
        # Written at every use, so that it follows the environment the tests run in. `site.addsitedir` rather than
        # bare paths: the parent's own .pth files run too, and an editable install of nndf (whose `nndf.models`
        # and `nndf.seq2seq` are mapped by a finder that a .pth file installs) imports there as it does here.
        parent = list(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]]))
        lines = [f"import site; site.addsitedir({path!r})" for path in parent]
        (_site_packages(VENV) / "nndf-parent-environment.pth").write_text("\n".join(lines) + "\n")
    return VENV


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{PY}" / "site-packages"


def backend_directory(venv: Path, root: Path) -> Path:
    """`<root>/backends`: pytriton's Python backend with the stub for this Python, and this file as the
    Python-based `onnxruntime` backend."""
    server = _site_packages(venv) / "pytriton" / "tritonserver"
    backends = root / "backends"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    stub = server / "python_backend_stubs" / PY / "triton_python_backend_stub"
    if not stub.is_file():
        import pytest

        pytest.skip(f"{PYTRITON} has no Python backend stub for Python {PY}")
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):  # copies: Triton refuses a backend
        (python / name).unlink(missing_ok=True)  # library whose real path is outside the backend directory
        shutil.copy2(server / "backends" / "python" / name, python / name)
    # A link for the stub: it finds pytriton's bundled libraries through an $ORIGIN-relative rpath.
    (python / stub.name).unlink(missing_ok=True)
    (python / stub.name).symlink_to(stub)
    (backends / "onnxruntime").mkdir(exist_ok=True)
    shutil.copy2(__file__, backends / "onnxruntime" / "model.py")
    return backends


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(venv: Path) -> dict[str, str]:
    """The binary's stub links libpython (Python's LIBDIR on the loader path); the venv's python first on PATH is
    how the embedded interpreter finds the venv (and so pytriton's files and the system site-packages)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (sysconfig.get_config_var("LIBDIR"),
                                                         env.get("LD_LIBRARY_PATH")) if p)
    return env


@contextlib.contextmanager
def triton_server(repository: Path, root: Path, timeout: float = 60.0, extra_args: tuple[str, ...] = ()):
    """Start tritonserver on 127.0.0.1 and free ports, yield {"http": url, "grpc": url, "log": path, "process":
    Popen} once every model is ready, and stop it (terminate, wait, kill) however the body ends (a body that kills
    it itself is fine)."""
    import tritonclient.http as http

    venv = triton_venv()
    binary = _site_packages(venv) / "pytriton" / "tritonserver" / "bin" / "tritonserver"
    ports = {"http": _free_port(), "grpc": _free_port()}
    log = root / "tritonserver.log"
    cmd = [str(binary), f"--model-repository={repository}", f"--backend-directory={backend_directory(venv, root)}",
           "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", f"--http-port={ports['http']}",
           f"--grpc-port={ports['grpc']}", "--allow-metrics=false", "--exit-on-error=true",
           "--strict-readiness=true", "--exit-timeout-secs=2", *extra_args]
    urls = {"http": f"127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['grpc']}", "log": log}
    with open(log, "w") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=_environment(venv))
    urls["process"] = process
    try:
        client = http.InferenceServerClient(urls["http"])
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(Exception):
                if client.is_server_ready():
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver not ready after {timeout:.0f} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        client.close()
        yield urls
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _kill_stubs(root / "backends")


def _kill_stubs(backends: Path) -> None:
    """Kill the Python backend's stub processes of this server that outlived it: a server stopped normally ends
    them, but after a SIGKILL (tests/test_triton_serving.py) they stay, each holding a model, until the machine
    restarts. They are found by the backend directory in their command line."""
    import signal

    marker = str(backends).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)


class TritonPythonModel:
    """The Python-based `onnxruntime` backend (this file copied as `<backend-dir>/onnxruntime/model.py`): runs the
    version folder's ONNX graph with CPU ONNX Runtime, one session per instance, one run per request."""

    def initialize(self, args):
        import onnxruntime

        config = json.loads(args["model_config"])
        filename = config.get("default_model_filename") or "model.onnx"
        path = Path(args["model_repository"]) / args["model_version"] / filename
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = [tensor["name"] for tensor in config["input"]]
        self.outputs = [tensor["name"] for tensor in config["output"]]

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            try:
                feeds = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.inputs}
                results = self.session.run(self.outputs, feeds)
                tensors = [pb_utils.Tensor(n, np.ascontiguousarray(r)) for n, r in zip(self.outputs, results)]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # noqa: BLE001 - an error response, not a dead instance
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
