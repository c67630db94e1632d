"""bench/decoder_cpu.py's CPU peers (bench/harness/llamacpp.py, genai.py, peer_weights.py, peers.py): the peers'
weights folder and its fitted tokenizer, llama-batched-bench's command and output, the tool's peak memory, the
GenAI builder's refusal and thread setting, the SKIP paths (no cmake, no network), the peer ratios and goals.
Nothing here builds llama.cpp or installs ONNX Runtime GenAI: a fake tool stands in for llama-batched-bench."""

from __future__ import annotations

import json
import stat
import sys
import types

import pytest

from test_bench import MiB, _report, _statuses, bench

from harness import genai, llamacpp, peers  # noqa: E402  (on sys.path once test_bench loaded the script)
from harness.engines import EngineError  # noqa: E402
from harness.peer_weights import PeerWeightsError, fit_tokenizer, peer_config, peer_weights  # noqa: E402

# ------------------------------------------------------------------------------------------- the peers' folder


def _bpe(vocab: list[str], merges: list[str], specials=("<|endoftext|>",)) -> dict:
    ids = {tok: i for i, tok in enumerate(vocab)}
    added = [{"id": len(vocab) + i, "content": s, "special": True} for i, s in enumerate(specials)]
    ids.update({t["content"]: t["id"] for t in added})
    return {"added_tokens": added, "model": {"type": "BPE", "vocab": ids, "merges": merges}}


def test_a_tokenizer_is_cut_to_the_vocabulary_with_its_specials_last():
    byte_tokens = [chr(0x100 + i) for i in range(256)]  # 256 stand-ins for the byte alphabet
    a, b = byte_tokens[:2]
    tokenizer = _bpe(byte_tokens + [a + b, a + b + a, b + b], [f"{a} {b}", f"{a + b} {a}", f"{b} {b}"])
    assert fit_tokenizer(tokenizer, 260) is tokenizer  # fits already (259 tokens + 1 special)
    cut = fit_tokenizer(tokenizer, 258)  # room for the bytes, one merge and the special
    vocab = cut["model"]["vocab"]
    assert max(vocab.values()) == 257 and vocab["<|endoftext|>"] == 257 and vocab[a + b] == 256
    assert a + b + a not in vocab and cut["model"]["merges"] == [f"{a} {b}"]
    assert cut["added_tokens"][0]["id"] == 257
    with pytest.raises(PeerWeightsError, match="too small"):
        fit_tokenizer(tokenizer, 200)


def test_gpt2_configs_gain_n_ctx_and_the_peer_folder_links_the_weights(tmp_path, monkeypatch):
    assert peer_config({"model_type": "gpt2", "n_positions": 1024})["n_ctx"] == 1024
    assert "n_ctx" not in peer_config({"model_type": "llama", "max_position_embeddings": 8192})
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64, "vocab_size": 258}))
    (weights / "model.safetensors").write_bytes(b"weights")
    source = tmp_path / "tok"
    source.mkdir()
    byte_tokens = [chr(0x100 + i) for i in range(256)]
    (source / "tokenizer.json").write_text(json.dumps(_bpe(byte_tokens + ["xy", "xyz"], [])))
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    monkeypatch.setattr("harness.peer_weights.SHARED_TOKENIZER", source)
    folder = peer_weights(weights, tmp_path / "work")
    assert (folder / "model.safetensors").is_symlink() and (folder / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((folder / "config.json").read_text())["n_ctx"] == 64
    written = json.loads((folder / "tokenizer.json").read_text())
    assert max(written["model"]["vocab"].values()) == 257
    assert json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]["257"]["content"] == \
        "<|endoftext|>"
    assert peer_weights(weights, tmp_path / "work") == folder  # made once
    monkeypatch.setattr("harness.peer_weights.SHARED_TOKENIZER", tmp_path / "absent")
    with pytest.raises(PeerWeightsError, match="needs? a tokenizer"):
        peer_weights(weights, tmp_path / "other")


# ----------------------------------------------------------------------------------------------- llama.cpp

