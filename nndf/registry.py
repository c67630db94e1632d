"""The one place that knows every family: family name -> the package that defines its ModelSpec.

Families are imported lazily, so that `run.py list` or an error message does not pay for importing every
family's code. Adding a family is one line in `FAMILIES` (plus its `models/<family>/` package).
"""

from __future__ import annotations

import importlib

from nndf.errors import UsageError
from nndf.spec import ModelSpec, Variant

# Family name as users type it -> module that defines `SPEC`.
FAMILIES: dict[str, str] = {
    "GPT2": "nndf.models.gpt2",
    "GPTNeo": "nndf.models.gptneo",
    "GPTNeoX": "nndf.models.gptneox",
    "GPTJ": "nndf.models.gptj",
    "CerebrasGPT": "nndf.models.cerebras",
    "OPT": "nndf.models.opt",
    "BLOOM": "nndf.models.bloom",
    "T5": "nndf.models.t5",
    "BART": "nndf.models.bart",
    "BLIP": "nndf.models.blip",
}

# NVIDIA's demo runs these families as `GPT2 --variant <hub id>`; so do we, besides their own names.
UMBRELLAS: dict[str, tuple[str, ...]] = {
    "GPT2": ("GPTNeo", "GPTNeoX", "GPTJ", "CerebrasGPT"),
}


def _key(name: str) -> str:
    """Family names match ignoring case, '-' and '_': GPT-Neo, gpt_neo and GPTNeo are one family."""
    return name.lower().replace("-", "").replace("_", "")


def family_names() -> list[str]:
    return list(FAMILIES)


def get_spec(family: str) -> ModelSpec:
    """The ModelSpec of `family`, or a UsageError that lists the known families."""
    for name, module in FAMILIES.items():
        if _key(name) == _key(family):
            return importlib.import_module(module).SPEC
    raise UsageError(f"unknown model family '{family}'; allowed: {', '.join(FAMILIES)}")


def resolve(family: str, variant: str | None) -> tuple[ModelSpec, Variant]:
    """The family and variant a user means; `GPT2 --variant EleutherAI/gpt-j-6B` finds GPT-J's spec."""
    spec = get_spec(family)
    try:
        return spec, spec.variant(variant)
    except UsageError:
        for member in UMBRELLAS.get(spec.family, ()):
            other = get_spec(member)
            if variant is not None and any(variant.lower() in (v.name.lower(), v.hub_id.lower())
                                           for v in other.variants):
                return other, other.variant(variant)
        raise


def all_specs() -> list[ModelSpec]:
    return [get_spec(name) for name in FAMILIES]
