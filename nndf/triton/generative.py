"""A Triton model for a generative model (`python run.py triton GPT2 onnxrt ...`): text in, generated text out, with
nndf's generation loop and KV cache inside Triton's Python backend (transformer-deploy never served one).

    <name>/config.pbtxt       backend python; TEXT (+ optional MAX_NEW_TOKENS, MIN_NEW_TOKENS, NUM_BEAMS, sampling,
                              STOP strings) -> GENERATED
    <name>/1/model.py         nndf/triton/generation_model.py, copied verbatim
    <name>/1/nndf.json        family, variant, backend, graph, cache, threads, the target language's forced
                              first token (--tgt-lang) and the generation defaults
    <name>/1/hf/              the model's config, generation config and tokenizer (no weights)
    <name>/1/decoder/...      the exported decoder graph the onnxrt backend runs (fp32, int8 or int4), its data beside
    <name>/1/encoder/, cross/ an encoder-decoder model's encoder and cross-attention cache generator graphs

    <name>_stream/            with --streaming: the same files, its config decoupled (a response per new piece)

The config is Triton's own `ModelConfig` message, as the encoders' are (`nndf.triton.repository`).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from nndf.errors import UsageError
from nndf.sampling import Sampling
from nndf.triton.repository import (DEVICES, add_tensor, check_model_folders, config_schema, warn_stray_folders,
                                    write_model_folder)

MODEL_SOURCE = Path(__file__).with_name("generation_model.py")


SCHEDULERS = ("continuous", "sequential")
MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"  # what --name takes
STREAM_SUFFIX = "_stream"  # the decoupled (streaming) model's name: <name>_stream
OPTIONAL_INPUTS = {"MAX_NEW_TOKENS": "TYPE_INT32", "MIN_NEW_TOKENS": "TYPE_INT32", "NUM_BEAMS": "TYPE_INT32",
                   "DO_SAMPLE": "TYPE_BOOL", "TEMPERATURE": "TYPE_FP32", "TOP_K": "TYPE_INT32", "TOP_P": "TYPE_FP32",
                   "SEED": "TYPE_INT64", "REPETITION_PENALTY": "TYPE_FP32"}  # one value per row
STOP_INPUT = "STOP"  # any number of stop strings per row: dims [-1]


def generative_config(name: str, max_batch_size: int, nb_instances: int, kind: str = "KIND_CPU",
                      scheduler: str = "continuous", decoupled: bool = False, queue_delay_us: int = 0):
    """TEXT (one prompt per row) and the optional per-request settings (STOP: stop strings) in, GENERATED out.

    With the continuous scheduler Triton's dynamic batcher is on (`queue_delay_us`: how long it holds a request
    for others to join the same `execute`), since every row keeps its own settings in the batch; the sequential
    scheduler generates each request as one batch, so requests with different settings must not be merged.
    `decoupled`: the streaming model (a response per new piece of text, then a final flag)."""
    pb = config_schema()
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    add_tensor(config.input.add(), "TEXT", "TYPE_STRING", [1])
    for optional, data_type in OPTIONAL_INPUTS.items():
        add_tensor(config.input.add(), optional, data_type, [1]).optional = True
    add_tensor(config.input.add(), STOP_INPUT, "TYPE_STRING", [-1]).optional = True
    add_tensor(config.output.add(), "GENERATED", "TYPE_STRING", [1])
    config.instance_group.add(count=nb_instances, kind=pb.ModelInstanceGroup.Kind.Value(kind))
    if scheduler == "continuous":
        config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
        config.dynamic_batching.SetInParent()
    if decoupled:
        config.model_transaction_policy.decoupled = True
    return config


def model_folders(name: str, streaming: bool) -> list[str]:
    """The Triton models written: `name`, and with `streaming` its decoupled twin."""
    return [name] + ([name + STREAM_SUFFIX] if streaming else [])


def check_serving(output_dir: str | Path, name: str, max_batch_size: int, nb_instances: int, scheduler: str,
                  streaming: bool, max_rows: int | None, queue_delay_us: int, sampling_stream: str,
                  num_beams: int = 1) -> int:
    """The serving settings and where the models go, checked before any model loads (`run.py triton`) and again
    when a folder is written (the API); returns the rows of the continuous batch."""
    if not re.fullmatch(MODEL_NAME, name):  # a folder, a URL path (/v2/models/NAME) and a --load-model=NAME flag
        raise UsageError(f"-n/--name {name!r} names the Triton model (its folder, and its URL path): use letters, "
                         "digits, '.', '-' and '_', beginning with a letter or digit")
    check_model_folders(output_dir, model_folders(name, streaming))
    if scheduler not in SCHEDULERS:
        raise UsageError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, not {scheduler!r}")
    if streaming and scheduler != "continuous":
        raise UsageError("--streaming needs --scheduler continuous (the sequential model answers whole requests)")
    if streaming and num_beams > 1:
        raise UsageError(f"--streaming with --num-beams {num_beams}: beam search cannot stream, so every streamed "
                         "request that keeps the default would fail; drop one of the two")
    if scheduler != "continuous" and (max_rows is not None or queue_delay_us):
        flag = "--max-rows" if max_rows is not None else "--max-queue-delay-us"
        raise UsageError(f"{flag} applies to --scheduler continuous (its running batch); the sequential model "
                         "generates each request as its own batch")
    rows = max_batch_size if max_rows is None else max_rows
    for flag, value in (("--max-batch-size", max_batch_size), ("--nb-instances", nb_instances), ("--max-rows", rows)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if num_beams > rows:  # each beam is a row; the served model refuses a request with more (NUM_BEAMS)
        raise UsageError(f"--num-beams {num_beams} is more than the {rows} rows the model generates at once "
                         f"({'--max-rows' if max_rows is not None else '--max-batch-size'}), so every request "
                         "keeping the default would be refused; ask for fewer beams or more rows")
    Sampling(stream=sampling_stream)  # one sentence for a stream that does not exist
    if queue_delay_us < 0:
        raise UsageError(f"--max-queue-delay-us must be 0 or more, got {queue_delay_us}")
    return rows


def write_generative_repository(output_dir: str | Path, name: str, model, max_batch_size: int,
                                nb_instances: int = 1, max_new_tokens: int = 32, num_beams: int = 1,
                                scheduler: str = "continuous", streaming: bool = False, max_rows: int | None = None,
                                queue_delay_us: int = 0, sampling_stream: str = "generate") -> list[Path]:
    """The Triton model `name` in `output_dir` for `model` (an `nndf.Model` on the onnxrt backend, its graph built),
    and with `streaming` its decoupled twin `<name>_stream`, replacing model folders of those names; returns the
    folders. `max_rows`: rows in the continuous batch (default `max_batch_size`); `sampling_stream`: where sampled
    requests' draws come from (`nndf.sampling.SAMPLING_STREAMS`)."""
    if model.backend != "onnxrt":
        raise UsageError(f"Triton serves the onnxrt backend's graphs (CPU, or CUDA with onnxruntime-gpu); "
                         f"{model.backend} is not served yet")
    max_rows = check_serving(output_dir, name, max_batch_size, nb_instances, scheduler, streaming, max_rows,
                             queue_delay_us, sampling_stream, num_beams)
    config_schema()  # tritonclient missing is said now, not after the export
    if scheduler == "continuous":
        from nndf.continuous import ContinuousBatcher

        ContinuousBatcher.check_model(model)  # refused here, not at the server's start
    from nndf.export.standalone import SETTINGS_FILE, standalone_files

    with tempfile.TemporaryDirectory() as tmp:
        files, settings = standalone_files(model, Path(tmp))  # the graphs, hf/ and nndf.json of `export -o`
        settings.update({"scheduler": scheduler, "max_rows": max_rows,
                         "defaults": {"max_new_tokens": max_new_tokens, "num_beams": num_beams,
                                      "sampling_stream": sampling_stream}})
        files["model.py"] = MODEL_SOURCE
        (Path(tmp) / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))
        files[SETTINGS_FILE] = Path(tmp) / SETTINGS_FILE
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        # an earlier twin goes before anything is written: stopped between the two folders, a write leaves the new
        # model alone (it serves), never beside the old graph's twin
        _remove_stale_twin(Path(output_dir) / (name + STREAM_SUFFIX), SETTINGS_FILE, said=not streaming)
        written = [write_model_folder(Path(output_dir), folder,
                                      generative_config(folder, max_batch_size, nb_instances, DEVICES["cpu"],
                                                        scheduler, decoupled=folder != name,
                                                        queue_delay_us=queue_delay_us), files,
                                      files_as=None if folder == name else name)  # the twin: its files linked
                   for folder in model_folders(name, streaming)]
    warn_stray_folders(output_dir)
    return written


def _remove_stale_twin(twin: Path, settings_file: str, said: bool) -> None:
    """The streaming twin an earlier `--streaming` write left: written again without it, `<name>_stream` would go
    on serving the old graph and settings beside the new model, so it goes (`said`: where no new twin replaces it).
    Only a folder of ours (its config.pbtxt and version 1's settings file) is removed, under its lock, as it is
    written (a write of it by another process finishes first)."""
    if (twin / "config.pbtxt").is_file() and (twin / "1" / settings_file).is_file():
        from nndf.progress import say
        from nndf.workspace import remove_artifact

        remove_artifact(twin, say)
        if said:
            say(f"removed {twin}: the streaming model of an earlier --streaming write, which would serve the old "
                "graph and settings")
