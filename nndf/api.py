"""Every command-line action from Python: `nndf.run("benchmark", "GPT2", "frameworks", "onnxrt", variant="gpt2")`.

Notebooks and scripts want the actions' tables without a shell, and with the same flags, checks and defaults as
`python run.py`: one place builds the argument list from keywords and hands it to the CLI's own parser, so that an
action gains a flag once. `nndf.load` (nndf.model) is the lower level: one model on one backend, to generate with.
"""

from __future__ import annotations

import argparse
import io

from nndf.errors import UsageError
from nndf.results import Result


def _argv(flags: dict, options: dict, action: str, parsers: dict) -> list[str]:
    """Keywords as command-line flags: `output_seq_len=32` -> `--output-seq-len 32`, `random_weights=True` ->
    `--random-weights` (False: left out), `use_cache=False` -> `--no-use-cache` (a flag with a `--no-` form), a list
    -> the flag followed by each value, None -> left out. `options`: the action's option strings and their argparse
    actions; `parsers`: every action's parser (a flag of another action is named as such)."""
    argv: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if flag not in options:
            raise UsageError(f"{key}= is not a flag of {action}{_elsewhere(flag, options, action, parsers)}; see "
                             f"python run.py {action} --help")
        switch = options[flag].nargs == 0  # store_true and --x/--no-x take no value
        if value is None:
            continue
        if switch != isinstance(value, bool):
            wanted = "True or False" if switch else "a value (a number, a word or a path; a list for several)"
            raise UsageError(f"{key}= takes {wanted}, not {value!r}")
        if "--" in (value if isinstance(value, (list, tuple)) else [value]):
            raise UsageError(f"{key}= cannot take '--': the command line's parser reads it as the end of flags")
        if value is True:
            argv.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in options:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)) and isinstance(options[flag], argparse._AppendAction):  # and extend
            argv += [f"{flag}={v}" for v in value]  # `--stop=--`: a value that starts with "-" stays a value
        elif isinstance(value, (list, tuple)):
            if options[flag].nargs in (None, "?"):  # one value: argparse would take the first, and refuse the rest
                raise UsageError(f"{key}= takes one value, not a list: got {list(value)!r}")
            argv += [flag, *(str(v) for v in value)]
        else:
            argv.append(f"{flag}={value}")
    return argv


def _elsewhere(flag: str, options: dict, action: str, parsers: dict) -> str:
    """What to suggest for a flag `action` lacks: the actions that have it, else a close name among its own."""
    from nndf.cli import actions_with_flag
    from nndf.demo_flags import SYNONYMS

    target = SYNONYMS.get(flag, (None,))[0]
    if target in options:  # max_new_tokens=: what the action calls it, as NVIDIA's demo does
        return f" (write {target[2:].replace('-', '_')}= here: {flag[2:].replace('-', '_')} is its name in generate())"
    others = actions_with_flag(flag, parsers, action)
    if others:
        return f" (it is a flag of {', '.join(others)})"
    import difflib

    long = [name for name in sorted(options) if name.startswith("--")]  # keywords are the long flags' names
    short = options.get("-" + flag[2:])  # o= for -o: its long flag's keyword (output=)
    close = [name for name in short.option_strings if name in long] if short is not None else []
    close = close or difflib.get_close_matches(flag, long, n=1)
    return f" (did you mean {close[0][2:].replace('-', '_')}=?)" if close else ""


def run(action: str, model: str | None = None, *backends: str, input: str | list[str] | None = None,
        **flags) -> list[Result]:
    """Run `python run.py ACTION MODEL BACKEND... --flags` in this process and return its results (tables as
    `Result`s: `.rows` raw values, `.render()` the text the command prints, `.to_dict()` its JSON).

    Flags are keywords with underscores for dashes (`nndf.run("accuracy", "GPT2", "frameworks", torch_dir=...,
    num_samples=100)`); a flag the action does not know, or a bad value, raises `UsageError` with the sentence the
    command line prints, and a runtime failure `HarnessError`. `input`: for `chat`, the lines it answers (what it
    reads from stdin on the command line), as one string or a list of lines. `help=True` prints the action's
    `--help` and returns no results. Ctrl-C after some backends were measured raises `nndf.interrupt.Interrupted`
    (a KeyboardInterrupt) whose `.results` are the tables of those backends.
    """
    from nndf.cli import ACTIONS, build_parser, check_given_paths, check_unused_flags

    if not isinstance(action, str) or action not in ACTIONS:
        raise UsageError(f"unknown action '{action}'; allowed: {', '.join(ACTIONS)}")
    for value in (model, *backends):
        if isinstance(value, (list, tuple)):
            raise UsageError(f"backends are separate arguments, not a list: nndf.run({action!r}, MODEL, "
                             f"'frameworks', 'onnxrt', ...) (a list L: *L); got {value!r}")
        if value is not None and not isinstance(value, str):
            raise UsageError(f"the model family and backends are names (strings), got {value!r}")
    parser = build_parser()
    options = parser.action_parsers[action]._option_string_actions
    if flags.get("help") is True:  # argparse's help would end the process (SystemExit) from inside a library call
        print(parser.action_parsers[action].format_help())
        return []
    argv = [action, *([model] if model is not None else []), *backends,
            *_argv(flags, options, action, parser.action_parsers)]
    args = parser.parse_args(argv)
    check_unused_flags(args)
    check_given_paths(args)
    if input is not None:
        if action != "chat":
            raise UsageError(f"input= is for chat, which reads prompts; {action} does not")
        if isinstance(input, (list, tuple)) and all(isinstance(line, str) for line in input):
            input = "".join(f"{line}\n" for line in input)
        if not isinstance(input, str):
            raise UsageError(f"input= takes the chat's lines as one string or a list of strings, not {input!r}")
        return args.run_action(args, stream=io.StringIO(input))
    return args.run_action(args)
