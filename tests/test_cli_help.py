"""`run.py ACTION --help`: every action's flags, the defaults set in an action's own code, and the shared flags an
action refuses left out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from nndf.cli import main


def test_help_lists_actions_and_flags():
    proc = subprocess.run([sys.executable, str(REPO / "run.py"), "benchmark", "--help"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0
    for flag in ("--variant", "--working-dir", "--torch-dir", "--batch-size", "--fp16", "--use-cache",
                 "--use-mask", "--num-beams", "--dynamic-batch", "--engine-postfix", "--iterations",
                 "--number", "--warmup", "--duration", "--percentile", "--input-seq-len", "--output-seq-len",
                 "--json", "--info", "--random-weights"):
        assert flag in proc.stdout
    assert "(default 64; image-to-text families: none, no text prefix)" in " ".join(proc.stdout.split())
    sections = dict(part.split(":\n", 1) for part in proc.stdout.split("\n\n") if ":\n" in part)
    assert "--plot FILE.png" in sections["output"] and "--image PATH" in sections["image-to-text"]
    assert "--plot" not in sections["options"] and "--image" not in sections["options"]


def test_flags_an_action_refuses_are_not_in_its_help(capsys):
    for action, flag, kept in (("accuracy", "--num-beams", "--batch-size"), ("run", "--input-seq-len", "--num-beams"),
                               ("chat", "--batch-size", "--output-seq-len")):
        with pytest.raises(SystemExit):
            main([action, "--help"])
        out = capsys.readouterr().out
        listed = [line.split()[0] for line in out.splitlines() if line.lstrip().startswith("--")]
        assert flag not in listed and kept in listed and f"[{flag}" not in out, (action, flag)


def test_help_gives_the_new_tokens_a_sample_run_generates(capsys):
    """run and compare have no --output-seq-len default in the parser (each sample's label sets it): --help says so."""
    for action in ("run", "compare"):
        with pytest.raises(SystemExit):
            main([action, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "(default: each sample's label length, or 32 for a sample without a label)" in out, action
