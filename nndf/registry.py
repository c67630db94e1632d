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
    "Llama": "nndf.models.llama",
    "Mistral": "nndf.models.mistral",
    "Qwen2": "nndf.models.qwen2",
    "Qwen3": "nndf.models.qwen3",
    "Phi3": "nndf.models.phi3",
    "Gemma": "nndf.models.gemma",
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
    raise UsageError(f"unknown model family '{family}'; allowed: {', '.join(FAMILIES)} (encoder models such as "
                     f"BERT, RoBERTa or MiniLM convert with: python run.py convert -m MODEL)")


def resolve(family: str, variant: str | None) -> tuple[ModelSpec, Variant]:
    """The family and variant a user means: a variant the family lists, else one a family under its umbrella lists
    (`GPT2 --variant EleutherAI/gpt-j-6B` finds GPT-J's spec), else a hub id of the family's own architecture; a
    variant another family lists is refused with that family's name."""
    spec = get_spec(family)
    if variant is not None and spec.known_variant(variant) is None:
        for member in UMBRELLAS.get(spec.family, ()):
            other = get_spec(member)
            known = other.known_variant(variant)
            if known is not None:
                return other, known
        owner = next((name for name in FAMILIES if get_spec(name).known_variant(variant) is not None), None)
        if owner is not None:  # a listed variant of another family: its hub config would say the same, later
            raise UsageError(f"--variant {variant} is listed under the {owner} family, not {spec.family}; run it as "
                             f"{owner} (python run.py ACTION {owner} ...)")
    return spec, spec.variant(variant)


def family_of_model_type(model_type: str) -> str | None:
    """The family whose known variants have this transformers `model_type` (None: no family lists it)."""
    return next((name for name in FAMILIES if model_type in get_spec(name).model_types), None)


def all_specs() -> list[ModelSpec]:
    return [get_spec(name) for name in FAMILIES]
