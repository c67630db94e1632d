"""bench/decoder_gpu.py: its report and goals, checked on the CPU engines of a tiny model (the timings themselves are
GPU figures and live in bench/README.md, never in tests)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from conftest import REPO


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


decoder_gpu = _load(REPO / "bench" / "decoder_gpu.py")


def _cpu_check(capsys, tiny_gpt2_dir, tmp_path, output_len: int, *flags) -> tuple[str, dict]:
    """decoder_gpu.py's --device cpu check on the tiny GPT-2 at batches 1 and 2, one round: (its output, its JSON)."""
    out_json = tmp_path / "gpu.json"
    code = decoder_gpu.main(["--device", "cpu", "--torch-dir", str(tiny_gpt2_dir), "--batch-sizes", "1", "2",
                             "--input-len", "5", "--output-len", str(output_len), "--rounds", "1", "--json",
                             str(out_json), *flags])
    assert code == 0
    return capsys.readouterr().out, json.loads(out_json.read_text())


def test_cpu_check_run_reports_every_engine_and_skips_the_cuda_ones(tiny_gpt2_dir, tmp_path, capsys):
    out, report = _cpu_check(capsys, tiny_gpt2_dir, tmp_path, 4, "--engines", "hf-eager", "hf-compile", "ours-eager",
                             "ours-static", "ours-cuda-graph")
    assert "## batch 1" in out and "## batch 2" in out
    for engine in ("hf-eager", "ours-eager", "ours-static"):
        assert engine in out
    assert "skipped ours-cuda-graph: CUDA graphs need a CUDA device" in out
    assert "skipped hf-compile: transformers compiles its static-cache step on CUDA only" in out
    assert "PASS tokens equal hf-eager's" in out
    assert "SKIP ours-cuda-graph / hf-compile ms per step: a row it needs did not run" in out
    rows = report["batches"]["2"]
    assert set(rows) == {"hf-eager", "ours-eager", "ours-static"}
    assert all(r["tokens"] == "identical" and r["step_ms"] is not None for r in rows.values())
    assert report["floor_ms"] > 0 and report["weight_bytes"] > 0


def test_sample_gives_each_engine_a_seeded_sampled_twin_timed_beside_it(tiny_gpt2_dir, tmp_path, capsys):
    """--sample: each engine also runs generate(do_sample=True) (top-k 50, --top-p), seeded; ours draws what
    Hugging Face's draws, and `/ greedy` is its step over its own greedy step."""
    out, report = _cpu_check(capsys, tiny_gpt2_dir, tmp_path, 6, "--engines", "hf-eager", "ours-eager", "--sample",
                             "--top-p", "0.9")
    rows = report["batches"]["2"]
    assert list(rows) == ["hf-eager", "hf-eager sampled", "ours-eager", "ours-eager sampled"]
    assert all(r["tokens"] == "identical" for r in rows.values())
    assert report["sampling"] == {"do_sample": True, "top_k": 50, "top_p": 0.9}
    assert "/ greedy" in out and "PASS our sampled tokens equal hf-eager sampled's" in out
    # the twin really samples, seeded: the same draws each time, not greedy's tokens
    from nndf.loading import load_model
    from nndf.registry import resolve
    from nndf.spec import BuildSettings

    spec, variant = resolve("GPT2", None)
    loaded = load_model(spec, variant, torch_dir=str(tiny_gpt2_dir), device=torch.device("cpu"))
    run = decoder_gpu.make_engine("ours-eager", loaded, BuildSettings(batch_size=2), decoder_gpu.argparse.Namespace(
        device="cpu", working_dir=str(tmp_path)))
    inputs = decoder_gpu.prompts(loaded, 2, 5)
    sampled = dict(report["sampling"])
    assert torch.equal(run(inputs, 12, sampled), run(inputs, 12, sampled))
    assert not torch.equal(run(inputs, 12, sampled), run(inputs, 12, {}))


@pytest.mark.parametrize("argv", [["--top-p", "0.9"], ["--sample", "--top-p", "1.5"]])
def test_top_p_needs_sample_and_a_share(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        decoder_gpu.main(["--device", "cpu", *argv])
    assert stop.value.code == 2 and "--top-p applies to --sample and lies in (0, 1]" in capsys.readouterr().err


def test_goals_pass_and_fail_from_the_figures():
    rows = {"hf-eager": {"step_ms": 7.0, "tokens": "identical"}, "hf-compile": {"step_ms": 2.5, "tokens": "identical"},
            "ours-eager": {"step_ms": 7.5, "tokens": "identical"},
            "ours-cuda-graph": {"step_ms": 0.9, "tokens": "90% equal"}}
    report = {"family": "GPT2", "variant": "gpt2", "floor_ms": 0.08, "batches": {1: rows}}
    lines = "\n".join(decoder_gpu.goal_lines(report))
    assert "FAIL ours-eager / hf-eager ms per step: 1.07 (bound 1.0)" in lines
    assert "PASS ours-cuda-graph / hf-compile ms per step: 0.36 (bound 0.4)" in lines
    assert "FAIL tokens equal hf-eager's (not: ['ours-cuda-graph'])" in lines
    xl = "\n".join(decoder_gpu.goal_lines(dict(report, variant="gpt2-xl", floor_ms=0.25)))
    assert "FAIL ours-cuda-graph / hf-compile ms per step: 0.36 (bound 0.8)" not in xl
    assert "FAIL ours-cuda-graph / floor: 3.60 (bound 3.0)" in xl
    assert "goals: not measured" in "\n".join(decoder_gpu.goal_lines(dict(report, batches={8: rows})))


@pytest.mark.parametrize("argv, needle", [
    (["--output-len", "1", "--device", "cpu"], "--output-len must be at least 2"),
    pytest.param(["--device", "cuda"], "no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
    (["--family", "BLIP", "--device", "cpu"], "BLIP captions images"),
])
def test_bad_requests_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as stop:
        code = decoder_gpu.main(argv)
        raise SystemExit(code)
    assert stop.value.code == 2
    assert needle in capsys.readouterr().err
