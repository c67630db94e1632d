"""Check a Triton model repository before a server loads it, against Triton's own config schema.

Triton reports a bad config.pbtxt only when the server starts (and, with --exit-on-error, by exiting), far from
the command that wrote it. Parsing each file with protobuf's text format into tritonclient's generated
`ModelConfig` applies the same schema the server uses: a syntax error, an unknown field or a wrong enum value is
one HarnessError naming the file and the line. On top of the schema, the checks are the ones a repository written
by nndf.triton.repository must pass: the folder name equals the config's name, version folder `1/` holds the file
the platform or backend loads, and every model an ensemble calls is in the repository.
"""

from __future__ import annotations

from pathlib import Path

from nndf.errors import HarnessError
from nndf.triton.repository import config_schema, stray_folders

# What each kind of model nndf writes loads from its version folder; None: nothing (an ensemble's folder is empty).
# Models of other kinds in the same repository get the schema and version-folder checks only.
VERSION_FILES = {"onnxruntime_onnx": "model.onnx", "tensorrt_plan": "model.plan", "python": "model.py",
                 "ensemble": None}


def validate_config(path: str | Path):
    """Parse one config.pbtxt into Triton's `ModelConfig` and return the message; HarnessError if it does not parse.
    """
    from google.protobuf import text_format

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HarnessError(f"cannot read the Triton config {path}: {exc}") from exc
    try:
        return text_format.Parse(text, config_schema().ModelConfig())
    except text_format.ParseError as exc:
        raise HarnessError(f"{path} is not a valid Triton model config: {exc}") from exc


def _check_model(folder: Path, config) -> None:
    """Checks beyond the schema that make Triton refuse the model at load time."""
    if config.name and config.name != folder.name:
        raise HarnessError(f"{folder / 'config.pbtxt'}: name {config.name!r} differs from its folder {folder.name!r}")
    version = folder / "1"
    if not version.is_dir():
        raise HarnessError(f"model {folder.name!r} has no version folder {version}")
    kind = config.platform or config.backend
    if not kind:
        raise HarnessError(f"{folder / 'config.pbtxt'} names neither a platform nor a backend")
    expected = config.default_model_filename or VERSION_FILES.get(kind)
    if VERSION_FILES.get(kind) is not None and not (version / expected).is_file():
        raise HarnessError(f"model {folder.name!r} lacks {version / expected}, which its {kind} model loads")
    if config.max_batch_size < 0:
        raise HarnessError(f"model {folder.name!r}: max_batch_size {config.max_batch_size} is negative")
    for tensor in list(config.input) + list(config.output):
        if not tensor.dims:
            raise HarnessError(f"model {folder.name!r}: tensor {tensor.name!r} has no dims")


def validate_repository(folder: str | Path) -> dict[str, object]:
    """Validate every model of a repository; return {model name: ModelConfig}.

    A model is every sub-folder, hidden ones included: that is Triton's rule (measured with core 2.51: a `.tokenizer`
    folder beside the models makes the server fail to start), so a stray folder is reported here, before a server
    trips on it. Files beside the models are ignored, as Triton ignores them.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HarnessError(f"the Triton repository {folder} is not a folder")
    for model in stray_folders(folder):
        raise HarnessError(f"{model} is a folder of the Triton repository without a config.pbtxt: Triton would try "
                           "to load it as a model and fail; move it out of the repository")
    configs = {}
    for model in sorted(p for p in folder.iterdir() if p.is_dir()):
        config = validate_config(model / "config.pbtxt")
        _check_model(model, config)
        configs[model.name] = config
    if not configs:
        raise HarnessError(f"the Triton repository {folder} holds no model")
    for name, config in configs.items():
        for step in config.ensemble_scheduling.step:
            if step.model_name not in configs:
                raise HarnessError(f"ensemble {name!r} calls {step.model_name!r}, which is not in {folder}")
    return configs
