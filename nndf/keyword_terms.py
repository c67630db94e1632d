"""Usage errors in the Python API's terms: `nndf.load(...)` raises "output_seq_len=100000 leaves no position ..."
where the command line says "--output-seq-len 100000 leaves no position ...".

Why here and not in each message: the checks behind a load (build settings, paths, backend options) are the
command line's own, shared so that both front ends refuse the same things, and their sentences name the flags. A
Python user has no flags to look up, so `nndf.load` rewrites each flag into the keyword it took. The other way
round for `BuildSettings`, which a Python user builds directly: its checks name its fields, and the command line
rewrites them into its flags (`in_flag_terms`).
"""

from __future__ import annotations

import functools
import re

from nndf.errors import UsageError

# Flags that are switches: written as keyword=True (or the value they stand for).
SWITCHES = {"--int8": "quantize='int8'", "--int4": "quantize='int4'", "--no-use-cache": "use_cache=False"}
_SWITCH_NAMES = {"fp16", "use_cache", "random_weights", "cuda_graph", "dynamic_batch", "use_mask"}
# Flags whose value is a word, and the words that are their values (a sentence goes on after the flag with others).
_WORD_VALUES = {"kv_layout": r"shared|growing", "tgt_lang": r"[a-z]{2}_[A-Z]{2}"}
# A flag, and the value after it: a number, a path or a word.
_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?: (-?\d[\w.]*|[/~.][^\s,;:()]*|[A-Za-z_]+))?")


def in_keyword_terms(message: str, keywords: set[str]) -> str:
    """`message` with each command-line flag whose keyword is among `keywords` (or one of SWITCHES) written as that
    keyword (and its value) as the Python API takes it; other flags stay as they are."""

    def keyword(match: re.Match) -> str:
        flag, value = match.group(0).split(" ")[0], match.group(2)
        name = match.group(1).replace("-", "_")
        if flag in SWITCHES:
            return SWITCHES[flag] + (f" {value}" if value else "")
        if name not in keywords:
            return match.group(0)
        if value is not None and (value[0].isdigit() or value[0] == "-"):
            return f"{name}={value}"
        if value is not None and (value[0] in "/~." or re.fullmatch(_WORD_VALUES.get(name, "(?!)"), value)):
            return f"{name}={value!r}"
        rest = f" {value}" if value is not None else ""
        return (f"{name}=True" if name in _SWITCH_NAMES else name) + rest

    return _FLAG.sub(keyword, message)


def in_flag_terms(message: str, names: set[str]) -> str:
    """`message` with each of `names` (keywords, as `batch_size` or `batch_size=8`) written as the command line's
    flag (`--batch-size`, `--batch-size 8`)."""
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))

    def flag(match: re.Match) -> str:
        value = match.group(2)
        return "--" + match.group(1).replace("_", "-") + (f" {value}" if value is not None else "")

    return re.sub(rf"\b({alternatives})\b(?:=([^\s,;:()]+))?", flag, message)


def speaks_keywords(keywords: set[str]):
    """A decorator: the function's UsageErrors re-raised in `keywords`' terms (the same exception, its traceback
    kept)."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except UsageError as exc:
                exc.args = (in_keyword_terms(str(exc), keywords),)
                raise

        return wrapper

    return decorate
