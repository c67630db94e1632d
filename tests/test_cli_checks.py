"""Every flag and path that could only fail after a (slow) load, or be silently ignored, is checked before anything
loads: one sentence, exit code 2 (the rest of the command line's behaviour: tests/test_cli.py)."""

from __future__ import annotations

import pytest

from conftest import TOKENIZER_DIR, needs_shared
from test_cli import run_cli


@pytest.mark.parametrize("argv, needle", [
    (["accuracy", "GPT2", "frameworks", "--torch-dir", "/nonexistent"], "--torch-dir /nonexistent does not exist"),
    (["run", "GPT2", "frameworks", "--tokenizer-dir", "/etc/hostname"],
     "--tokenizer-dir /etc/hostname is a file; it takes a folder"),
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--dataset-file", "/tmp"],
     "--dataset-file /tmp is a folder; it takes a file"),
    (["benchmark", "GPT2", "onnxrt", "--random-weights", "--working-dir", "/etc/hostname"],
     "--working-dir /etc/hostname is a file; it takes a folder (created if missing)"),
    (["export", "GPT2", "onnxrt", "--random-weights", "--working-dir", "/etc/hostname/artifacts"],
     "--working-dir /etc/hostname/artifacts is inside /etc/hostname, which is a file"),
    # output files: found before the run, not after it when its results would be lost
    (["benchmark", "GPT2", "frameworks", "--random-weights", "--json", "/tmp"],
     "--json /tmp is a folder; give a file name such as results.json"),
    (["list", "--json", "/etc/hostname/list.json"], "--json /etc/hostname/list.json is inside /etc/hostname, which is"),
    (["compare", "GPT2", "frameworks", "--random-weights", "--plot", "/tmp"], "--plot /tmp is a folder; give a file"),
    (["benchmark", "GPT2", "frameworks", "--random-weights", "--json", "/proc/x.json"],
     "--json /proc/x.json: nothing can be written in /proc ("),  # found before the run, not at its last write
    (["benchmark", "GPT2", "frameworks", "--random-weights", "--plot", "bench.txt"],
     "--plot bench.txt: the plot is a PNG image; give a file name ending in .png"),
    (["triton", "GPT2", "onnxrt", "--random-weights", "-o", "/etc/hostname"],
     "-o/--output /etc/hostname is a file; it takes a folder"),
    (["triton", "GPT2", "onnxrt", "--random-weights", "-o", "/proc"],  # an existing folder -o cannot write into
     "-o/--output /proc: nothing can be written in /proc ("),
    (["export", "GPT2", "onnxrt", "--random-weights", "-o", "/proc"], "-o/--output /proc: nothing can be written in"),
    (["convert", "-m", "/nonexistent-model"], "-m/--model /nonexistent-model does not exist"),
    (["convert_model", "-m", "/nonexistent-model"], "-m/--model /nonexistent-model does not exist"),  # its alias
    (["convert", "-m", "a-hub-id", "--json", "/tmp"], "--json /tmp is a folder; give a file name such as report.json"),
    (["convert", "-m", "a-hub-id", "-o", "/etc/hostname/repo"],
     "-o/--output /etc/hostname/repo is inside /etc/hostname"),
    # lengths and settings that could only fail (or give empty figures) after the load
    (["chat", "GPT2", "frameworks", "--random-weights", "--output-seq-len", "1024"],
     "--output-seq-len 1024 leaves no position for a prompt: this model has 1024 positions"),
    (["triton", "GPT2", "onnxrt", "--random-weights", "--max-new-tokens", "5000"],
     "--max-new-tokens 5000 leaves no position for a prompt: this model has 1024 positions"),
    (["triton", "GPT2", "onnxrt", "--random-weights", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["run", "BLIP", "frameworks", "--random-weights", "--tgt-lang", "de_DE"],
     "--tgt-lang de_DE applies to multilingual translation models"),  # before the tokenizer loads, too
    (["triton", "GPT2", "onnxrt", "--random-weights", "--no-use-cache"],
     "continuous batching needs the KV cache (drop --no-use-cache)"),
    (["triton", "GPT2", "onnxrt", "--random-weights", "--streaming", "--num-beams", "2"],
     "--streaming with --num-beams 2: beam search cannot stream"),
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--topN", "0"], "--topN must be at least 1, got 0"),
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--tokens-to-generate", "0"],
     "--tokens-to-generate must be at least 1, got 0"),
    (["benchmark", "Llama", "frameworks", "--variant", "Qwen/Qwen2.5-0.5B", "--random-weights"],
     "--variant Qwen/Qwen2.5-0.5B is listed under the Qwen2 family, not Llama; run it as Qwen2"),
    # shared flags an action has no use for are refused, not silently ignored
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--num-beams", "4"],
     "--num-beams does not apply to accuracy: it scores each passage's next tokens in one forward pass"),
    (["run", "GPT2", "frameworks", "--random-weights", "--input-seq-len", "4"],
     "--input-seq-len does not apply to run"),
    (["chat", "GPT2", "frameworks", "--random-weights", "--batch-size", "4"], "--batch-size does not apply to chat"),
    (["benchmark", "GPT2", "frameworks", "--weights-seed", "3"], "--weights-seed seeds --random-weights"),
    (["compare", "GPT2", "frameworks", "--random-weights", "--batch-size", "4"],
     "--batch-size does not apply to compare"),  # run's samples, so run's refusals
    (["evaluate", "GPT2", "frameworks", "--random-weights", "--tasks", "x", "--num-samples", "20"],
     "unrecognized arguments: --num-samples 20 (--num-samples is a flag of accuracy; see python run.py evaluate "
     "--help)"),
    (["chat", "GPT2", "frameworks", "--random-weights", "--max-new-tokens", "20"],  # generate()'s name for it
     "unrecognized arguments: --max-new-tokens 20 (--max-new-tokens, generate()'s max_new_tokens, is "
     "--output-seq-len here, as NVIDIA's demo names it; see python run.py chat --help)"),
    (["benchmark", "GPT2", "frameworks", "onnxrt", "frameworks", "--random-weights"],
     "backend frameworks is named twice; name each backend once"),
    (["chat", "GPT2", "frameworks", "--random-weights", "--input-seq-len", "8"],
     "--input-seq-len does not apply to chat: its prompt is the conversation so far"),
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--input-seq-len", "8"],
     "--input-seq-len does not apply to accuracy: it scores whole passages"),
    (["accuracy", "T5", "frameworks", "--variant", "t5-small", "--random-weights", "--tokens-to-generate", "3"],
     "--tokens-to-generate does not apply to T5: an encoder-decoder model's decoder scores the target word's own"),
    (["accuracy", "BART", "frameworks", "--variant", "mbart-large-50", "--random-weights",
      "--tgt-lang", "de_DE"], "--tgt-lang does not apply to accuracy: the decoder scores the target word's own"),
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--use-mask"],
     "--use-mask does not apply to accuracy: it always feeds a mask"),
    (["evaluate", "GPT2", "frameworks", "--random-weights", "--tasks", "lambada_openai", "--output-seq-len", "8"],
     "--output-seq-len does not apply to evaluate: generation requests take the task's own limit, else --max-gen-toks"),
    (["triton", "GPT2", "onnxrt", "--random-weights", "--output-seq-len", "8"],
     "--output-seq-len does not apply to triton: a request's new tokens are its MAX_NEW_TOKENS input"),
    (["benchmark", "GPT2", "frameworks", "--random-weights", "--num-beams", "2", "--do-sample"],
     "sampling with beam search is not built"),
    (["benchmark", "BART", "onnxrt", "--variant", "bart-base", "--random-weights", "--kv-layout", "growing"],
     "--kv-layout applies to decoder-only models; BART's encoder-decoder graphs have their own cache inputs"),
    (["benchmark", "GPT2", "frameworks", "--random-weights", "--kv-layout", "growing"],
     "--kv-layout lays out the onnxrt backend's graph, and no onnxrt backend is asked for"),
    (["run", "GPT2", "onnxrt", "--random-weights", "--kv-layout", "shared", "--no-use-cache"],
     "--kv-layout shared lays out the decoder's KV cache, and --no-use-cache exports a graph without one"),
    (["run", "GPT2", "frameworks", "--random-weights", "--tokenizer-dir", "/etc"],
     "--tokenizer-dir /etc holds no tokenizer (no tokenizer.json"),
    # an engine's name, checked with the other engine flags (not when a TensorRT session opens: --info would show
    # a trtexec --saveEngine path in a folder "decodera/")
    (["benchmark", "GPT2", "trt", "--variant", "gpt2", "--random-weights", "--engine-postfix", "a/b", "--info"],
     "--engine-postfix 'a/b' may contain only letters, digits and . _ + -"),
    (["export", "GPT2", "trt", "--random-weights", "--engine-postfix", "A100 fast"],
     "--engine-postfix 'A100 fast' may contain only letters, digits and . _ + -"),
    (["export", "GPT2", "onnxrt", "--random-weights", "--use-mask"],
     "--use-mask does not apply to export: the graphs take an attention mask whether or not a run feeds one"),
    (["export", "GPT2", "onnxrt", "--random-weights", "--tgt-lang", "de_DE"], "--tgt-lang does not apply to export"),
    # with trt too: a usage error before the refusal of a machine without a GPU (nndf.actions.plans), so that it is
    # found where the command is prepared, not on the GPU machine; --info prints no plan of a wrong command
    (["run", "GPT2", "trt", "--variant", "gpt2", "--random-weights", "--output-seq-len", "5000"],
     "--output-seq-len 5000 leaves no position for a prompt: this model has 1024 positions"),
    (["run", "GPT2", "trt", "--variant", "gpt2", "--random-weights", "--output-seq-len", "5000", "--info"],
     "--output-seq-len 5000 leaves no position for a prompt: this model has 1024 positions"),
    (["benchmark", "GPT2", "frameworks", "trt", "--random-weights", "--input-seq-len", "2000", "--output-seq-len",
      "2000", "--cuda-graph"], "--input-seq-len 2000 plus --output-seq-len 2000 is 4000 tokens, more than the 1024"),
    (["compare", "GPT2", "trt", "--random-weights", "--output-seq-len", "5000"], "--output-seq-len 5000 leaves no"),
    (["chat", "GPT2", "trt", "--random-weights", "--output-seq-len", "1024"], "--output-seq-len 1024 leaves no"),
    (["export", "GPT2", "trt", "--random-weights", "--output-seq-len", "5000"], "--output-seq-len 5000 leaves no"),
    (["benchmark", "GPT2", "trt", "--random-weights", "--kv-layout", "growing"],
     "--kv-layout lays out the onnxrt backend's graph, and no onnxrt backend is asked for"),
    (["benchmark", "T5", "trt", "--variant", "t5-small", "--random-weights", "--input-seq-len", "600"],
     "--input-seq-len 600"),
    # 999 ONNX Runtime threads on 2 cores started and ran, at a load average of 400, as convert's --nb-threads does not
    (["accuracy", "GPT2", "onnxrt", "--random-weights", "--threads", "100000"],
     "--threads 100000 is more than the"),
])
def test_every_given_path_is_checked_before_anything_loads(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and needle in err
    assert "loading" not in err and "LAMBADA" not in err and "trtexec" not in out


@needs_shared(TOKENIZER_DIR)
def test_a_model_folder_that_cannot_load_is_one_sentence(capsys, tmp_path):
    """A folder with a config but no weights, or a config.json that is not JSON: one sentence and exit 2, not
    from_pretrained's OSError traceback."""
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2}')
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "gpt2",')
    for folder, needle in ((empty, f"--torch-dir {empty} holds no weights (no model.safetensors or "
                                   "pytorch_model.bin, whole or sharded)"),
                           (broken, f"--torch-dir {broken}: its config.json cannot be read")):
        code, _, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", folder, "--tokenizer-dir",
                               TOKENIZER_DIR, "--output-seq-len", 2)
        assert code == 2 and needle in err and "Traceback" not in err


