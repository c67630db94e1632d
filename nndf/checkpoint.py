"""A family's `checkpoint.toml`: sample prompts and the labels the real weights produce for them (for `run`)."""

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


@dataclass(frozen=True)
class Sample:
    prompt: str
    label: str


def read_samples(spec: ModelSpec, variant: Variant) -> list[Sample]:
    """Samples for `variant`: the `[default]` table, with labels (and inputs) overridden by the variant's table."""
    path = Path(spec.checkpoint_file)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HarnessError(f"the {spec.family} checkpoint file {path} cannot be read: {exc}") from None
    table = dict(data.get("default", {}))
    table.update(data.get(variant.name, {}))
    inputs, labels = table.get("inputs", []), table.get("labels", [])
    if not inputs or len(inputs) != len(labels):
        raise HarnessError(f"{path} must give as many 'labels' as 'inputs' (at least one) for {variant.name}")
    return [Sample(p, l) for p, l in zip(inputs, labels)]
