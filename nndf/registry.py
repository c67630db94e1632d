"""The one place that knows every family: family name -> the package that defines its ModelSpec.

Families are imported lazily, so that `run.py list` or an error message does not pay for importing every
family's code. Adding a family is one line in `FAMILIES` (plus its `models/<family>/` package).
"""

from __future__ import annotations

import importlib

from nndf.errors import UsageError
from nndf.spec import ModelSpec

# Family name as users type it -> module that defines `SPEC`.
FAMILIES: dict[str, str] = {
    "GPT2": "nndf.models.gpt2",
}


def family_names() -> list[str]:
    return list(FAMILIES)


def get_spec(family: str) -> ModelSpec:
    """The ModelSpec of `family` (any case), or a UsageError that lists the known families."""
    for name, module in FAMILIES.items():
        if name.lower() == family.lower():
            return importlib.import_module(module).SPEC
    raise UsageError(f"unknown model family '{family}'; allowed: {', '.join(FAMILIES)}")


def all_specs() -> list[ModelSpec]:
    return [get_spec(name) for name in FAMILIES]
