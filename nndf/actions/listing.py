"""`list`: every family, its variants with hub ids and sizes, and the backends each supports."""

from __future__ import annotations

from nndf.backends import BACKENDS
from nndf.registry import all_specs
from nndf.results import Column, Result

NEEDS_MODEL = False


def add_arguments(parser) -> None:
    parser.add_argument("--json", metavar="FILE", help="also write the list as JSON to FILE")


def run(args) -> list[Result]:
    rows = []
    for spec in all_specs():
        for variant in spec.variants:
            rows.append({
                "family": spec.family,
                "variant": variant.name,
                "hub_id": variant.hub_id,
                "params": variant.params,
                "backends": ", ".join(spec.backends),
            })
    columns = [
        Column("family", "family"), Column("variant", "variant"), Column("hub_id", "hub id"),
        Column("params", "params"), Column("backends", "backends"),
    ]
    notes = [f"backends: {', '.join(BACKENDS)}. Default variant: the first listed for its family."]
    return [Result("list", "families and variants", columns, rows, {}, notes)]
