"""NVIDIA TensorRT demo/HuggingFace flags that have no flag of their own here, and what replaces them; and Hugging
Face generate()'s names for flags that keep the demo's name here.

The demo's flags that mean the same thing here are aliases of ours (`-wd`, `-b`, `-m`, `-kv`, `--enable-kv-cache`,
`--use-cuda-graph`, `--compare/-c`: `nndf.cli`). For the others, argparse's bare "unrecognized arguments" would leave
a user of the demo guessing; `hint` adds what to write instead.
"""

from __future__ import annotations

import re

REPLACED = {
    "--input-profile-max-len": "--input-seq-len sets the TensorRT profile's prompt range",
    "--output-profile-max-len": "--output-seq-len sets the TensorRT profile's generation range",
    "--save-output-fpath": "--json FILE writes the results",
    "-o": "--json FILE writes the results",
    "--cpu": "frameworks and onnxrt run on the CPU wherever no GPU is visible",
    "--cleanup": "artifacts are reused while their metadata matches and rebuilt otherwise; delete the --working-dir "
                 "folder to clean up",
    "--verbose": "--info prints the settings and tensor shapes",
    "-v": "--info prints the settings and tensor shapes (-m is the demo's --variant)",
    "--n-positions": "the positions come from the model's config; --input-seq-len and --output-seq-len set lengths",
    "--use-timing-cache": "the trt backend always keeps a timing cache per GPU in the working dir",
    "--nvtx-verbose": "NVTX ranges are not built; profile with nsys around the run",
}


# Hugging Face generate()'s names for what a flag here calls as NVIDIA's demo does: a user of generate() types these
SYNONYMS = {
    "--max-new-tokens": ("--output-seq-len", "generate()'s max_new_tokens"),
}


def synonym(flag: str, options) -> str | None:
    """What to say of `flag` where the action lacks it but takes its synonym (`options`: the action's option
    strings): "--max-new-tokens, generate()'s max_new_tokens, is --output-seq-len here, ..."; None otherwise."""
    target, what = SYNONYMS.get(flag, (None, None))
    if target is None or target not in options:
        return None
    return f"{flag}, {what}, is {target} here, as NVIDIA's demo names it"


def hint(message: str) -> str:
    """`message` (argparse's) with what replaces each demo flag it names as unrecognized."""
    match = re.match(r"unrecognized arguments: (.*)", message)
    if not match:
        return message
    flags = dict.fromkeys(word.split("=")[0] for word in match.group(1).split())
    notes = [f"NVIDIA's demo's {flag}: {REPLACED[flag]}" for flag in flags if flag in REPLACED]
    return message + (" (" + "; ".join(notes) + ")" if notes else "")
