"""ONNX Runtime GenAI as a peer engine: its own virtual environment from PyPI, its own model builder on the bench's
weights, its own generator loop, timed as our loop is timed.

Why these pieces:
- Its own venv (`DIR/genai-venv`), like Optimum's: onnxruntime-genai's builder wants onnx-ir, torch and transformers
  of its own choosing, and none of that may change the main environment. onnxruntime is pinned to the main
  environment's version, so that both ONNX Runtime engines run the same runtime and differ only in their graphs
  and loops; torch to the CPU build on this machine's disk.
- `python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32|int4 -e cpu`, once per weights and precision
  (its defaults: GroupQueryAttention on one KV buffer of the build's length shared by past and present, MatMulNBits
  for int4), into `DIR/bench-genai/`. The builder knows Llama-class models only: on GPT-2 it refuses, and the row
  says so.
- The runner feeds our very prompts (the same random ids) and reads a tick after each `generate_next_token()`, the
  call that picks a token and, from the second on, first runs the model for the previous one: so the first tick is
  prefill + first token, and the gaps are decode steps, as in our loop. `min_length = max_length` keeps EOS from
  ending a generation early. Its tokens are compared with hf's like ours.

Standard library only at import time: the worker imports onnxruntime_genai and numpy inside its venv.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

from harness.engines import run_logged

GENAI_VERSION = "0.18.0"
ENGINES = {"genai": "fp32", "genai-int4": "int4"}
PACKAGES = ("onnxruntime-genai", "onnxruntime", "onnx-ir", "onnx", "transformers", "torch", "numpy")


def requirements(main_versions: dict) -> list[str]:
    """The venv's pip requirements: onnxruntime (and transformers, which the builder reads the weights with) pinned
    to the main environment's versions."""
    reqs = [f"onnxruntime-genai=={GENAI_VERSION}", "onnx-ir", "onnx", "torch==2.13.0"]
    for name in ("onnxruntime", "transformers"):
        reqs.append(f"{name}=={main_versions[name]}" if main_versions.get(name) else name)
    return reqs


def builder_command(python: str, folder: Path, out: Path, precision: str, cache: Path) -> list[str]:
    return [python, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out), "-p", precision,
            "-e", "cpu", "-c", str(cache)]


# Architectures the builder refused when tried here (onnxruntime-genai 0.18: "The GPT2LMHeadModel model is not
# supported."): refused before its venv is made (a few minutes and over 1 GB), with the builder's own words.
REFUSED = {"gpt2": "GPT2LMHeadModel"}


def known_refusal(folder: Path) -> str | None:
    """The builder's refusal of the weights in `folder` where it is known without running it, else None."""
    config = json.loads((folder / "config.json").read_text())
    architecture = REFUSED.get(config.get("model_type", ""))
    return None if architecture is None else (f"the ONNX Runtime GenAI model builder failed: The {architecture} "
                                              f"model is not supported (onnxruntime-genai {GENAI_VERSION})")


def builder_refusal(log_text: str) -> str | None:
    """The builder's one-line reason when it does not support the model (it raises NotImplementedError)."""
    for line in reversed(log_text.splitlines()):
        if "NotImplementedError" in line or "not supported" in line.lower():
            return line.strip().removeprefix("NotImplementedError: ")
    return None


def with_threads(config: dict, threads: int | None) -> dict:
    """genai_config.json with the decoder session's intra-op threads set to `threads` (or the runtime's own)."""
    config = json.loads(json.dumps(config))
    options = config["model"]["decoder"].setdefault("session_options", {})
    if threads:
        options["intra_op_num_threads"] = threads
    else:
        options.pop("intra_op_num_threads", None)
    return config


def build(python: str, folder: Path, out: Path, precision: str, log: Path) -> Path:
    """The builder's output folder for `precision` (built once); RuntimeError with the reason when it fails."""
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)
    log.write_text("")  # this build's reasons only, not an earlier one's
    code = run_logged(builder_command(python, folder, tmp, precision, out.parent / "cache"), log, 3600, env)
    if code != 0 or not (tmp / "genai_config.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        text = log.read_text(errors="replace") if log.is_file() else ""
        config = json.loads((folder / "config.json").read_text())
        model = (config.get("architectures") or [config.get("model_type", "this model")])[0]
        why = (builder_refusal(text) or f"exit code {code}").replace(str(folder), model)  # "The GPT2LMHeadModel..."
        raise RuntimeError(f"the ONNX Runtime GenAI model builder failed: {why} (log {log})")
    os.replace(tmp, out)
    return out


class GenaiRunner:
    """The worker side of genai*: og.Model on the built folder, one og.Generator per `generate`."""

    encoder = None

    def __init__(self, args) -> None:
        import numpy as np
        import onnxruntime_genai as og

        self.np, self.og = np, og
        folder = Path(args.peer_model)
        config_path = folder / "genai_config.json"
        config = with_threads(json.loads(config_path.read_text()), args.threads)
        config_path.write_text(json.dumps(config, indent=4))
        self.model = og.Model(str(folder))
        from importlib import metadata

        self.versions = {name: metadata.version(name) for name in ("onnxruntime-genai", "onnxruntime", "numpy")}
        self.versions["threads"] = args.threads or "onnxruntime default"
        self.commands = {"generate": self.generate}

    def generate(self, command: dict) -> dict:
        ids = self.np.asarray(command["input_ids"], dtype=self.np.int32)
        batch, prompt = ids.shape
        total = prompt + int(command["new_tokens"])
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=batch)
        marks = []
        start = time.perf_counter()
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
            marks.append(time.perf_counter())
        end = time.perf_counter()
        tokens = [list(map(int, generator.get_sequence(r)))[prompt:] for r in range(batch)]
        steps = [b - a for a, b in zip(marks, marks[1:])]
        return {"ttft_s": marks[0] - start if marks else None,
                "step_median_s": statistics.median(steps) if steps else None, "e2e_s": end - start,
                "marks": len(marks), "tokens": tokens}
