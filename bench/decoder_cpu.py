#!/usr/bin/env python
"""Decoder speed on the CPU, side by side in one run: Hugging Face eager, our loop on PyTorch and ONNX Runtime
(fp32 / int8 / int4), Hugging Face Optimum's ORTModelForCausalLM, and the CPU peers on the same weights: llama.cpp
(F32 / Q8_0 / Q4_0) and ONNX Runtime GenAI (fp32 / int4, Llama-class models).

    HF_HUB_OFFLINE=1 python bench/decoder_cpu.py                      # GPT-2 small, random weights, b1 and b4
    HF_HUB_OFFLINE=1 python bench/decoder_cpu.py --engines hf onnxrt --rounds 3 --json out.json

How it measures (see bench/README.md):

- Every engine runs in its own worker process (this script with `--worker ENGINE`), started once and kept alive,
  driven by one-line JSON commands on its stdin and answering one JSON line each. Only one worker computes at a
  time. Exports and quantization are done beforehand in a separate short-lived process, so a worker's peak
  memory (its peak RSS, read at the end) is the cost of loading and running, not of building.
- Every engine loads the same weights: the main process builds the variant once (random weights, seed 0, by
  default) and saves it as a Hugging Face folder in the working dir; workers load that folder.
- The Optimum worker runs in its own virtual environment (optimum-onnx needs transformers < 4.58, this project
  needs 5.x), created under the working dir on first use. Its code is bench/harness/worker.py and imports only
  the standard library, torch, numpy, transformers and optimum: never nndf.
- After one warm-up generation per engine and batch size, every round runs each batch size on each engine in
  turn (the engine order rotates from round to round), on the same seeded random prompt, greedy, with exactly
  `--output-len` new tokens (EOS suppressed until then).
- Per engine and batch: decode ms/step (median over rounds of each run's median step), time to first token and
  end-to-end tokens/s (batch * output_len / generation time), with the spread (max - min) / median over rounds.
- The peers (harness/peers.py) are built once in the working dir: llama.cpp from the llama-cpp-python sdist's
  sources with cmake, measured by its llama-batched-bench (harness/llamacpp.py); ONNX Runtime GenAI in its own venv
  with its model builder, timed per token like our loop (harness/genai.py). A peer that cannot be built (no cmake,
  no network, a model its builder refuses) shows why in its rows; the rest runs.
- The memory floor (harness/floor.py) is an engine too: in its turn of each round it times how fast the cores read
  1 GiB, and its decode step is the fp32 weights' bytes at that speed.
- Ratios last: each engine against hf and against optimum, ours against the peers at the same precision, then the
  goals as PASS / FAIL / SKIP lines.

What every benchmark shares (workers, the Optimum venv, statistics, the report) is bench/harness/; this file holds
only what is decoder-specific. Nothing here imports nndf, torch or transformers at import time: the same file is
the Optimum worker.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # bench/harness, also when this file is loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import driver, render, stats  # noqa: E402
from harness.bench import Bench  # noqa: E402
from harness.render import format_table  # noqa: E402,F401
from harness.stats import stat, token_agreement  # noqa: E402,F401
from harness.worker import NndfRunner, optimum_runner  # noqa: E402
from harness import floor, genai, llamacpp  # noqa: E402
from harness.peers import SETUPS  # noqa: E402

DEFAULT_ENGINES = ("hf", "onnxrt", "onnxrt-int8", "onnxrt-int4", "optimum", "llamacpp-f32", "llamacpp-q8_0",
                   "llamacpp-q4_0", "genai", "genai-int4", floor.ENGINE)
ENGINE_HELP = {
    "hf": "Hugging Face eager generate() with KV cache (PyTorch, transformers 5.x)",
    "nndf-frameworks": "our generation loop on PyTorch",
    "onnxrt": "our generation loop on ONNX Runtime, fp32",
    "onnxrt-int8": "our generation loop on ONNX Runtime, int8 weights",
    "onnxrt-int4": "our generation loop on ONNX Runtime, int4 weights",
    "onnxrt-growing": "our generation loop on ONNX Runtime, fp32, with the growing KV layout (--kv-layout growing: "
                      "past and new concatenated in the graph at every step; onnxrt's default is the shared buffer)",
    "onnxrt-4k": "our generation loop on ONNX Runtime, fp32, its weights left on 4 KiB pages (NNDF_HUGE_PAGES=0; "
                 "onnxrt's default moves them onto 2 MiB pages after loading, nndf.hugepages)",
    "optimum": "Hugging Face Optimum ORTModelForCausalLM (KV cache), in its own virtual environment",
    "llamacpp-f32": "llama.cpp (from the llama-cpp-python sdist), llama-batched-bench on an F32 GGUF of the weights",
    "llamacpp-q8_0": "the same on a Q8_0 GGUF (convert_hf_to_gguf.py --outtype q8_0)",
    "llamacpp-q4_0": "the same on a Q4_0 GGUF (llama-quantize from the F32 file)",
    "genai": "ONNX Runtime GenAI (its model builder, fp32; Llama-class models only), in its own virtual environment",
    "genai-int4": "the same, built with -p int4 (MatMulNBits)",
    floor.ENGINE: floor.HELP,
}
# Our engine and the peer at its precision: the RATIOS against the peers and the peers' goals pair them so.
PEERS = (("onnxrt", "llamacpp-f32"), ("onnxrt-int8", "llamacpp-q8_0"), ("onnxrt-int4", "llamacpp-q4_0"),
         ("onnxrt", "genai"), ("onnxrt-int4", "genai-int4"))
QUANTIZE = {"onnxrt-int8": "int8", "onnxrt-int4": "int4"}
KV_LAYOUTS = {"onnxrt-growing": "growing"}  # engines whose onnxrt graph has another KV layout than the default
SMALL_PAGES = ("onnxrt-4k",)  # engines whose weights stay on the 4 KiB pages ONNX Runtime loads them onto

# The goals: (engine, batch, metric, reference, op, target). `metric` is "step_ms" (decode ms/step, lower is
# better), "tok_s" (end-to-end tokens/s, higher is better) or "peak_rss" (worker peak memory, any batch).
GOALS = (
    ("onnxrt", 1, "step_ms", "hf", "<=", 0.90),
    ("onnxrt", 1, "step_ms", "optimum", "<=", 0.85),
    ("onnxrt", 4, "tok_s", "hf", ">=", 2.4),  # issue 21 raised it from 1.9
    ("onnxrt", 4, "tok_s", "optimum", ">=", 1.3),
    ("onnxrt-int8", 1, "step_ms", "hf", "<=", 0.40),
    ("onnxrt-int4", 1, "step_ms", "hf", "<=", 0.30),
    ("onnxrt-int4", 4, "tok_s", "hf", ">=", 3.0),
    ("onnxrt", None, "peak_rss", "hf", "<=", 1.0),
    # issue 21: faster per token than llama.cpp and ONNX Runtime GenAI on the same weights, at the same precision
    *((ours, 1, "step_ms", peer, "<=", 0.85) for ours, peer in PEERS),
    *((ours, 1, "ttft_ms", peer, "<=", 0.7) for ours, peer in PEERS if peer.startswith("llamacpp")),
    ("onnxrt", 1, "step_ms", floor.ENGINE, "<=", 1.25),  # issue 21: within 1.25x of the memory floor
)


def make_runner(args):
    """The worker's engine: Optimum's ORTModelForCausalLM (in its own venv, no nndf), else nndf.load."""
    if args.worker == "optimum":
        return optimum_runner(args, "ORTModelForCausalLM", seq2seq=False)
    if args.worker in llamacpp.ENGINES:
        return llamacpp.LlamaCppRunner(args)
    if args.worker in genai.ENGINES:
        return genai.GenaiRunner(args)
    if args.worker == floor.ENGINE:
        return floor.FloorRunner(args)
    if args.worker in SMALL_PAGES:
        os.environ["NNDF_HUGE_PAGES"] = "0"
    return NndfRunner(args, QUANTIZE, kv_layouts=KV_LAYOUTS)


def check_lengths(config: dict, args) -> str | None:
    positions = config.get("n_positions") or config.get("max_position_embeddings")
    if positions and args.input_len + args.output_len > positions:
        return (f"--input-len {args.input_len} + --output-len {args.output_len} is more than the {positions} "
                "positions of this model")
    return None


BENCH = Bench(
    name="decoder_cpu",
    script=Path(__file__).resolve(),
    description="Decoder speed on the CPU, side by side in one run: Hugging Face eager, our loop on PyTorch and ONNX "
                "Runtime fp32/int8/int4, Optimum's ORTModelForCausalLM, llama.cpp and ONNX Runtime GenAI on the same "
                "weights. Report on stdout, progress on stderr.",
    engine_help=ENGINE_HELP,
    default_engines=DEFAULT_ENGINES,
    goals=GOALS,
    table_metrics=("step_ms", "ttft_ms", "tok_s"),
    ratio_metrics=lambda batch: ("step_ms",) if batch == 1 else ("tok_s",),  # b1 is about latency, larger b throughput
    make_runner=make_runner,
    check_lengths=check_lengths,
    default_family="GPT2",
    default_variant="gpt2",
    quantize=QUANTIZE,
    # nothing to export or quantize first (the peers' setups build their own files)
    unprepared=("hf", "nndf-frameworks", *llamacpp.ENGINES, *genai.ENGINES, floor.ENGINE),
    peers=PEERS,
    setups=SETUPS,
    table_notes=(floor.note,),
)

build_parser = partial(driver.build_parser, BENCH)
parse_args = partial(driver.parse_args, BENCH)
compute_ratios = partial(stats.compute_ratios, bench=BENCH)
evaluate_goals = partial(stats.evaluate_goals, bench=BENCH)
peer_ratios = partial(stats.peer_ratios, bench=BENCH)
render_report = partial(render.render_report, bench=BENCH)
main = partial(driver.main, BENCH)

if __name__ == "__main__":
    sys.exit(main())