def test_the_weights_have_their_own_seed(capsys, tmp_path, monkeypatch):
    """--seed picks data and draws; the random weights keep --weights-seed (0 by default, as nndf.load's), so a
    sampled run with another seed reuses the export instead of making other weights (the `--info` plan of trt
    without a GPU reads the config alone: no weights are built here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is present
    for flags, seed in ((["--seed", "5"], 0), (["--seed", "5", "--weights-seed", "3"], 3)):
        code, out, _ = run_cli(capsys, "benchmark", "GPT2", "trt", "--random-weights", *flags, "--info",
                               "--working-dir", tmp_path)
        assert code == 1 and f"weights: random weights (seed {seed}) from the known gpt2 config" in out
        weights = "--random-weights --weights-seed 3" if seed else "--random-weights --working-dir"
        assert f"python run.py export GPT2 onnxrt {weights}" in " ".join(out.split())  # the same weights' graphs


@needs_shared(TOKENIZER_DIR)
def test_a_sample_longer_than_the_model_names_the_sample(capsys, tmp_path):
    """A model with fewer positions than the family's sample prompts need: the error names the sample and its file,
    and how to ask for fewer new tokens, which then runs."""
    from conftest import TINY_GPT2, build_tiny

    folder = build_tiny(tmp_path, "short", {**TINY_GPT2, "n_positions": 16})
    code, _, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", folder, "--iterations", 1,
                           "--warmup", 0)
    assert code == 2 and ("error: the sample of models/gpt2/checkpoint.toml 'TensorRT is a Deep Learning compiler "
                          "used ...': a prompt of 13 tokens plus 51 new tokens is 64, more than the 16 positions of "
                          "this model (--output-seq-len sets the new tokens)") in err
    code, _, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", folder, "--iterations", 1,
                           "--warmup", 0, "--output-seq-len", 2)
    assert code == 0, err


def test_info_prints_the_plan_where_the_gpu_is_missing(capsys, tmp_path, monkeypatch):
    """--info with --cuda-graph on a machine without a GPU prints the plan (saying that CUDA graphs need a GPU), then
    the refusal a run gets; without --info the refusal alone. --info on trt beside a quantized onnxrt prints the
    engines' plan too (their options are the run's, --int8 among them)."""
    import torch

    from nndf.actions.plans import CUDA_GRAPH_NEEDS_GPU, CUDA_GRAPH_NOTE

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is present
    common = ("--variant", "gpt2", "--random-weights", "--working-dir", tmp_path)
    code, out, err = run_cli(capsys, "run", "GPT2", "frameworks", *common, "--cuda-graph", "--info")
    flat = " ".join(out.split())
    assert code == 2 and err.strip().splitlines()[-1] == f"error: {CUDA_GRAPH_NEEDS_GPU}"
    assert "GPT2 gpt2: the frameworks steps these settings run" in out and CUDA_GRAPH_NOTE in flat
    assert "static KV cache of 1024 positions per row" in out and "present.{0..11}.key|value" in out
    assert "loading" not in err, "a plan reads the config, not the weights"

    code, out, err = run_cli(capsys, "benchmark", "GPT2", "trt", *common, "--cuda-graph", "--info")
    assert code == 1 and "trtexec --onnx=" in out and CUDA_GRAPH_NOTE in " ".join(out.split())
    assert err.strip().splitlines()[-1].startswith("error: the trt backend needs an NVIDIA GPU")
    code, out, err = run_cli(capsys, "benchmark", "GPT2", "trt", *common, "--cuda-graph")
    assert code == 1 and not out and "error: the trt backend needs an NVIDIA GPU" in err

    code, out, err = run_cli(capsys, "benchmark", "GPT2", "onnxrt", "trt", *common, "--int8", "--info")
    assert code == 1 and "trtexec --onnx=" in out and "--int8 applies" not in err


def test_export_into_a_folder_says_a_missing_tokenizer_before_exporting(capsys, tmp_path):
    """`export -o DIR` saves the tokenizer beside the graphs: offline random weights without --tokenizer-dir are
    told so before the export runs (it was said after a full export), and nothing is left in -o."""
    code, _, err = run_cli(capsys, "export", "GPT2", "onnxrt", "--random-weights", "-o", tmp_path / "out",
                           "--working-dir", tmp_path / "work")
    assert code == 1 and "no tokenizer could be loaded" in err and "--tokenizer-dir DIR" in err
    assert "exporting" not in err and not (tmp_path / "out").exists()
    assert not list((tmp_path / "work").glob("*decoder*"))


@pytest.mark.parametrize("action", [["triton", "-o", "served"], ["export", "-o", "exported"], ["run"]])
def test_onnxrt_fp16_on_the_cpu_is_refused_before_the_tokenizer_is_looked_for(capsys, tmp_path, action):
    """`triton GPT2 onnxrt --fp16` (offline random weights, no --tokenizer-dir) ended with the missing tokenizer
    (exit 1) where the flag it cannot take here is the first thing to fix (exit 2)."""
    from nndf.backends.onnxrt import _cuda_provider

    if _cuda_provider():  # onnxruntime-gpu and a GPU: --fp16 runs there, on the CUDA provider
        pytest.skip("ONNX Runtime's CUDA provider is here: onnxrt --fp16 runs instead of being refused")
    name, *output = action
    output = [value if value.startswith("-") else str(tmp_path / value) for value in output]
    code, _, err = run_cli(capsys, name, "GPT2", "onnxrt", "--random-weights", "--fp16", "--working-dir",
                           tmp_path / "work", *output)
    assert code == 2 and "--fp16 on the onnxrt backend needs ONNX Runtime's CUDA provider" in err, err
    assert "tokenizer" not in err and not list(tmp_path.glob("*/*decoder*"))


@pytest.mark.parametrize("argv, needle", [
    (["triton", "GPT2", "onnxrt", "--random-weights", "-o", ""], "-o/--output is empty; give a folder name"),
    (["export", "GPT2", "onnxrt", "--random-weights", "-o", ""], "-o/--output is empty; give a folder name"),
    (["accuracy", "GPT2", "onnxrt", "--random-weights", "--working-dir", ""], "--working-dir is empty; give a folder"),
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--json", ""],
     "--json is empty; give a file name such as results.json"),
    (["benchmark", "GPT2", "frameworks", "--random-weights", "--plot", " "], "--plot is empty; give a file name"),
    (["convert", "-m", "bert-base-uncased", "-o", ""], "-o/--output is empty; give a folder name"),
    (["convert", "-m", "bert-base-uncased", "--json", ""], "--json is empty; give a file name such as report.json"),
    # given paths too ("--dataset-file  is a folder", "--torch-dir  is not a Hugging Face model folder")
    (["accuracy", "GPT2", "frameworks", "--random-weights", "--dataset-file", ""],
     "--dataset-file is empty; it takes the path of a file"),
    (["accuracy", "GPT2", "frameworks", "--torch-dir", ""], "--torch-dir is empty; it takes the path of a folder"),
    (["convert", "-m", ""], "-m/--model is empty; it takes a local folder or a hub id"),  # "-m/--model  holds no"
    (["convert", "-m", "bert-base-uncased", "-t", ""], "-t/--tokenizer is empty"),  # was taken as no -t
])
def test_an_empty_path_is_refused(capsys, tmp_path, monkeypatch, argv, needle):
    """An empty -o (-o "$UNSET") is Path(""), the current folder: triton and convert wrote their models and graphs
    among the user's files there, and printed `tritonserver --model-repository ''`; an empty --json was "--json  is
    a folder"."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and f"error: {needle}" in err, err
    assert not any(tmp_path.iterdir())
