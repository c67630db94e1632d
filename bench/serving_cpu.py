#!/usr/bin/env python
"""Serving a generative model for real on the CPU (issue 23): continuous batching against one request at a time.

    HF_HUB_OFFLINE=1 python bench/serving_cpu.py                        # GPT-2 small, random weights, 1/4/8/16 clients
    HF_HUB_OFFLINE=1 python bench/serving_cpu.py --quick --clients 1 4 --requests-per-client 2 --rounds 1   # smoke

`run.py triton` writes one repository with three models of the same graph: `gpt2` (continuous scheduler),
`gpt2_stream` (its decoupled twin: a gRPC response per new piece of text) and `gpt2_seq` (sequential scheduler, the
model before continuous batching), each with an ONNX Runtime session of `--threads` threads (one asked at a time).
One tritonserver (tests/triton_server.py, as the tests start it) serves them. N client threads send closed-loop
requests (the next when the last is answered) of fixed prompts of mixed lengths (LAMBADA passages cut to 8..64
tokens, or fixed sentences without ../shared); the models take turns at each client count, in an order that turns
from round to round (a shared 2-core machine is noisy). `gpt2` and `gpt2_seq` are asked over HTTP, `gpt2_stream`
over a gRPC stream, which times the first streamed piece (TTFT).

Every answer is compared with direct generation: the same graph in this process (`nndf.load`), each prompt alone;
tokens/s counts the direct answer's new tokens (random weights rarely end early, but they may). Goals: at 8
clients, tokens/s of continuous over sequential and p99 latency over a lone request's median; every answer equal to
direct generation; a lone request's first streamed piece over the backend's own first token (`on_token` timing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import textwrap
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for folder in (BENCH, REPO / "tests"):  # bench/harness and triton_cpu; tests/triton_server.py
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.render import format_table  # noqa: E402
from triton_cpu import FALLBACK_TEXTS, SHARED_LAMBADA  # noqa: E402
from harness.cli import parse_checked, positive, run_script  # noqa: E402

TOKENIZER_DIR = REPO.parent / "shared" / "data" / "gpt2-tokenizer"
MODELS = {"continuous": "gpt2", "streaming": "gpt2_stream", "sequential": "gpt2_seq"}  # label -> Triton model
PROMPT_LENGTHS = (8, 16, 24, 32, 40, 48, 56, 64)  # tokens, in turn
PROMPT_COUNT = 16
GOAL_CLIENTS = 8
GOALS = {"throughput": 3.0, "p99": 3.0, "equal": 100.0, "ttft": 1.5}
QUICK_CONFIG = dict(n_layer=2, n_head=2, n_embd=64, n_positions=256)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) interpolated between the closest ranks (numpy's default), so a p99 of a few
    dozen requests still moves with the slowest ones instead of jumping to the maximum."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def mixed_prompts(tokenizer, texts: list[str], count: int, lengths=PROMPT_LENGTHS) -> list[str]:
    """`count` prompts cut from `texts` (in turn) to `lengths` tokens (in turn): a server sees prompts of many
    lengths, and continuous batching must cope with rows at different positions."""
    prompts = []
    for index in range(count):
        ids = tokenizer(texts[index % len(texts)])["input_ids"][: lengths[index % len(lengths)]]
        prompts.append(tokenizer.decode(ids))
    return prompts


def source_texts(count: int) -> list[str]:
    """LAMBADA passages when ../shared is there, else the fixed sentences strung together (long enough to cut)."""
    if SHARED_LAMBADA.exists():
        return [json.loads(line)["text"] for line in SHARED_LAMBADA.read_text().splitlines()[:count]]
    return [" ".join(FALLBACK_TEXTS[i:] + FALLBACK_TEXTS[:i]) * 2 for i in range(len(FALLBACK_TEXTS))]


def summarize(records: list[dict], wall_s: float) -> dict:
    """One model at one client count: `records` are its requests ({latency, tokens, equal, ttft, direct_ttft})
    over `wall_s` seconds of its rounds. The direct first-token times are those of the same prompts, so that the
    ratio of the two does not depend on which prompt lengths the requests happened to have."""
    latencies = [r["latency"] for r in records]
    streamed = [r for r in records if r.get("ttft") is not None]
    ttfts = [r["ttft"] for r in streamed]
    return {"requests": len(records), "wall_s": wall_s, "requests_per_s": len(records) / wall_s,
            "tokens_per_s": sum(r["tokens"] for r in records) / wall_s,
            "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "direct_ttft_p50_s": percentile([r["direct_ttft"] for r in streamed], 50) if ttfts else None,
            "equal_pct": 100.0 * sum(r["equal"] for r in records) / len(records)}


def render(results: dict) -> str:
    """results: {model label: {clients (int): summary}} -> one aligned table per model."""
    header = ["clients", "requests/s", "tokens/s", "p50 s", "p99 s", "TTFT p50 s", "answers equal"]
    return "\n\n".join(f"{label} ({MODELS.get(label, label)})\n" + format_table(header, [
        [str(n), f"{s['requests_per_s']:.2f}", f"{s['tokens_per_s']:.1f}", f"{s['p50_s']:.3f}", f"{s['p99_s']:.3f}",
         "-" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s']:.3f}", f"{s['equal_pct']:.0f}%"]
        for n, s in sorted(by_clients.items())], align="r" * len(header), indent="  ")
        for label, by_clients in results.items())


def evaluate_goals(results: dict) -> list[dict]:
    """The four goals as {label, value, goal, unit, ok}; `value` None (and ok False) when a figure is missing,
    e.g. 8 or 1 not among --clients."""
    cont, seq, stream = (results.get(k, {}) for k in ("continuous", "sequential", "streaming"))
    at, fewest = GOAL_CLIENTS, min(stream, default="-")

    def ratio(a, b):
        return a / b if a is not None and b else None

    everything = [s for by_clients in results.values() for s in by_clients.values()]
    equal = sum(s["equal_pct"] * s["requests"] for s in everything) / max(1, sum(s["requests"] for s in everything))
    goals = [(f"tokens/s, continuous / sequential, {at} clients", ratio(cont.get(at, {}).get("tokens_per_s"),
              seq.get(at, {}).get("tokens_per_s")), ">=", GOALS["throughput"], "x"),
             (f"p99 latency at {at} clients / a lone request's p50 (continuous)",
              ratio(cont.get(at, {}).get("p99_s"), cont.get(1, {}).get("p50_s")), "<=", GOALS["p99"], "x"),
             ("answers equal to direct generation, all models", equal if everything else None, ">=", GOALS["equal"],
              "%"),
             (f"first streamed piece, {fewest} client(s) / the backend's own first token",
              ratio(stream.get(fewest, {}).get("ttft_p50_s"), stream.get(fewest, {}).get("direct_ttft_p50_s")),
              "<=", GOALS["ttft"], "x")]
    return [{"label": label, "value": value, "op": op, "goal": goal, "unit": unit,
             "ok": value is not None and (value >= goal if op == ">=" else value <= goal)}
            for label, value, op, goal, unit in goals]


def render_goals(goals: list[dict]) -> str:
    """A PASS/FAIL line per goal, the ratio last on each line; SKIP where a figure it needs was not measured (a
    client count not among --clients), as bench/decoder_cpu.py says it."""
    def line(g):
        goal = f"{g['label']} (goal {g['op']} {g['goal']:g}{g['unit']})"
        if g["value"] is None:
            return f"SKIP  {goal}: not measured (its client counts were not all among --clients)"
        shown = f"{g['value']:.1f}%" if g["unit"] == "%" else f"{g['value']:.2f}x"
        return f"{'PASS' if g['ok'] else 'FAIL'}  {goal}: {shown}"
    return "\n".join(line(g) for g in goals)


def plot(path: str, results: dict, title: str) -> None:
    """Two panels against the number of clients, a line per model: tokens/s and p99 latency."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from nndf.workspace import atomic_path

    fig = Figure(figsize=(9.2, 3.8))
    FigureCanvasAgg(fig)  # its own canvas: pyplot's backend is left as it is
    axes = fig.subplots(1, 2)
    for label, by_clients in results.items():
        clients = sorted(by_clients)
        for ax, key in zip(axes, ("tokens_per_s", "p99_s")):
            ax.plot(clients, [by_clients[n][key] for n in clients], marker="o", label=label)
    for ax, name in zip(axes, ("tokens/s", "p99 latency (s)")):
        ax.set_xlabel("concurrent clients")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def model_folder(work: Path, quick: bool) -> Path:
    """GPT-2 small (or `--quick`'s 2-layer model) with seeded random weights and the real GPT-2 tokenizer, saved
    once in the working dir and reused."""
    folder = work / ("gpt2-quick" if quick else "gpt2-small")
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    if not TOKENIZER_DIR.is_dir():
        raise SystemExit(f"the GPT-2 tokenizer {TOKENIZER_DIR} is absent; give --variant-dir with a tokenizer in it")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**(QUICK_CONFIG if quick else {}))).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)).save_pretrained(folder)
    return folder


