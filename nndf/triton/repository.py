"""Write a Triton Inference Server model repository for an exported encoder (BERT, MiniLM, RoBERTa, DistilBERT...).

The layout follows ELS-RD's transformer-deploy, which users of `convert_model` already know. For `name=transformer`
and the ONNX engine:

    transformer_onnx_tokenize/   Python backend: TEXT (string) -> the model's inputs (input_ids, attention_mask...)
        config.pbtxt
        1/model.py               nndf/triton/tokenize_model.py, copied verbatim
        1/tokenizer/             the tokenizer, saved with save_pretrained
    transformer_onnx_model/      platform onnxruntime_onnx (or tensorrt_plan with 1/model.plan)
        config.pbtxt
        1/model.onnx             plus its external data file(s), under the names the graph refers to
    transformer_onnx_inference/  ensemble: TEXT -> the model's outputs

Every config is a `ModelConfig` message of Triton's own schema (tritonclient ships its generated protobuf module),
rendered with protobuf's text format, so a field Triton does not know cannot be written by mistake. Unlike
transformer-deploy, batching is Triton's: every model has `max_batch_size` > 0, so its dims omit the batch axis,
TEXT is one string per batch row (dims [1]) and the ONNX/TensorRT model gets the dynamic batcher.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from nndf.errors import HarnessError, UsageError
from nndf.export.graph_files import external_data_files
from nndf.export.standalone import copy_files
from nndf.paths import holds_other_files
from nndf.progress import say
from nndf.workspace import locked_atomic_dir

ENGINES = {"onnx": ("onnxruntime_onnx", "model.onnx"), "tensorrt": ("tensorrt_plan", "model.plan")}
DEVICES = {"cpu": "KIND_CPU", "cuda": "KIND_GPU"}
TEXT_INPUT = "TEXT"
MIN_LENGTH = "min_length"  # the tokenize model's parameter, read by tokenize_model.py
TOKENIZER_FOLDER = "tokenizer"  # inside the tokenize model's version folder, read by tokenize_model.py
TOKENIZE_SOURCE = Path(__file__).with_name("tokenize_model.py")


def model_names(name: str, engine: str) -> dict[str, str]:
    """{role: folder name} for the three models: `<name>_<engine>_{tokenize,model,inference}` as transformer-deploy
    names them, so that clients written for it call `<name>_onnx_inference` unchanged."""
    base = f"{name}_{engine}"
    return {"tokenize": f"{base}_tokenize", "model": f"{base}_model", "inference": f"{base}_inference"}


def config_schema():
    """Triton's ModelConfig protobuf module (from tritonclient[grpc]), with one clear sentence when it is missing."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as exc:
        raise HarnessError("writing or checking a Triton repository needs tritonclient[grpc] "
                           f"(pip install 'nndf[triton]'): {exc}") from exc
    return model_config_pb2


def _render(config) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(config)


def _check_args(name: str, model_file: Path, engine: str, tokenizer_dir: Path, input_names: Sequence[str],
                outputs: Mapping[str, Sequence[int]], max_batch_size: int, nb_instances: int, device: str,
                text_inputs: Sequence[str]) -> None:
    """Reject bad arguments before anything is written: each message names the argument and what is allowed."""
    if engine not in ENGINES:
        raise UsageError(f"engine must be one of {sorted(ENGINES)}, not {engine!r}")
    if device not in DEVICES:
        raise UsageError(f"device must be one of {sorted(DEVICES)}, not {device!r}")
    if not name or "/" in name or name.startswith("."):
        raise UsageError(f"--name must be a plain folder name, not {name!r}")
    if not model_file.is_file():
        raise UsageError(f"the {engine} model file {model_file} does not exist")
    if not tokenizer_dir.is_dir():
        raise UsageError(f"the tokenizer folder {tokenizer_dir} does not exist")
    if not input_names or not outputs:
        raise UsageError("a Triton model needs at least one input name and one output")
    if max_batch_size < 1:
        raise UsageError(f"max_batch_size must be at least 1, not {max_batch_size}")
    if nb_instances < 1:
        raise UsageError(f"nb_instances must be at least 1, not {nb_instances}")
    for out, dims in outputs.items():
        if not dims or any(d == 0 or d < -1 for d in dims):
            raise UsageError(f"output {out!r}: dims (without the batch axis) must be sizes or -1, not {list(dims)}")
    if len(text_inputs) not in (1, 2) or len(set(text_inputs)) != len(text_inputs):
        raise UsageError(f"text_inputs must be one name, or two different ones (a text pair), not {list(text_inputs)}")
    clash = set(text_inputs) & (set(input_names) | set(outputs))
    if clash:
        raise UsageError(f"tensor name {clash.pop()!r} is reserved for the ensemble's text input")


def add_tensor(message, name: str, data_type: str, dims: Sequence[int]):
    message.name = name
    message.data_type = config_schema().DataType.Value(data_type)
    message.dims.extend(int(d) for d in dims)
    return message


