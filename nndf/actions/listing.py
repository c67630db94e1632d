"""`list`: every family, its variants with hub ids and sizes, and what kind of generator each is (which decides
the flags it takes: an encoder-decoder model's prompt is its encoder's input, an image-to-text one's an image)."""

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
                "kind": spec.architecture,
                "backends": list(spec.backends),
            })
    columns = [
        Column("family", "family"), Column("variant", "variant"), Column("hub_id", "hub id"),
        Column("params", "params"), Column("kind", "kind"),
    ]
    # the backends in a note (a column of the same three names on every row said nothing), families that lack one
    # named in it
    fewer = {spec.family: spec.backends for spec in all_specs() if tuple(spec.backends) != tuple(BACKENDS)}
    runs_on = f"backends: {', '.join(BACKENDS)}" + ("".join(f"; {family} only {', '.join(names)}"
                                                           for family, names in fewer.items()) if fewer
                                                   else " (every family)")
    notes = [f"{runs_on}. Default variant: the first listed for its family."]
    return [Result("list", "families and variants", columns, rows, {}, notes)]
