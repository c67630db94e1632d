"""The weights folder the CPU peers (llama.cpp, ONNX Runtime GenAI) convert: the bench's own Hugging Face folder,
plus what their converters insist on and the bench's folder lacks.

Both converters read the model through transformers and refuse a folder without a tokenizer, although no engine
here ever tokenizes (every engine gets the same random token ids, and llama.cpp's bench tool draws its own):

- llama.cpp's `convert_hf_to_gguf.py` writes the tokenizer into the GGUF file and checks that every token id fits the
  model's vocabulary, and for GPT-2 it reads `n_ctx` from config.json, which transformers 5 no longer writes;
- ONNX Runtime GenAI's model builder loads the tokenizer with AutoTokenizer before it converts anything.

So the peers' folder links the weights, adds `n_ctx` where a GPT-2-style config has `n_positions` only, and holds a
byte-level BPE tokenizer (GPT-2's, from ../shared/data, unless the weights folder has its own) cut to the model's
vocabulary when it is larger: ids past the vocabulary and the merges that make them are dropped, and the special
tokens take the last ids. The tokenizer is data the converters store, nothing here depends on what it splits.
Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SHARED_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpt2-tokenizer"


class PeerWeightsError(Exception):
    """The peers' folder cannot be made; the message says why, in one sentence."""


def fit_tokenizer(tokenizer: dict, vocab_size: int) -> dict:
    """A BPE tokenizer.json (as a dict) whose ids all lie below `vocab_size`: the tokens past it, the merges that
    make them and their added-token entries go; the special tokens move to the last ids."""
    model = tokenizer["model"]
    vocab = model["vocab"]
    specials = sorted(tokenizer.get("added_tokens", []), key=lambda t: t["id"])
    if max(vocab.values(), default=-1) < vocab_size and all(t["id"] < vocab_size for t in specials):
        return tokenizer
    limit = vocab_size - len(specials)
    if limit <= 256:
        raise PeerWeightsError(f"a vocabulary of {vocab_size} is too small for a byte-level tokenizer")
    special_names = {t["content"] for t in specials}
    kept = {tok: i for tok, i in vocab.items() if i < limit and tok not in special_names}
    merges = []
    for merge in model["merges"]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        if a in kept and b in kept and a + b in kept:
            merges.append(merge)
    moved = [dict(t, id=limit + i) for i, t in enumerate(specials)]
    kept.update({t["content"]: t["id"] for t in moved})
    return dict(tokenizer, added_tokens=moved, model=dict(model, vocab=kept, merges=merges))


def _tokenizer_source(weights: Path) -> Path:
    if (weights / "tokenizer.json").is_file():
        return weights
    if (SHARED_TOKENIZER / "tokenizer.json").is_file():
        return SHARED_TOKENIZER
    raise PeerWeightsError(f"the weights have no tokenizer.json and {SHARED_TOKENIZER} is absent (the peers' "
                           "converters need a tokenizer)")


def peer_config(config: dict) -> dict:
    """config.json as the converters want it: GPT-2's `n_ctx` added when only `n_positions` is there."""
    if config.get("model_type") == "gpt2" and "n_ctx" not in config and "n_positions" in config:
        return dict(config, n_ctx=config["n_positions"])
    return config


def peer_weights(weights: Path, working_dir: Path) -> Path:
    """The peers' folder for `weights` (made once under working_dir/bench-peer-weights, same name)."""
    folder = working_dir / "bench-peer-weights" / weights.name
    if (folder / "config.json").is_file():
        return folder
    source = _tokenizer_source(weights)
    config = json.loads((weights / "config.json").read_text())
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in weights.iterdir():
        if item.name not in ("config.json", *TOKENIZER_FILES) and item.is_file():
            (tmp / item.name).symlink_to(item.resolve())
    (tmp / "config.json").write_text(json.dumps(peer_config(config), indent=2))
    tokenizer = fit_tokenizer(json.loads((source / "tokenizer.json").read_text()), int(config["vocab_size"]))
    (tmp / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    settings = json.loads((source / "tokenizer_config.json").read_text()) if (
        source / "tokenizer_config.json").is_file() else {}
    settings["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k not in ("id",)}
                                        for t in tokenizer.get("added_tokens", [])}
    settings.setdefault("tokenizer_class", "GPT2Tokenizer")
    (tmp / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    if (source / "special_tokens_map.json").is_file():
        shutil.copyfile(source / "special_tokens_map.json", tmp / "special_tokens_map.json")
    os.replace(tmp, folder)
    return folder
