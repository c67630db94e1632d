"""Promises the README makes: CI runs its test command, the API example works, the packaging layout holds."""

from __future__ import annotations

import re
import sys

import torch

from conftest import REPO, TOKENIZER_DIR, needs_shared

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def quickstart_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.+?)\n```", section)


def test_quickstart_is_two_commands_and_ci_runs_the_second():
    commands = quickstart_commands()
    assert len(commands) == 2
    assert "--random-weights" in commands[0] and "benchmark GPT2" in commands[0]
    assert "torch==2.13.0" in commands[0] and "torch==2.13.0" in commands[1]
    ci_script = (REPO / ".ci" / "run").read_text()
    assert commands[1] in ci_script.splitlines()


def test_packaging_keeps_models_inside_nndf():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert all(p == "nndf" or p.startswith("nndf.") for p in packages)
    assert project["tool"]["setuptools"]["package-dir"]["nndf.models"] == "models"
    extras = project["project"]["optional-dependencies"]
    assert "onnxruntime-gpu" not in " ".join(extras["onnxruntime"])
    assert not any(dep.startswith("onnxruntime") for dep in project["project"]["dependencies"])
    for family_dir in (REPO / "models").iterdir():
        if (family_dir / "__init__.py").exists():
            assert f"nndf.models.{family_dir.name}" in packages


def test_wheel_holds_every_package_and_checkpoint(tmp_path):
    """A non-editable install gets every package (models under nndf.models) and each family's checkpoint.toml."""
    import subprocess
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("nndf-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"nndf/{p.relative_to(REPO / 'nndf')}" for p in (REPO / "nndf").rglob("*.py")}
    expected |= {f"nndf/models/{p.relative_to(REPO / 'models')}" for p in (REPO / "models").rglob("*.py")}
    expected |= {f"nndf/models/{p.relative_to(REPO / 'models')}" for p in (REPO / "models").rglob("checkpoint.toml")}
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("models/") for n in names), "models must not be a top-level package"


@needs_shared(TOKENIZER_DIR)
def test_readme_api_example(tiny_gpt2_dir):
    import nndf

    m = nndf.load("GPT2", variant="gpt2", backend="frameworks", torch_dir=str(tiny_gpt2_dir), random_weights=False,
                  working_dir="temp", use_cache=True, fp16=False)
    input_ids = torch.tensor([[464, 3139, 286, 4881, 318]])
    out = m.generate(input_ids, attention_mask=None, max_new_tokens=8, min_new_tokens=0, num_beams=1)
    assert out.dtype == torch.long and out.shape == (1, 13)
    assert torch.equal(out[:, :5], input_ids)
    assert torch.equal(out, m.hf_generate(input_ids, max_new_tokens=8))
    # the sampling example
    from transformers import TextStreamer

    out = m.generate(input_ids, attention_mask=None, max_new_tokens=32, do_sample=True, temperature=0.8, top_k=40,
                     top_p=0.9, repetition_penalty=1.1, seed=4321, streamer=TextStreamer(m.tokenizer, skip_prompt=True))
    torch.manual_seed(4321)
    assert torch.equal(out, m.hf_generate(input_ids, max_new_tokens=32, do_sample=True, temperature=0.8, top_k=40,
                                          top_p=0.9, repetition_penalty=1.1))
    # the rules example: per call, and in a GenerationConfig that a keyword overrides
    from transformers import GenerationConfig

    rules = dict(max_new_tokens=32, num_beams=4, no_repeat_ngram_size=3, length_penalty=0.8, early_stopping=True,
                 min_length=10, forced_eos_token_id=50256)
    assert torch.equal(m.generate(input_ids, **rules), m.hf_generate(input_ids, **rules))
    config = dict(generation_config=GenerationConfig(num_beams=4, no_repeat_ngram_size=3, max_new_tokens=32),
                  no_repeat_ngram_size=2)
    assert torch.equal(m.generate(input_ids, **config), m.hf_generate(input_ids, **config))


def test_importing_nndf_does_not_import_tensorrt_or_torch():
    import subprocess

    code = "import sys, nndf, nndf.registry, nndf.cli; print('tensorrt' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout
    assert out.split() == ["False", "False"]
