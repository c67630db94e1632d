"""The inputs every engine gets, by kind (a Family's `inputs`): made once in the main process, sent to each worker
in its `generate` command, and turned into the keyword arguments of generate() there.

- "tokens": seeded random ids of --input-len (a decoder's prompt, an encoder's tokens), sent as lists, with a full
  attention mask;
- "pixels": seeded random images of the model's image size (an image-to-text model such as BLIP: no text prefix),
  saved once per batch size as a tensor file under the working dir and sent as its path, so that every engine reads
  the very same pixels (megabytes of floats do not travel as JSON).

Standard library only at import time (the Optimum worker imports this too); torch is imported when used.
"""

from __future__ import annotations

import os
from pathlib import Path


def image_size(config: dict) -> int:
    """The square image size of an image-to-text model's config (BLIP: vision_config.image_size)."""
    size = (config.get("vision_config") or {}).get("image_size") or config.get("image_size")
    if not size:
        from nndf.errors import UsageError

        raise UsageError("this model's config.json has no image_size (vision_config.image_size)")
    return int(size)


def describe(kind: str, config: dict, args, word: str) -> str:
    """What the header says the inputs are: '64 encoder' (tokens) or 'random 384x384 images' (pixels)."""
    if kind == "pixels":
        size = image_size(config)
        return f"random {size}x{size} images"
    return f"{args.input_len} {word}"


def make_inputs(kind: str, config: dict, args, batch: int, folder: Path) -> dict:
    """The `generate` command's input fields for one batch size (the same seed for every batch size)."""
    import torch

    if kind == "tokens":
        from nndf.actions.common import random_input_ids

        return {"input_ids": random_input_ids(batch, args.input_len, int(config["vocab_size"]), args.seed).tolist()}
    if kind != "pixels":
        raise ValueError(f"unknown kind of inputs {kind!r}")
    size = image_size(config)
    path = folder / f"pixels-{batch}x3x{size}x{size}-seed{args.seed}.pt"
    if not path.is_file():
        generator = torch.Generator().manual_seed(args.seed)
        pixels = torch.randn(batch, 3, size, size, generator=generator)  # as `run.py benchmark` makes them
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        torch.save(pixels, tmp)
        os.replace(tmp, path)
    return {"pixel_values_file": str(path)}


def read_inputs(command: dict) -> dict:
    """In the worker: the generate() keyword arguments of a `generate` command's input fields."""
    import torch

    if "pixel_values_file" in command:
        return {"pixel_values": torch.load(command["pixel_values_file"], weights_only=True)}
    ids = torch.tensor(command["input_ids"], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
