"""The main process's side of the CPU peers: what start_engine calls for llamacpp-* and genai* before it starts
their workers (a Bench's `setups`). Each returns the worker's python and its extra arguments (the tool and model
files), or raises EngineError with the one-line reason the peer's rows then show; the rest of the run goes on.

Everything is built once and kept in the working dir, keyed on the weights (name, sizes, times) and the tool's
version: llama.cpp's tree and build (`DIR/llama.cpp/`), its GGUF files (`DIR/bench-gguf/`), ONNX Runtime GenAI's
venv (`DIR/genai-venv/`) and its builds (`DIR/bench-genai/`). A failed build is remembered for the rest of the run,
so three llama.cpp rows do not try a missing cmake three times (keyed on what was built: the build, the venv, each
weights folder's conversion).
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness import genai, llamacpp
from harness.engines import EngineError, folder_signature, say, short_hash, venv_environment
from harness.peer_weights import PeerWeightsError, peer_weights
from harness.worker import versions

_FAILED: dict[str, str] = {}  # what failed once in this run -> why


def _once(what: str, make):
    """make(), or the EngineError it raised the first time `what` was tried in this run."""
    if what in _FAILED:
        raise EngineError(_FAILED[what])
    try:
        return make()
    except (llamacpp.LlamaCppError, PeerWeightsError, RuntimeError, EngineError, OSError) as exc:
        _FAILED[what] = str(exc)
        raise EngineError(str(exc)) from None


def llamacpp_setup(engine: str, args, weights: Path, working_dir: Path, logs: Path, env_info: dict):
    """llama.cpp's tools (built on first use) and the engine's GGUF file; the worker runs under the main python."""
    root = working_dir / "llama.cpp"
    source = _once("llama.cpp build", lambda: llamacpp.build(root, logs / "llamacpp-build.log", say))
    folder = _once("peer weights", lambda: peer_weights(weights, working_dir))
    key = short_hash([str(weights), folder_signature(weights), llamacpp.SDIST])
    out_dir = working_dir / "bench-gguf" / f"{weights.name}-{key}"
    convert_log = logs / f"{engine}-convert.log"
    model = _once(f"{engine} {out_dir}", lambda: llamacpp.gguf(engine, source, folder, out_dir, convert_log, say))
    env_info["llama.cpp"] = {"sdist": "==".join(llamacpp.SDIST), "cmake": " ".join(llamacpp.cmake_flags()),
                             "tool": "llama-batched-bench"}
    return sys.executable, ["--peer-tool", str(source / "build" / "bin" / "llama-batched-bench"),
                            "--peer-model", str(model)]


def genai_setup(engine: str, args, weights: Path, working_dir: Path, logs: Path, env_info: dict):
    """ONNX Runtime GenAI's venv (made on first use) and the engine's build of the weights by its model builder;
    weights it is known to refuse are refused first (`genai.known_refusal`)."""
    refusal = genai.known_refusal(weights)
    if refusal is not None:
        raise EngineError(refusal)
    reqs = genai.requirements(versions(["onnxruntime", "transformers"]))
    python, found = _once("genai venv", lambda: venv_environment(
        working_dir / "genai-venv", logs / "genai-venv-setup.log", reqs, "onnxruntime_genai, onnx_ir, transformers",
        genai.PACKAGES))
    env_info["genai"] = {"python": str(python), "requirements": reqs, "versions": found}
    folder = _once("peer weights", lambda: peer_weights(weights, working_dir))
    precision = genai.ENGINES[engine]
    key = short_hash([str(weights), folder_signature(weights), found.get("onnxruntime-genai")])
    out = working_dir / "bench-genai" / f"{weights.name}-{key}" / precision
    out.parent.mkdir(parents=True, exist_ok=True)
    if not (out / "genai_config.json").is_file():
        say(f"{engine}: building with the ONNX Runtime GenAI model builder (-p {precision}) ...")
    build_log = logs / f"{engine}-build.log"
    built = _once(f"genai {out}", lambda: genai.build(str(python), folder, out, precision, build_log))
    return python, ["--peer-model", str(built)]


SETUPS = {**{e: llamacpp_setup for e in llamacpp.ENGINES}, **{e: genai_setup for e in genai.ENGINES}}
