"""The command line as a user meets it: tables, JSON, and one-sentence errors with exit code 2."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

import nndf
from conftest import LAMBADA_FILE, REPO, TINY_GPT2, TOKENIZER_DIR, build_tiny, needs_shared
from nndf.cli import main
from nndf.machine import cpu_description
from nndf.errors import UsageError

FAST = ["--iterations", "2", "--warmup", "1"]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_shows_every_variant(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "openai-community/gpt2-xl"):
        assert name in out
    # each row says what kind of generator the family is; the backends, the same for every family, are one note
    kinds = {line.split()[0]: line.split()[-1] for line in out.splitlines()
             if line.split() and line.split()[-1] in ("decoder-only", "encoder-decoder", "image-to-text")}
    assert kinds["GPT2"] == "decoder-only" and kinds["T5"] == "encoder-decoder" and kinds["BLIP"] == "image-to-text"
    assert out.count("frameworks") == 1 and "backends: frameworks, onnxrt, trt (every family)" in out


def test_benchmark_table_and_json(capsys, tiny_gpt2_dir, tmp_path):
    out_file = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    code, out, err = run_cli(capsys, "benchmark", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                             "--input-seq-len", 8, "--output-seq-len", 5, "--batch-size", 2, *FAST,
                             "--json", out_file, "--plot", plot, "--number", 2)
    assert code == 0, err
    assert "per backend (each the mean of 2 generations, --number)" in " ".join(out.split())
    from PIL import Image

    with Image.open(plot) as image:  # one figure: decode ms/step and tokens/s, a bar per backend
        assert image.format == "PNG" and image.size[0] > 2 * image.size[1] > 300
    assert f"plot written to {plot}" in out and not list(tmp_path.glob(".bench.png.*"))
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("backend"))
    rows = [line for line in lines if line.startswith("frameworks")]
    assert len(rows) == 2 and "HF generate" in rows[1]
    assert "p50 latency (ms)" in header and "throughput (tok/s)" in header and "peak memory" in header
    data = json.loads(out_file.read_text())["results"][0]
    assert data["action"] == "benchmark"
    assert [r["backend"] for r in data["rows"]] == ["frameworks", "frameworks (HF generate)"]
    for row in data["rows"]:
        assert row["latency_ms"] > 0 and row["first_token_ms"] > 0 and row["decode_ms"] > 0
        # 2 rows x 5 tokens per latency
        assert row["tokens_per_s"] == pytest.approx(10 / (row["latency_ms"] / 1e3))
        assert row["peak_bytes"] > 0
    assert data["context"]["settings"]["batch_size"] == 2
    # how tokens were picked and the prompts' seed are in the JSON too, not only in the title
    assert data["context"]["decoding"] == "greedy" and data["context"]["input_seed"] == 0
    assert [row["runs"] for row in data["rows"]] == [2, 2]
    # the machine too: figures carry over only between CPUs that agree on the kernels' flags (nndf.machine)
    # (frameworks runs on CUDA where PyTorch sees a GPU, and then the GPU is named too)
    assert data["context"]["cpu"] == cpu_description() and ("gpu" in data["context"]) == torch.cuda.is_available()


def test_info_prints_shapes(capsys, tiny_gpt2_dir):
    code, out, _ = run_cli(capsys, "benchmark", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                           "--input-seq-len", 8, "--output-seq-len", 4, "--iterations", 1, "--warmup", 0,
                           "--info")
    assert code == 0
    assert "past_key_values.{0..1}.key|value  [1, 2, 0..11, 16]" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["fly", "GPT2", "frameworks"], "unknown action 'fly'; allowed: benchmark"),
        (["benchmark", "GPT9", "frameworks"], "unknown model family 'GPT9'; allowed: GPT2"),
        (["export", "Bert", "onnxrt"], "(encoder models such as BERT, RoBERTa or MiniLM convert with: python run.py "
                                       "convert -m MODEL)"),
        (["benchmark", "GPT2", "tensorflow"], "unknown backend 'tensorflow'; allowed: frameworks, onnxrt, trt"),
        (["benchmark", "GPT2", "frameworks", "--variant", "gpt5"], "unknown --variant 'gpt5' for GPT2 (did you mean gpt2?); allowed: gpt2"),
        (["benchmark", "GPT2", "trt", "--dynamic-batch", "--min-dynamic-batch", "4",
          "--max-dynamic-batch", "2"], "--min-dynamic-batch (4) must not exceed --max-dynamic-batch (2)"),
        (["benchmark", "GPT2", "trt", "--dynamic-batch", "--batch-size", "8", "--max-dynamic-batch", "4"],
         "--batch-size 8 must lie within --min-dynamic-batch 1 and --max-dynamic-batch 4"),
        (["benchmark", "GPT2", "frameworks", "--num-beams", "0"], "--num-beams must be at least 1, got 0"),
        (["benchmark", "GPT2", "frameworks", "--random-weights", "--input-seq-len", "1000",
          "--output-seq-len", "100"], "more than the 1024 positions of this model"),
        (["benchmark", "GPT2", "frameworks", "--torch-dir", "/nonexistent/model"],
         "--torch-dir /nonexistent/model does not exist"),
        (["accuracy", "GPT2", "frameworks", "--random-weights", "--dataset-file", "/nonexistent.jsonl"],
         "/nonexistent.jsonl does not exist"),
        (["benchmark", "GPT2", "frameworks", "--iterations", "0"], "--iterations"),
        (["benchmark", "GPT2", "trt-int8"], "unknown backend 'trt-int8'; a quantized backend is one of: onnxrt-int8, "
                                            "onnxrt-int4"),
        (["benchmark", "GPT2", "onnxrt", "onnxrt-int4", "--int8"], "--int8 quantizes every onnxrt row; with a "
                                                                  "quantized backend name"),
        (["benchmark", "GPT2", "frameworks", "--batch-size", "x"], "invalid int value: 'x'"),
        (["benchmark", "GPT2", "onnxrt-int8", "--block-size", "48"],
         "--block-size must be a power of two of at least 16 (16, 32, 64, 128, ...), got 48"),
        (["benchmark", "GPT2", "onnxrt", "--int4", "--block-size", "8"], "--block-size must be a power of two"),
        (["benchmark", "GPT2", "onnxrt", "--block-size", "64"], "--block-size applies to quantized weights; add --int8 "
                                                                "or --int4"),
        (["benchmark", "GPT2", "onnxrt-int4", "--int8-method", "dynamic"], "--int8-method applies to int8 weights; "
                                                                         "add --int8 or the backend onnxrt-int8"),
        (["benchmark", "GPT2", "onnxrt-int8", "--int8-method", "fast"], "argument --int8-method: invalid choice: "
                                                                      "'fast' (choose from 'matmul-nbits', 'dynamic')"),
        (["benchmark", "GPT2", "onnxrt", "--dynamic-batch"], "--dynamic-batch shapes TensorRT engines; without trt "
                                                             "among the backends it changes nothing"),
        (["chat", "GPT2", "frameworks", "-c", "onnxrt", "--engine-postfix", "A100"],
         "--engine-postfix shapes TensorRT"),
        (["benchmark", "GPT2", "trt", "--max-dynamic-batch", "4"], "--max-dynamic-batch bounds --dynamic-batch's "
                                                                  "range: add --dynamic-batch"),
        (["export", "GPT2", "ONNX"], "unknown backend 'onnx'"),  # names in any case
        (["export", "GPT2", "Frameworks"], "frameworks runs the PyTorch model itself"),  # names in any case
        (["compare", "GPT2"], "compare needs the backends to run: name them after the model (compare GPT2 frameworks "
                              "onnxrt) or after --compare, as NVIDIA's demo does"),
        (["benchmark", "GPT2", "trt", "--output-profile-max-len", "64", "-o", "out.pkl"],
         "unrecognized arguments: --output-profile-max-len 64 -o out.pkl (NVIDIA's demo's --output-profile-max-len: "
         "--output-seq-len sets the TensorRT profile's generation range; NVIDIA's demo's -o: --json FILE writes"),
    ],
)
def test_usage_errors_are_one_sentence_and_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err


def test_malformed_dataset_line(capsys, tmp_path, tiny_gpt2_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine passage"}\n{"txt": 3}\n')
    json_out = tmp_path / "never.json"
    code, _, err = run_cli(capsys, "accuracy", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                           "--dataset-file", bad, "--json", json_out)
    assert code == 2
    assert "line 2" in err and "Traceback" not in err
    assert not json_out.exists() and list(tmp_path.iterdir()) == [bad]


def test_hub_load_offline_is_one_sentence(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(capsys, "benchmark", "GPT2", "frameworks", "--variant", "gpt2-xl")
    assert code == 1
    assert "could not load 'openai-community/gpt2-xl'" in err and "--random-weights" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("action", ["run", "chat"])
def test_a_missing_tokenizer_is_said_before_any_export(capsys, monkeypatch, tmp_path, action):
    """Offline random weights without --tokenizer-dir: the actions that need text say so at once, not after
    exporting the model (half a minute for GPT-2 small), and name what they tried once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    code, _, err = run_cli(capsys, action, "GPT2", "onnxrt", "--variant", "gpt2", "--random-weights",
                           "--working-dir", tmp_path)
    assert code == 1
    assert err.strip() == ("error: no tokenizer could be loaded (tried openai-community/gpt2); give a Hugging Face "
                           "tokenizer folder: --tokenizer-dir DIR (nndf.load(..., tokenizer_dir=DIR) in Python)")
    assert list(tmp_path.iterdir()) == []


