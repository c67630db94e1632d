"""A family's `checkpoint.toml`: sample prompts, and for some variants the labels their real weights produce.

    [default]                     # prompts for every variant of the family
    inputs = ["..."]
    [gpt2]                        # a variant's own table: its labels (and, optionally, its own inputs)
    labels = ["..."]

A label is the variant's whole greedy output for the prompt: prompt included for a decoder-only model, the output
text alone for an encoder-decoder one (as `generate()` returns them; `Model.label_ids` turns either into the
tokens to compare). Variants without labels still run: `run` then reports their outputs' runtimes, and no accuracy.

An image-to-text family also lists `images = ["..."]`, one per input (the input is then the caption's text prefix,
empty for none); relative paths are read from the repository root (the folder that holds `models/`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from nndf.errors import HarnessError
from nndf.spec import ModelSpec, Variant

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_NEW_TOKENS = 32  # tokens generated for a prompt without a label


@dataclass(frozen=True)
class Sample:
    prompt: str
    label: str | None
    image: Path | None = None


def read_samples(spec: ModelSpec, variant: Variant) -> list[Sample]:
    """Samples for `variant`: `[default]` inputs, with the variant's table's inputs and labels over them."""
    path = Path(spec.checkpoint_file)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HarnessError(f"the {spec.family} checkpoint file {path} cannot be read: {exc}") from None
    table = dict(data.get("default", {}))
    table.update(data.get(variant.name, {}))
    inputs, labels, images = table.get("inputs", []), table.get("labels"), table.get("images")
    if not inputs or any(given is not None and len(inputs) != len(given) for given in (labels, images)):
        raise HarnessError(f"{path} must give at least one input, and as many labels and images as inputs where it "
                           f"gives them, for {variant.name}")
    root = path.resolve().parents[2]  # models/<family>/checkpoint.toml -> the repository root
    return [Sample(p, labels[i] if labels else None, root / images[i] if images else None)
            for i, p in enumerate(inputs)]