def write_repository(variant_dir: Path, work: Path, repository: Path, args) -> None:
    """The three models (`run.py triton` twice), written again only when the model or the settings change."""
    from nndf.cli import main as run_py

    settings = {"variant_dir": str(variant_dir), "threads": args.threads, "rows": max(args.clients),
                "new_tokens": args.new_tokens}
    stamp = repository / "bench-settings.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return
    common = ["triton", "GPT2", "onnxrt", "--torch-dir", str(variant_dir), "--working-dir", str(work / "graphs"),
              "-o", str(repository), "--max-batch-size", str(max(args.clients)), "--max-new-tokens",
              str(args.new_tokens), "--threads", str(args.threads)]
    with contextlib.redirect_stdout(sys.stderr):  # its report is progress here; stdout is this one's
        for extra in (["--name", "gpt2", "--scheduler", "continuous", "--streaming"],
                      ["--name", "gpt2_seq", "--scheduler", "sequential"]):
            if run_py(common + extra):
                raise SystemExit(f"run.py triton {' '.join(extra)} failed (its message is above)")
    stamp.write_text(json.dumps(settings))


def direct_generation(variant_dir: Path, work: Path, prompts: list[str], args) -> list[dict]:
    """{answer, tokens, ttft} of each prompt generated alone in this process; ttft: seconds from before `generate`
    to its first token chosen (what the backend itself takes, after one warm-up run)."""
    import nndf
    from nndf.measure import StepTimer

    model = nndf.load("GPT2", torch_dir=str(variant_dir), backend="onnxrt", working_dir=str(work / "graphs"),
                      threads=args.threads)
    found = []
    for prompt in prompts[:1] + prompts:  # the first run warms the session up
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids
        timer = StepTimer()
        timer.start()
        new = model.new_tokens(model.generate(ids, max_new_tokens=args.new_tokens, on_token=timer.mark), ids)[0]
        found.append({"answer": model.tokenizer.decode(new, skip_special_tokens=True), "tokens": len(new),
                      "ttft": timer.time_to_first_token})
    return found[1:]