JSONL = ('{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
         '"n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 63, "pl": 4, "n_kv": 508, "t_pp": 0.480000, '
         '"speed_pp": 533.3, "t_tg": 1.260000, "speed_tg": 200.0, "t": 1.740000, "speed": 292.0}')


def test_batched_bench_command_and_its_jsonl_line():
    cmd = llamacpp.bench_command("llama-batched-bench", "m.gguf", 4, 64, 63, 2)
    assert cmd == ["llama-batched-bench", "-m", "m.gguf", "-c", "508", "-npp", "64", "-ntg", "63", "-npl", "4",
                   "--output-format", "jsonl", "-t", "2"]
    assert "-t" not in llamacpp.bench_command("b", "m", 1, 64, 63, None)
    result = llamacpp.parse_bench("main: loaded\n" + JSONL + "\n\nllama_perf_context_print: ...", 4, 64, 63)
    assert result["ttft_s"] == pytest.approx(0.48) and result["step_median_s"] == pytest.approx(0.02)
    assert result["e2e_s"] == pytest.approx(1.74) and result["marks"] == 64 and result["tokens"] is None
    with pytest.raises(ValueError, match="no result line for batch 1"):
        llamacpp.parse_bench(JSONL, 1, 64, 63)


def test_no_cmake_or_no_network_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    with pytest.raises(llamacpp.LlamaCppError, match="cmake is not on PATH"):
        llamacpp.build(tmp_path / "llama.cpp", tmp_path / "build.log", print)
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: f"/usr/bin/{name}")
    calls = []

    def offline(cmd, log, timeout, env=None, cwd=None):
        calls.append(cmd)
        log.write_text("ERROR: Could not find a version that satisfies the requirement llama-cpp-python\n")
        return 1

    monkeypatch.setattr(llamacpp, "run_logged", offline)
    with pytest.raises(llamacpp.LlamaCppError, match=r"pip download of llama-cpp-python==\S+ failed \(no network\?\)"):
        llamacpp.build(tmp_path / "llama.cpp", tmp_path / "build.log", print)
    assert calls[0][1:4] == ["-m", "pip", "download"]


def test_a_failed_build_is_tried_once_and_the_rows_say_why(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "_FAILED", {})
    tries = []

    def no_cmake(root, log, say):
        tries.append(root)
        raise llamacpp.LlamaCppError("cmake is not on PATH (needed to build llama.cpp)")

    monkeypatch.setattr(llamacpp, "build", no_cmake)
    for engine in ("llamacpp-f32", "llamacpp-q4_0"):
        with pytest.raises(EngineError, match="cmake is not on PATH"):
            peers.llamacpp_setup(engine, None, tmp_path / "w", tmp_path, tmp_path, {})
    assert len(tries) == 1
    report = _report({1: {"hf": (40.0, 25.0), "onnxrt": (20.0, 45.0)}}, memory={"hf": 1, "onnxrt": 1},
                     failed={"llamacpp-f32": "cmake is not on PATH (needed to build llama.cpp)"})
    text = bench.render_report(report)
    assert "llamacpp-f32: not run: cmake is not on PATH" in text
    assert "SKIP  batch 1 onnxrt decode ms/step / llamacpp-f32 (goal <= 0.85x): llamacpp-f32 did not run: cmake" in text


FAKE_TOOL = '''#!{python}
import sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
hold = bytearray(40 * 2**20)  # 40 MiB, touched
for i in range(0, len(hold), 4096):
    hold[i] = 1
print("build: fake", file=sys.stderr)
print('{{"pp": %s, "tg": %s, "pl": %s, "flash_attn": 0, "t_pp": 0.2, "t_tg": 0.63}}' % (args["-npp"], args["-ntg"],
      args["-npl"]))
'''


