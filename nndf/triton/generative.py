"""A Triton model for a generative model (`python run.py triton GPT2 onnxrt ...`): text in, generated text out, with
nndf's generation loop and KV cache inside Triton's Python backend (transformer-deploy never served one).

    <name>/config.pbtxt       backend python; TEXT (+ optional MAX_NEW_TOKENS, NUM_BEAMS) -> GENERATED
    <name>/1/model.py         nndf/triton/generation_model.py, copied verbatim
    <name>/1/nndf.json        family, variant, backend, graph, cache, threads and the generation defaults
    <name>/1/hf/              the model's config, generation config and tokenizer (no weights)
    <name>/1/decoder/...      the exported decoder graph the onnxrt backend runs (fp32, int8 or int4), its data beside

The config is Triton's own `ModelConfig` message, as the encoders' are (`nndf.triton.repository`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from nndf.errors import UsageError
from nndf.triton.repository import DEVICES, add_tensor, config_schema, external_data_files, write_model_folder

MODEL_SOURCE = Path(__file__).with_name("generation_model.py")


def generative_config(name: str, max_batch_size: int, nb_instances: int, kind: str = "KIND_CPU"):
    """TEXT (one prompt per row) and the optional per-request settings in, GENERATED out; rows of a request are
    generated as one batch (with masks), so Triton batches requests as they come (no dynamic batcher: requests
    with different settings must not be merged)."""
    pb = config_schema()
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    add_tensor(config.input.add(), "TEXT", "TYPE_STRING", [1])
    for optional in ("MAX_NEW_TOKENS", "NUM_BEAMS"):
        add_tensor(config.input.add(), optional, "TYPE_INT32", [1]).optional = True
    add_tensor(config.output.add(), "GENERATED", "TYPE_STRING", [1])
    config.instance_group.add(count=nb_instances, kind=pb.ModelInstanceGroup.Kind.Value(kind))
    return config


def write_generative_repository(output_dir: str | Path, name: str, model, max_batch_size: int,
                                nb_instances: int = 1, max_new_tokens: int = 32, num_beams: int = 1) -> Path:
    """The Triton model `name` in `output_dir` for `model` (an `nndf.Model` on the onnxrt backend, its graph built),
    replacing a model folder of that name; returns the folder."""
    if model.backend != "onnxrt":
        raise UsageError(f"Triton serves the onnxrt backend's graphs (CPU, or CUDA with onnxruntime-gpu); "
                         f"{model.backend} is not served yet")
    if not name or "/" in name or name.startswith("."):
        raise UsageError(f"--name must be a plain folder name, not {name!r}")
    for flag, value in (("--max-batch-size", max_batch_size), ("--nb-instances", nb_instances)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    graph = Path(model.artifacts[-1])
    files = {"model.py": MODEL_SOURCE, f"decoder/{graph.name}": graph}
    files.update({f"decoder/{rel}": path for rel, path in external_data_files(graph).items()})
    settings = {"family": model.spec.family, "variant": model.variant.name, "backend": model.backend,
                "graph": f"decoder/{graph.name}", "use_cache": model.settings.use_cache,
                "threads": model.options.threads,
                "defaults": {"max_new_tokens": max_new_tokens, "num_beams": num_beams}}
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        model.loaded.config.save_pretrained(hf)
        generation = getattr(model.loaded.model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(hf)
        model.tokenizer.save_pretrained(hf)
        (Path(tmp) / "nndf.json").write_text(json.dumps(settings, indent=2))
        files.update({f"hf/{f.name}": f for f in hf.iterdir()})
        files["nndf.json"] = Path(tmp) / "nndf.json"
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        return write_model_folder(Path(output_dir), name, generative_config(name, max_batch_size, nb_instances,
                                                                      DEVICES["cpu"]), files)
