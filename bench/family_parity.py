"""Held-out parity: published configs shrunk to CPU size, with their real quirks, against Hugging Face generate().

    HF_HUB_OFFLINE=1 python bench/family_parity.py                          # every case, cache on
    HF_HUB_OFFLINE=1 python bench/family_parity.py --no-cache --cases Gemma:gemma-2-2b Phi3:Phi-3.5-mini-instruct

The tests (tests/family_examples.py) use one hand-written tiny config per family. This script takes the known
configs of published checkpoints instead (`run.py list`) and shrinks them by rule, not by hand: fewer layers, 16
dimensions per head, at most 8 query heads with the real query / KV head ratio, the real width / (heads x head
size) and MLP / width ratios, 1000 tokens of vocabulary, 256 positions; sliding windows become 16 positions and
rope scaling's original length 32 (so that a 24-token prompt plus 16 new tokens crosses both); longrope's factor
lists are subsampled to the new rotary size; tied heads, biases, soft-caps, RoPE bases, activations and layer
patterns stay as published. Weights are seeded random, drawn wide (0.1) with biases and norm weights drawn too
(tests/conftest.py `draw_constants`), so that every quirk moves the logits.

For each case and backend it compares whole sequences with `generate()` on a left-padded batch of 3 prompts
(24, 19 and 13 tokens), 16 new tokens, greedy and 3 beams, and prints PASS / FAIL per case and backend. The exit
code is 1 when any comparison fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from harness.cli import parse_checked, run_script  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# family:variant of `run.py list`; the second number is the layers kept (enough for one local and one global layer
# where the published model alternates them: Gemma 2 one in two, Gemma 3 five local to one global)
CASES = [
    ("Llama:SmolLM2-135M", 2), ("Llama:Llama-3.2-1B", 2), ("Llama:Llama-3.1-8B", 2), ("Llama:CodeLlama-7b-hf", 2),
    ("Mistral:Mistral-7B-v0.1", 2), ("Qwen2:Qwen2.5-0.5B", 2), ("Qwen2:Qwen2.5-7B", 2), ("Qwen3:Qwen3-0.6B", 2),
    ("Qwen3:Qwen3-8B", 2), ("Phi3:Phi-3-mini-4k-instruct", 2), ("Phi3:Phi-3.5-mini-instruct", 2),
    ("Gemma:gemma-2b", 2), ("Gemma:gemma-2-2b", 2), ("Gemma:gemma-2-27b", 2), ("Gemma:gemma-3-1b-pt", 6),
]
HEAD_DIM, MAX_HEADS, VOCAB, POSITIONS, WINDOW, ORIGINAL = 16, 8, 1000, 256, 16, 32
PROMPTS, NEW_TOKENS = (24, 19, 13), 16


def _heads(heads: int, kv_heads: int) -> tuple[int, int]:
    """At most MAX_HEADS query heads, halving both counts while they stay whole (the ratio is the model's)."""
    while heads > MAX_HEADS and heads % 2 == 0 and kv_heads % 2 == 0:
        heads, kv_heads = heads // 2, kv_heads // 2
    return heads, kv_heads


def _subsample(values: list, count: int) -> list:
    return [values[round(i * (len(values) - 1) / max(count - 1, 1))] for i in range(count)]


def shrink(config: dict, layers: int) -> dict:
    """The published config at CPU size, by the rules of the module docstring."""
    c = dict(config)
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    width_ratio = c["hidden_size"] / (heads * head_dim)
    mlp_ratio = c["intermediate_size"] / c["hidden_size"]
    heads, kv_heads = _heads(heads, kv_heads)
    width = heads * max(1, round(width_ratio * HEAD_DIM))
    c.update(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=width, num_hidden_layers=layers,
             intermediate_size=8 * max(1, round(mlp_ratio * width / 8)), vocab_size=VOCAB, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if "head_dim" in c:
        c["head_dim"] = HEAD_DIM
    if "query_pre_attn_scalar" in c:  # Gemma scales scores by this instead of the head size: keep the proportion
        c["query_pre_attn_scalar"] = max(1, round(c["query_pre_attn_scalar"] * HEAD_DIM / head_dim))
    published = int(c.get("max_position_embeddings", POSITIONS))
    c["max_position_embeddings"] = POSITIONS
    if c.get("sliding_window"):  # a window the sequences can outgrow shrinks; one longer than the model stays so
        c["sliding_window"] = WINDOW if c["sliding_window"] < published else 2 * POSITIONS
    if "original_max_position_embeddings" in c:
        c["original_max_position_embeddings"] = ORIGINAL if c["original_max_position_embeddings"] < published \
            else POSITIONS
    scaling = c.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        if "original_max_position_embeddings" in scaling:
            scaling["original_max_position_embeddings"] = ORIGINAL
        rotary_pairs = int(HEAD_DIM * c.get("partial_rotary_factor", 1.0)) // 2
        for key in ("short_factor", "long_factor"):
            if key in scaling:
                scaling[key] = _subsample(scaling[key], rotary_pairs)
        c["rope_scaling"] = scaling
    return c


def build(name: str, config: dict, folder: Path, seed: int) -> Path:
    """A seeded random model of `config` saved as a Hugging Face folder (reused when already there)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import draw_constants

    if (folder / "config.json").is_file():
        return folder
    kwargs = dict(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    draw_constants(model)
    model.save_pretrained(folder)
    return folder


def prompts():
    import torch

    width = max(PROMPTS)
    ids = torch.randint(4, VOCAB - 10, (len(PROMPTS), width), generator=torch.Generator().manual_seed(11))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPTS):
        mask[row, width - length:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def check(family: str, folder: Path, backend: str, use_cache: bool, work: str) -> list[str]:
    """The comparisons that differ from generate() (empty: all equal)."""
    import torch

    import nndf

    model = nndf.load(family, backend=backend, torch_dir=str(folder), use_cache=use_cache, working_dir=work,
                      device="cpu")
    ids, mask = prompts()
    failed = []
    for beams in (1, 3):
        ours = model.generate(ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, num_beams=beams)
        reference = model.hf_generate(ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      num_beams=beams)
        if not torch.equal(ours, reference):
            failed.append("greedy" if beams == 1 else f"{beams} beams")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", metavar="FAMILY:VARIANT", help="a subset of the cases (default: all)")
    parser.add_argument("--backends", nargs="+", default=["frameworks", "onnxrt"])
    parser.add_argument("--no-cache", action="store_true", help="also compare without the KV cache")
    parser.add_argument("--working-dir", default="temp/family-parity")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_checked(parser, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from nndf.registry import get_spec

    chosen = [(case, layers) for case, layers in CASES if not args.cases or case in args.cases]
    unknown = set(args.cases or ()) - {case for case, _ in CASES}
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}; known: {', '.join(c for c, _ in CASES)}")
    modes = [(backend, cache) for backend in args.backends for cache in ([True, False] if args.no_cache else [True])]
    columns = [f"{b}{'' if cache else ' no-cache'}" for b, cache in modes]
    rows = []
    for case, layers in chosen:
        family, variant = case.split(":")
        config = shrink(dict(get_spec(family).variant(variant).config), layers)
        folder = build(case, config, Path(args.working_dir) / "weights" / case.replace(":", "-"), args.seed)
        heads = f"{config['num_attention_heads']}/{config['num_key_value_heads']}"
        cells = []
        for backend, cache in modes:
            started = time.perf_counter()
            print(f"{case} on {backend}{'' if cache else ' without cache'} ...", file=sys.stderr, flush=True)
            failed = check(family, folder, backend, cache, args.working_dir)
            cells.append("PASS" if not failed else f"FAIL ({', '.join(failed)})")
            print(f"  {cells[-1]} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        rows.append([case, heads, *cells])
    header = ["case (published config, shrunk)", "heads/KV", *columns]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\ngenerate() parity, {len(PROMPTS)} left-padded prompts ({', '.join(map(str, PROMPTS))} tokens) + "
          f"{NEW_TOKENS} new, greedy and 3 beams; windows {WINDOW}, rope original length {ORIGINAL}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
    failures = sum(cell != "PASS" for row in rows for cell in row[2:])
    print(f"{failures} of {len(rows) * len(modes)} failed" if failures else f"all {len(rows) * len(modes)} passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_script("family_parity.py", main))