@needs_shared(TOKENIZER_DIR)
def test_a_token_outside_the_models_vocabulary_is_one_sentence(capsys, tmp_path, monkeypatch):
    """A tokenizer of another model (GPT-2's 50257 ids for a model of 1000) is refused when it loads, before the
    chat's first line (it answered "in the" and failed at "Hello", id 15496); in the Python API an id beyond the
    vocabulary is a sentence, not a traceback from inside the embedding lookup."""
    folder = build_tiny(tmp_path, "tiny-gpt2-1000", {**TINY_GPT2, "vocab_size": 1000, "bos_token_id": 0,
                                                     "eos_token_id": 0})
    monkeypatch.setattr(sys, "stdin", io.StringIO("in the\nHello there\nin the\nexit\n"))
    code, out, err = run_cli(capsys, "chat", "GPT2", "frameworks", "--torch-dir", folder, "--output-seq-len", 2,
                             "--no-history")
    assert code == 2 and "has 50257 tokens, more than the 1000 of tiny-gpt2-1000's vocabulary" in err
    assert "[frameworks]" not in out
    model = nndf.load("GPT2", torch_dir=str(folder))
    with pytest.raises(UsageError, match="token id 1000 is outside"):
        model.generate(torch.tensor([[5, 1000]]), max_new_tokens=2)


