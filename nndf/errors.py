"""The two kinds of failure a user sees, so that the CLI can turn each into one sentence and an exit code.

`UsageError` is the user's input being wrong (a flag, a name, a path): exit code 2, like argparse.
`HarnessError` is a well-understood runtime failure (a model cannot be loaded offline, a backend is missing on
this machine): exit code 1. Anything else is a bug and keeps its traceback.
"""

import argparse


class UsageError(ValueError):
    """Bad input from the user: the message names what was wrong and what is allowed."""

    exit_code = 2


class HarnessError(RuntimeError):
    """A failure with a known cause that is not the user's typing: the message says what to do."""

    exit_code = 1


class OneSentenceParser(argparse.ArgumentParser):
    """argparse, but a usage error is one sentence and exit 2 (a UsageError) without the usage dump."""

    def error(self, message: str):
        raise UsageError(message)