def model_config(folder: str, platform: str, input_names: Sequence[str], outputs: Mapping[str, Sequence[int]],
                 max_batch_size: int, nb_instances: int, kind: str, filename: str):
    """The engine's config: int64 token tensors of one dynamic sequence axis in, float32 outputs, dynamic batching.

    int64 because the exporter keeps the tokenizer's dtype; TensorRT 10 engines take int64 inputs as they are.
    """
    pb = config_schema()
    config = pb.ModelConfig(name=folder, platform=platform, max_batch_size=max_batch_size,
                            default_model_filename=filename)
    for input_name in input_names:
        add_tensor(config.input.add(), input_name, "TYPE_INT64", [-1])
    for out, dims in outputs.items():
        add_tensor(config.output.add(), out, "TYPE_FP32", dims)
    config.instance_group.add(count=nb_instances, kind=pb.ModelInstanceGroup.Kind.Value(kind))
    config.dynamic_batching.SetInParent()  # an empty block turns the batcher on with Triton's defaults
    return config


def tokenize_config(folder: str, input_names: Sequence[str], max_batch_size: int, nb_instances: int,
                    text_inputs: Sequence[str] = (TEXT_INPUT,), min_length: int = 1):
    """The tokenizer's config: the text inputs (one string per row each: a text, or a pair such as QUESTION and
    CONTEXT, tokenized together in that order) in, the engine's inputs out, padded to the longest row.

    Tokenizing is CPU work whatever the engine's device, so its instances are always KIND_CPU. `min_length` > 1
    (a TensorRT profile's shortest sequence) is the parameter `min_length`: shorter rows are padded up to it.
    """
    pb = config_schema()
    config = pb.ModelConfig(name=folder, backend="python", max_batch_size=max_batch_size)
    for text in text_inputs:
        add_tensor(config.input.add(), text, "TYPE_STRING", [1])
    for input_name in input_names:
        add_tensor(config.output.add(), input_name, "TYPE_INT64", [-1])
    config.instance_group.add(count=nb_instances, kind=pb.ModelInstanceGroup.Kind.Value("KIND_CPU"))
    if min_length > 1:
        config.parameters[MIN_LENGTH].string_value = str(min_length)
    return config


def ensemble_config(names: Mapping[str, str], input_names: Sequence[str], outputs: Mapping[str, Sequence[int]],
                    max_batch_size: int, text_inputs: Sequence[str] = (TEXT_INPUT,)):
    """The ensemble: the text input(s) -> tokenize -> engine -> outputs, tensors passed under their own names."""
    pb = config_schema()
    config = pb.ModelConfig(name=names["inference"], platform="ensemble", max_batch_size=max_batch_size)
    for text in text_inputs:
        add_tensor(config.input.add(), text, "TYPE_STRING", [1])
    for out, dims in outputs.items():
        add_tensor(config.output.add(), out, "TYPE_FP32", dims)
    tokenize = config.ensemble_scheduling.step.add(model_name=names["tokenize"], model_version=-1)
    for text in text_inputs:
        tokenize.input_map[text] = text
    engine = config.ensemble_scheduling.step.add(model_name=names["model"], model_version=-1)
    for input_name in input_names:
        tokenize.output_map[input_name] = input_name
        engine.input_map[input_name] = input_name
    for out in outputs:
        engine.output_map[out] = out
    return config


def _copy_tokenizer(tokenizer_dir: Path, target: Path) -> None:
    """Save the tokenizer through transformers rather than copying the folder: only tokenizer files travel (no
    weights), and a folder the server cannot load fails here, not at server start. It is read as the tokenize model
    reads it (`tokenize_model.load_as_saved`): from its tokenizer.json pipeline where there is one, since a reload
    by class (BERT's) rebuilds the pipeline from the vocabulary and drops what was changed in it before it was saved
    (sentence-transformers' lowercasing)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        if (tokenizer_dir / "tokenizer.json").is_file():
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir),
                                                                model_input_names=tokenizer.model_input_names)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc
    tokenizer.save_pretrained(str(target))


def check_model_folders(output_dir: str | Path, folders: Iterable[str]) -> None:
    """Each model folder to be written may be new, empty, or a Triton model written before (it is replaced), but
    not a file, nor a folder of something else, which replacing would delete: all checked before any is written
    (and, by `run.py triton`, before the model loads)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"the Triton repository {output_dir} is a file, not a folder")
    for folder in folders:
        path = output_dir / folder
        if path.exists() and not path.is_dir():
            raise UsageError(f"{path} is a file; the Triton model {folder!r} needs a folder there")
        if holds_other_files(path, "config.pbtxt"):
            raise UsageError(f"{path} is a folder of other files (no config.pbtxt), which writing the Triton model "
                             f"{folder!r} would replace: move it, or write the model elsewhere (-o, --name)")