def test_run_py_exit_code_without_traceback():
    proc = subprocess.run([sys.executable, str(REPO / "run.py"), "benchmark", "GPT2", "onnx"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: unknown backend 'onnx'; allowed: frameworks, onnxrt, trt, and with "
                                   "quantized weights onnxrt-int8, onnxrt-int4")


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """`run.py list | head -1`, `chat ... | head`: a BrokenPipeError traceback before; now no output, exit 141."""
    proc = subprocess.Popen([sys.executable, str(REPO / "run.py"), "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    proc.stdout.close()  # before the command writes a line
    err = proc.stderr.read()
    assert proc.wait() == 141 and err == ""


@needs_shared(LAMBADA_FILE)
def test_accuracy_end_to_end_on_shared_lambada(capsys, tiny_gpt2_dir, onnx_work_dir, tmp_path):
    out_file = tmp_path / "acc.json"
    code, out, err = run_cli(capsys, "accuracy", "GPT2", "frameworks", "onnxrt", "--torch-dir", tiny_gpt2_dir,
                             "--dataset-file", LAMBADA_FILE, "--num-samples", 12, "--topN", 3, "--json", out_file,
                             "--working-dir", onnx_work_dir, "--no-fidelity")
    assert code == 0, err
    assert "top-3" in out and "lm-eval acc" in out
    row, onnxrt = json.loads(out_file.read_text())["results"][0]["rows"]
    assert row["samples"] == 12
    assert 0 <= row["top1"] <= row["topN"] <= row["top10"] <= 1
    assert row["token_perplexity"] > 1 and row["lm_eval_perplexity"] > 1
    # --no-fidelity: the onnxrt figures, without the second (PyTorch) pass that compares its logits
    assert onnxrt["lm_eval_perplexity"] == pytest.approx(row["lm_eval_perplexity"], rel=1e-4)
    assert "top1_agreement" not in onnxrt and "top-1 = PyTorch" not in out and "comparing" not in err


@needs_shared(LAMBADA_FILE)
def test_accuracy_says_its_passages_are_a_seeded_random_sample(capsys, tiny_gpt2_dir, tmp_path):
    """The title said "LAMBADA, 1 passages" and neither it nor the JSON said the passages were drawn at random, nor
    with which seed."""
    out_file = tmp_path / "acc.json"
    code, out, err = run_cli(capsys, "accuracy", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                             "--dataset-file", LAMBADA_FILE, "--num-samples", 1, "--seed", 7, "--json", out_file)
    assert code == 0, err
    total = sum(1 for line in LAMBADA_FILE.read_text(encoding="utf-8").splitlines() if line.strip())
    assert f"LAMBADA, 1 passage of {total}, drawn at random with --seed 7\n" in out
    context = json.loads(out_file.read_text())["results"][0]["context"]
    assert (context["num_samples"], context["passages_in_dataset"]) == (1, total)
    assert (context["sample"], context["sample_seed"]) == ("random", 7)


def test_accuracy_title_counts_passages_in_words():
    from argparse import Namespace

    from nndf.actions.accuracy import sample_words

    assert sample_words(1, 1, Namespace(seed=None)) == "1 passage (all)"
    assert sample_words(3, 3, Namespace(seed=5)) == "3 passages (all)"
    assert sample_words(2, 9, Namespace(seed=None)) == "2 passages of 9, drawn at random with --seed 0"


@needs_shared(TOKENIZER_DIR)
def test_chat_answers_each_backend_and_ends_on_exit(capsys, tiny_gpt2_dir, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nHow are you\nexit\nnever read\n"))
    code, out, err = run_cli(capsys, "chat", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                             "--output-seq-len", 4)
    assert code == 0, err
    replies = [line for line in out.splitlines() if line.startswith("[frameworks]")]
    assert len(replies) == 2
    assert "2 replies" in out


@needs_shared(TOKENIZER_DIR)
def test_chat_ends_at_end_of_input(capsys, tiny_gpt2_dir, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("One prompt without exit"))
    code, out, _ = run_cli(capsys, "chat", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                           "--output-seq-len", 3)
    assert code == 0 and "1 reply," in out


@needs_shared(TOKENIZER_DIR)
@pytest.mark.parametrize("action, percentile", [("run", 50), ("compare", 99)])
def test_run_and_compare_on_checkpoint_samples(capsys, tiny_gpt2_dir, action, percentile):
    # compare as NVIDIA's demo writes it: the backends after --compare/-c, and its -kv
    backends = ["frameworks"] if action == "run" else ["-c", "frameworks", "-kv"]
    code, out, err = run_cli(capsys, action, "GPT2", *backends, "--torch-dir", tiny_gpt2_dir,
                             "--iterations", 1, "--warmup", 0, "--percentile", percentile)
    assert code == 0, err
    header = "full generation (ms)" if percentile == 50 else "p99 full generation (ms)"  # --percentile applies
    assert "label accuracy" in out and header in out
    summary, outputs = out.split("outputs GPT2")
    assert sum(line.startswith("frameworks") for line in summary.splitlines()) == 2
    from nndf.checkpoint import read_samples
    from nndf.registry import resolve

    samples = read_samples(*resolve("GPT2", None))
    generated = [line for line in outputs.splitlines() if line.startswith("frameworks")]
    assert len(generated) == 2 * len(samples)  # what each runner generated for each sample


def test_benchmark_and_export_with_onnxrt(capsys, tiny_gpt2_dir, onnx_work_dir, tmp_path):
    out_file = tmp_path / "b.json"
    code, out, err = run_cli(capsys, "benchmark", "GPT2", "frameworks", "onnxrt", "onnxrt-int8", "--torch-dir",
                             tiny_gpt2_dir, "--working-dir", onnx_work_dir, "--input-seq-len", 6, "--output-seq-len", 4,
                             *FAST, "--json", out_file)
    assert code == 0, err
    backends = [r["backend"] for r in json.loads(out_file.read_text())["results"][0]["rows"]]
    assert backends == ["frameworks", "frameworks (HF generate)", "onnxrt", "onnxrt int8"]  # fp32 and int8, one table
    assert "onnxrt int8" in out
    code, out, err = run_cli(capsys, "export", "GPT2", "onnxrt", "--torch-dir", tiny_gpt2_dir,
                             "--working-dir", onnx_work_dir)
    assert code == 0, err
    assert "decoder.onnx" in out and str(onnx_work_dir) in out


def test_quantization_flags_need_an_onnx_backend(capsys):
    code, _, err = run_cli(capsys, "benchmark", "GPT2", "frameworks", "--random-weights", "--int8")
    assert code == 2 and "--int8 applies to the onnxrt backend(s); add one of them" in err
    code, _, err = run_cli(capsys, "benchmark", "GPT2", "onnxrt", "--random-weights", "--int8", "--int4")
    assert code == 2 and "not allowed with argument" in err


def test_fp16_on_the_cpu_says_it_is_slow_there(capsys, tiny_gpt2_dir, no_cuda):
    """PyTorch runs half precision on the CPU, at a fraction of fp32's speed: the run goes on, with a note first."""
    code, out, err = run_cli(capsys, "benchmark", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir, "--fp16",
                             "--input-seq-len", 4, "--output-seq-len", 1, "--iterations", 1, "--warmup", 0)
    assert code == 0, err
    assert "batch 1, 4 prompt + 1 new token, greedy, fp16" in out and "4 prompt + 1 token, greedy" in err
    assert "note: fp16 (--fp16, fp16=True) on the CPU: PyTorch computes half precision far slower than fp32 here" in err


# --- bad input found when tried as a new user would (issue 13, item 6) ---------------------------------------------

def test_a_file_that_is_not_onnx_is_one_sentence(capsys, tiny_gpt2_dir, tmp_path):
    not_onnx = tmp_path / "hostname"
    not_onnx.write_text("a-machine-name\n")
    code, _, err = run_cli(capsys, "benchmark", "GPT2", "onnxrt", "--torch-dir", tiny_gpt2_dir,
                           "--decoder-onnx", not_onnx, "--working-dir", tmp_path)
    assert code == 2 and f"--decoder-onnx {not_onnx} is not an ONNX model" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3


@needs_shared(TOKENIZER_DIR)
def test_chat_reports_a_bad_line_and_goes_on(capsys, tiny_gpt2_dir, monkeypatch):
    """A prompt longer than the model's positions and a line that is not UTF-8 are reported; the next prompts are
    still answered."""
    too_long = " ".join(["word"] * 200)  # more than the tiny model's 128 positions
    raw = b"Hello there\n" + too_long.encode() + b"\n\xff\xfe not text\nHow are you\nexit\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="surrogateescape"))
    code, out, err = run_cli(capsys, "chat", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                             "--output-seq-len", 3)
    assert code == 0, err
    assert len([line for line in out.splitlines() if line.startswith("[frameworks]")]) == 2
    assert "positions" in out and "that line is not UTF-8 text" in out
    assert "Traceback" not in err


@pytest.mark.parametrize("action", ["benchmark", "compare"])
def test_plot_without_matplotlib_names_the_extra_before_any_work(capsys, tiny_gpt2_dir, tmp_path, monkeypatch,
                                                                   action):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    code, _, err = run_cli(capsys, action, "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir,
                           "--plot", tmp_path / "a.png")
    assert code == 1 and "--plot needs matplotlib, which is not installed: pip install 'nndf[plot]'" in err
    assert "loading" not in err and not (tmp_path / "a.png").exists()


@needs_shared(TOKENIZER_DIR)
def test_outputs_say_how_many_tokens_have_no_text(capsys, tmp_path):
    """A vocabulary padded past its tokenizer (Qwen2.5's, Phi-3's): ids from the tokenizer's size on decode to no
    text, so `run` counts them and says so beside the empty outputs, rather than leaving an empty column unexplained.
    The tiny model is made to pick id 50265 (past GPT-2's 50257 tokens) at every step: its final norm gives one
    vector whatever the input, and that id's embedding row (the tied head) is that vector scaled."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny(tmp_path, "padded-vocab", {**TINY_GPT2, "vocab_size": 50272})
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(torch.linspace(-1, 1, model.config.n_embd))
        model.transformer.wte.weight[50265] = 10 * model.transformer.ln_f.bias
    model.save_pretrained(folder)
    out_file = tmp_path / "run.json"
    code, out, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", folder, "--output-seq-len", 3,
                             "--iterations", 1, "--warmup", 0, "--json", out_file)
    assert code == 0, err
    outputs = json.loads(out_file.read_text())["results"][1]["rows"]
    # --output-seq-len is honoured beside the sample's label (51 tokens): 3 new tokens, each past the tokenizer
    assert "+ up to 3 tokens" in err
    assert outputs and all(row["output"] == "" and row["textless_ids"] == 3 for row in outputs)
    total = sum(row["textless_ids"] for row in outputs)
    assert (f"{total} generated token(s) in {len(outputs)} of {len(outputs)} outputs have ids at or past 50257, "
            "the tokenizer's size") in " ".join(out.split())