def _inputs(module, prompt: str, new_tokens: int):
    import numpy as np

    text = module.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    limit = module.InferInput("MAX_NEW_TOKENS", [1, 1], "INT32")
    limit.set_data_from_numpy(np.full((1, 1), new_tokens, dtype=np.int32))
    return [text, limit]


def http_caller(url: str, model: str, new_tokens: int):
    """call(prompt) -> (answer, None) over HTTP, one client per caller (per client thread)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)

    def call(prompt):
        result = client.infer(model, _inputs(httpclient, prompt, new_tokens))
        return result.as_numpy("GENERATED").reshape(-1)[0].decode(), None
    call.close = client.close
    return call


def stream_caller(url: str, model: str, new_tokens: int):
    """call(prompt) -> (answer, seconds to its first non-empty piece) over one gRPC stream per caller."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((time.perf_counter(), result, error)))

    def call(prompt):
        started = time.perf_counter()
        client.async_stream_infer(model, _inputs(grpcclient, prompt, new_tokens), enable_empty_final_response=True)
        pieces, first = [], None
        while True:
            at, result, error = arrived.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"{model} answered with an error: {error}")
            piece = result.as_numpy("GENERATED")
            if piece is not None and piece.reshape(-1)[0]:
                first = first if first is not None else at - started
                pieces.append(piece.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "".join(pieces), first

    call.close = lambda: (client.stop_stream(), client.close())
    return call


def closed_loop(make, clients: int, prompts: list[str], requests_each: int, offset: int) -> tuple[list[dict], float]:
    """`clients` threads, each with its own caller (`make()`: tritonclient's HTTP client must stay on the thread
    that made it), send `requests_each` prompts, the next when the last is answered; returns their records
    ({prompt, latency, answer, ttft}) and the wall time from the common start to the last answer."""
    records: list[dict] = []
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def client(index):
        call = make()
        start.wait()
        try:
            for k in range(requests_each):
                prompt = (offset + index * requests_each + k) % len(prompts)
                began = time.perf_counter()
                answer, ttft = call(prompts[prompt])
                records.append({"prompt": prompt, "latency": time.perf_counter() - began, "answer": answer,
                                "ttft": ttft})
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            call.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records, time.perf_counter() - began


def measure(urls: dict, prompts: list[str], direct: list[dict], args) -> dict:
    """{label: {clients: summary}}: the models in turn at each client count, `--rounds` times."""
    makers = {"continuous": lambda: http_caller(urls["http"], MODELS["continuous"], args.new_tokens),
              "sequential": lambda: http_caller(urls["http"], MODELS["sequential"], args.new_tokens),
              "streaming": lambda: stream_caller(urls["grpc"], MODELS["streaming"], args.new_tokens)}
    for make in makers.values():  # warm-up: the first request of each model sets its sessions up
        call = make()
        call(prompts[0])
        call.close()
    results: dict = {label: {} for label in makers}
    for clients in args.clients:
        records: dict = {label: [] for label in makers}
        walls = dict.fromkeys(makers, 0.0)
        for round_index in range(args.rounds):
            order = list(makers)[round_index % 3:] + list(makers)[: round_index % 3]
            for label in order:
                done, wall = closed_loop(makers[label], clients, prompts, args.requests_per_client, round_index)
                records[label] += done
                walls[label] += wall
        for label, done in records.items():
            for r in done:
                alone = direct[r["prompt"]]
                r.update(tokens=alone["tokens"], equal=r["answer"] == alone["answer"], direct_ttft=alone["ttft"])
            results[label][clients] = summarize(done, walls[label])
        print(f"# {clients} client(s) done", file=sys.stderr, flush=True)
    return results


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant-dir", help="serve this Hugging Face GPT-2 folder (default: GPT-2 small, random weights)")
    p.add_argument("--quick", action="store_true", help="a tiny 2-layer random model, for smoke runs")
    p.add_argument("--clients", nargs="+", type=positive, default=[1, 4, 8, 16], help="concurrent clients (1 4 8 16)")
    p.add_argument("--requests-per-client", type=positive, default=4, help="requests each client sends per round (4)")
    p.add_argument("--rounds", type=positive, default=2, help="turns of the three models at each client count (2)")
    p.add_argument("--new-tokens", type=positive, default=32, help="MAX_NEW_TOKENS of every request (32)")
    p.add_argument("--threads", type=positive, default=os.cpu_count() or 1,
                   help="ONNX Runtime threads of each served model and of direct generation (default: one per core)")
    p.add_argument("--working-dir", default="temp", help="the model, graphs and repository go in <it>/bench-serving")
    p.add_argument("--plot", metavar="FILE.png", help="tokens/s and p99 latency against clients (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parse_checked(p, argv)  # counts of at least 1 (harness.cli.positive), outputs that can be written
    args.clients = sorted(set(args.clients))
    if args.variant_dir and args.quick:
        p.error("--quick builds its own tiny model; give it or --variant-dir, not both")
    if args.variant_dir and not (Path(args.variant_dir) / "config.json").is_file():
        p.error(f"--variant-dir {args.variant_dir} is not a Hugging Face model folder (no config.json in it)")
    if args.plot:
        from nndf.errors import HarnessError, UsageError
        from nndf.plots import check_plotting

        try:
            check_plotting(args.plot)
        except (HarnessError, UsageError) as exc:
            p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from triton_server import triton_server

    work = Path(args.working_dir).resolve() / "bench-serving"
    work.mkdir(parents=True, exist_ok=True)
    variant_dir = Path(args.variant_dir).resolve() if args.variant_dir else model_folder(work, args.quick)
    repository = work / ("models-quick" if args.quick else "models")
    write_repository(variant_dir, work, repository, args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(variant_dir))
    prompts = mixed_prompts(tokenizer, source_texts(PROMPT_COUNT), PROMPT_COUNT)
    direct = direct_generation(variant_dir, work, prompts, args)
    with triton_server(repository, work, timeout=600) as urls:
        results = measure(urls, prompts, direct, args)
    goals = evaluate_goals(results)
    title = (f"{variant_dir.name} through Triton (pytriton's tritonserver, CPU, {args.threads} ORT threads), "
             f"{args.new_tokens} new tokens, prompts of {PROMPT_LENGTHS[0]}..{PROMPT_LENGTHS[-1]} tokens, "
             f"{args.rounds} round(s) x {args.requests_per_client} requests per client")
    print(f"# {title}\n# direct generation's first token, median of the {PROMPT_COUNT} prompts alone: "
          f"{statistics.median(d['ttft'] for d in direct):.3f} s\n{render(results)}\n\n{render_goals(goals)}")
    if args.json:
        report = {"title": title, "prompts": prompts, "direct": direct, "results": results, "goals": goals}
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(args.plot, results, title)
    return 0


if __name__ == "__main__":
    sys.exit(run_script("serving_cpu.py", main))