def stray_folders(output_dir: str | Path) -> list[Path]:
    """The sub-folders of a repository that are not Triton models (no config.pbtxt), hidden ones included.

    Triton's default model control mode loads every sub-folder as a model, and measured with core 2.51 any such
    folder (a user's `notes/`, an empty one, a `.ipynb_checkpoints`) makes the server fail to start ("failed to
    load all models"); plain files beside the models are ignored, so they are not listed."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted(p for p in output_dir.iterdir() if p.is_dir() and not (p / "config.pbtxt").is_file())


def serve_command(output_dir: str | Path) -> str:
    """The command that serves the repository, quoted for a shell (a folder with a space or a quote in its name)."""
    return shlex.join(["tritonserver", "--model-repository", str(output_dir)])


def explicit_load_flags(output_dir: str | Path) -> str:
    """The tritonserver flags that load the repository's models (every folder with a config.pbtxt, those written
    before by anyone included) and skip the folders beside them that are not models."""
    models = sorted(p.name for p in Path(output_dir).iterdir() if (p / "config.pbtxt").is_file())
    return " ".join(["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)])


def warn_stray_folders(output_dir: str | Path) -> list[Path]:
    """After a write: say which folders of the repository are not models, which a server started on it in its default
    mode would fail on, and the two ways out (move them, or load only the models); nothing is deleted, since they
    are the user's. Returns those folders (none: nothing said)."""
    strays = stray_folders(output_dir)
    if strays:
        say(f"warning: {output_dir} holds {len(strays)} folder(s) that are not Triton models (no config.pbtxt): "
            f"{', '.join(p.name for p in strays)}. {serve_command(output_dir)} tries to load every "
            f"sub-folder and does not start with these there: move them out of the repository (they were left as "
            f"they are), or start the server with {explicit_load_flags(output_dir)}")
    return strays


def write_model_folder(output_dir: Path, folder: str, config, files: Mapping[str, Path] | None = None,
                 tokenizer_dir: Path | None = None, files_as: str | None = None) -> Path:
    """One model folder, built beside its final place and renamed in: a failure leaves the old one (or nothing).
    `files_as`: a model folder of `output_dir` just written with the same `files`, whose copies they link to."""
    with locked_atomic_dir(output_dir / folder, say) as tmp:
        version = tmp / "1"
        version.mkdir()
        (tmp / "config.pbtxt").write_text(_render(config), encoding="utf-8")
        copy_files(files or {}, version, same_as=None if files_as is None else output_dir / files_as / "1")
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, version / TOKENIZER_FOLDER)
    return output_dir / folder


def write_encoder_repository(output_dir: str | Path, name: str, model_file: str | Path, engine: str,
                             tokenizer_dir: str | Path, input_names: Sequence[str],
                             outputs: Mapping[str, Sequence[int]], max_batch_size: int, nb_instances: int = 1,
                             device: str = "cpu", text_inputs: Sequence[str] = (TEXT_INPUT,),
                             min_length: int = 1) -> list[Path]:
    """Write the tokenize, model and ensemble folders for `engine` ("onnx" or "tensorrt") into `output_dir`.

    `input_names` are the graph's token inputs in the tokenizer's names; `outputs` maps each graph output to its
    dims without the batch axis ([H] for pooled embeddings or classes, [-1, H] per token, [-1] for QA logits).
    `text_inputs`: the ensemble's string inputs, TEXT, or a pair tokenized together (QUESTION and CONTEXT).
    `min_length`: the fewest tokens the model takes (a TensorRT profile's minimum): shorter requests are padded.
    Existing model folders of the same names are replaced; other entries of `output_dir` are left alone.
    Returns the three model folders written.
    """
    output_dir, model_file, tokenizer_dir = Path(output_dir), Path(model_file), Path(tokenizer_dir)
    input_names, outputs = list(input_names), {k: list(v) for k, v in outputs.items()}
    text_inputs = list(text_inputs)
    _check_args(name, model_file, engine, tokenizer_dir, input_names, outputs, max_batch_size, nb_instances, device,
                text_inputs)
    platform, filename = ENGINES[engine]
    names = model_names(name, engine)
    check_model_folders(output_dir, names.values())
    files = {filename: model_file}
    if engine == "onnx":
        files.update(external_data_files(model_file))
    output_dir.mkdir(parents=True, exist_ok=True)
    written = [
        write_model_folder(output_dir, names["tokenize"], tokenize_config(names["tokenize"], input_names, max_batch_size,
                                                                    nb_instances, text_inputs, min_length),
                     {"model.py": TOKENIZE_SOURCE}, tokenizer_dir=tokenizer_dir),
        write_model_folder(output_dir, names["model"], model_config(names["model"], platform, input_names, outputs,
                                                              max_batch_size, nb_instances, DEVICES[device], filename),
                     files),
        write_model_folder(output_dir, names["inference"], ensemble_config(names, input_names, outputs, max_batch_size,
                                                                          text_inputs)),
    ]
    warn_stray_folders(output_dir)
    return written
