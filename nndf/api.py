"""Every command-line action from Python: `nndf.run("benchmark", "GPT2", "frameworks", "onnxrt", variant="gpt2")`.

Notebooks and scripts want the actions' tables without a shell, and with the same flags, checks and defaults as
`python run.py`: one place builds the argument list from keywords and hands it to the CLI's own parser, so that an
action gains a flag once. `nndf.load` (nndf.model) is the lower level: one model on one backend, to generate with.
"""

from __future__ import annotations

import io

from nndf.errors import UsageError
from nndf.results import Result


def _argv(flags: dict, known: set[str]) -> list[str]:
    """Keywords as command-line flags: `output_seq_len=32` -> `--output-seq-len 32`, `random_weights=True` ->
    `--random-weights` (False: left out), `use_cache=False` -> `--no-use-cache` (a flag with a `--no-` form), a list
    -> the flag followed by each value, None -> left out. `known`: the action's option strings."""
    argv: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if flag not in known:
            import difflib

            close = difflib.get_close_matches(flag, sorted(known), n=1)
            hint = f" (did you mean {close[0][2:].replace('-', '_')}=?)" if close else ""
            raise UsageError(f"{key}= is not a flag of this action{hint}; see python run.py ACTION --help")
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in known:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def run(action: str, model: str | None = None, *backends: str, input: str | None = None, **flags) -> list[Result]:
    """Run `python run.py ACTION MODEL BACKEND... --flags` in this process and return its results (tables as
    `Result`s: `.rows` raw values, `.render()` the text the command prints, `.to_dict()` its JSON).

    Flags are keywords with underscores for dashes (`nndf.run("accuracy", "GPT2", "frameworks", torch_dir=...,
    num_samples=100)`); a flag the action does not know, or a bad value, raises `UsageError` with the sentence the
    command line prints, and a runtime failure `HarnessError`. `input`: for `chat`, the lines it answers (what it
    reads from stdin on the command line).
    """
    from nndf.cli import ACTIONS, build_parser, check_given_paths, check_unused_flags

    if action not in ACTIONS:
        raise UsageError(f"unknown action '{action}'; allowed: {', '.join(ACTIONS)}")
    parser = build_parser()
    known = set(parser.action_parsers[action]._option_string_actions)
    argv = [action, *([model] if model is not None else []), *backends, *_argv(flags, known)]
    args = parser.parse_args(argv)
    check_unused_flags(args)
    check_given_paths(args)
    if input is not None:
        if action != "chat":
            raise UsageError(f"input= is for chat, which reads prompts; {action} does not")
        return args.run_action(args, stream=io.StringIO(input))
    return args.run_action(args)