def test_the_llamacpp_worker_runs_the_tool_and_reports_its_peak_memory(tmp_path):
    tool = tmp_path / "llama-batched-bench"
    tool.write_text(FAKE_TOOL.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    runner = llamacpp.LlamaCppRunner(types.SimpleNamespace(peer_tool=str(tool), peer_model="m.gguf", threads=None))
    result = runner.commands["generate"]({"cmd": "generate", "input_ids": [[1] * 8, [2] * 8], "new_tokens": 4})
    assert (result["ttft_s"], result["step_median_s"], result["marks"]) == (0.2, pytest.approx(0.21), 4)
    memory = runner.commands["memory"]({"cmd": "memory"})
    assert memory["peak_rss_bytes"] > 40 * MiB and memory["rss_file_bytes"] > 0


# -------------------------------------------------------------------------------------- ONNX Runtime GenAI

def test_genai_pins_the_runtime_and_reads_the_builders_refusal():
    reqs = genai.requirements({"onnxruntime": "1.32.0", "transformers": "5.24.0"})
    assert f"onnxruntime-genai=={genai.GENAI_VERSION}" in reqs and "onnxruntime==1.32.0" in reqs
    assert "transformers==5.24.0" in reqs
    log = "Traceback (most recent call last):\n...\nNotImplementedError: The GPT2LMHeadModel model is not supported.\n"
    assert genai.builder_refusal(log) == "The GPT2LMHeadModel model is not supported."
    assert genai.builder_refusal("Killed\n") is None
    config = {"model": {"decoder": {"session_options": {"log_id": "x"}}}}
    assert genai.with_threads(config, 2)["model"]["decoder"]["session_options"] == {"log_id": "x",
                                                                                   "intra_op_num_threads": 2}
    assert "intra_op_num_threads" not in genai.with_threads(genai.with_threads(config, 2), None)["model"]["decoder"][
        "session_options"]


def test_genai_on_gpt2_is_refused_before_its_venv_is_made(tmp_path, monkeypatch):
    """Every default GPT-2 run used to install GenAI's venv (minutes, over 1 GB) only to read the builder's refusal."""
    monkeypatch.setattr(peers, "_FAILED", {})
    monkeypatch.setattr(peers, "venv_environment", lambda *a, **k: pytest.fail("the venv was made"))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(EngineError, match=r"The GPT2LMHeadModel model is not supported \(onnxruntime-genai "):
        peers.genai_setup("genai-int4", None, tmp_path, tmp_path / "w", tmp_path, {})
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert genai.known_refusal(tmp_path) is None


# ------------------------------------------------------------------------------------- ratios against the peers

def test_peer_ratios_and_goals_on_made_up_numbers():
    report = _report(
        {1: {"hf": (45.0, 20.0), "onnxrt": (17.0, 50.0), "onnxrt-int8": (9.0, 90.0), "onnxrt-int4": (7.0, 100.0),
             "llamacpp-f32": (20.0, 45.0), "llamacpp-q8_0": (10.0, 85.0), "llamacpp-q4_0": (8.0, 95.0),
             "genai": (30.0, 30.0), "genai-int4": (8.5, 90.0)}},
        memory={"hf": 1000 * MiB, "onnxrt": 990 * MiB, "llamacpp-f32": 600 * MiB})
    report["peer_ratios"] = bench.peer_ratios(report)
    pairs = {(r["engine"], r["peer"]): r for r in report["peer_ratios"]}
    assert pairs[("onnxrt", "llamacpp-f32")]["step_ms"] == pytest.approx(0.85)
    assert pairs[("onnxrt-int4", "genai-int4")]["tok_s"] == pytest.approx(100 / 90)
    statuses = _statuses(report)
    assert statuses["batch 1 onnxrt decode ms/step / llamacpp-f32"] == "PASS"         # 0.85
    assert statuses["batch 1 onnxrt-int8 decode ms/step / llamacpp-q8_0"] == "FAIL"   # 0.90
    assert statuses["batch 1 onnxrt-int4 decode ms/step / genai-int4"] == "PASS"      # 0.82
    assert statuses["batch 1 onnxrt first token ms / llamacpp-f32"] == "FAIL"         # 1.00 (all 50 ms here)
    assert statuses["onnxrt peak memory / hf"] == "PASS"                              # 0.99
    text = bench.render_report(report)
    assert text.index("against the peers") < text.index("peak memory of each worker") < text.index("GOALS")
    assert any(line.split() == ["1", "onnxrt", "llamacpp-f32", "0.85x", "1.00x", "1.11x"] for line in text.splitlines())
