#!/usr/bin/env python
"""Decoding speed on one CUDA GPU, side by side in one process (issue 11): Hugging Face eager and compiled, our loop
eager and with CUDA graphs, ONNX Runtime on CUDA and TensorRT where installed.

    HF_HUB_OFFLINE=1 python bench/decoder_gpu.py                                  # gpt2, fp16, 128 + 128, b1 and b8
    HF_HUB_OFFLINE=1 python bench/decoder_gpu.py --variant gpt2-xl --batch-sizes 1
    HF_HUB_OFFLINE=1 python bench/decoder_gpu.py --family T5 --variant t5-small --output-len 64
    HF_HUB_OFFLINE=1 python bench/decoder_gpu.py --sample --top-p 0.9 --batch-sizes 1 --engines hf-eager ours-cuda-graph

How it measures (see bench/README.md): every engine holds the same weights (built once, on the GPU, seeded); after
a warm-up (where torch.compile compiles), each round runs every engine in turn on the same seeded prompts, greedy,
with EOS banned until the last token, twice: 1 new token and N new tokens. The decode step is (T(N) - T(1)) / (N - 1)
(medians over rounds), so it holds no prefill and no timing callbacks; T(1) is the first-token time. Peak memory is
PyTorch's allocator peak during the N-token run (ONNX Runtime's and TensorRT's own allocations are not in it). The
floor is the weight bytes over the device-to-device copy bandwidth measured here: no decoder step can read its
weights faster. `--device cpu` runs the CPU engines on a tiny model as a check of this script (and of the launch
overhead per step: on a model that small, a step is almost all overhead). `--sample` gives each engine a sampled
twin, `<engine> sampled`, measured in the same rounds: generate(do_sample=True) with top-k 50 (and `--top-p`), seeded
once per generation (`torch.manual_seed` before Hugging Face's, `seed=` for ours, which means the same); its tokens are
compared with `hf-eager sampled`'s and its step with its greedy twin's (`/ greedy`: what sampling costs per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.render import format_table  # noqa: E402
from harness.cli import parse_checked, positive, run_script  # noqa: E402

ENGINES = ("hf-eager", "hf-compile", "ours-eager", "ours-static", "ours-cuda-graph", "onnxrt", "trt")
CUDA_ONLY = {"hf-compile": "transformers compiles its static-cache step on CUDA only",
             "ours-cuda-graph": "CUDA graphs need a CUDA device"}
# (family, variant) -> what our loop with CUDA graphs must reach at batch 1: ms/step over HF static cache +
# torch.compile's, and over the floor (None: no goal).
GOALS = {("GPT2", "gpt2"): (0.4, None), ("GPT2", "gpt2-xl"): (0.8, 3.0), ("T5", "t5-small"): (0.8, None),
         ("BART", "bart-base"): (0.8, None)}


class Unavailable(Exception):
    """An engine that cannot run here; the message says why."""


SAMPLED = " sampled"  # the name suffix of an engine's sampled twin (--sample)
SAMPLING_SEED = 0


@dataclass
class Engine:
    name: str
    generate: Callable[[dict, int], torch.Tensor]  # (inputs, new tokens) -> whole sequences on the CPU
    t1: list[float] = field(default_factory=list)
    tn: list[float] = field(default_factory=list)
    peak: int | None = None
    tokens: torch.Tensor | None = None


def _ours(loaded, settings, backend: str = "frameworks", static: bool | None = None, **options):
    import nndf
    from nndf.backends import frameworks

    real = frameworks.static_steps
    if static is not None:  # the static cache without CUDA graphs, to see what the graphs themselves bring
        frameworks.static_steps = lambda *args: static
    try:
        model = nndf.load(loaded.spec.family, loaded.variant.name, backend=backend, loaded=loaded, settings=settings,
                          **options)
    finally:
        frameworks.static_steps = real
    def fn(inputs, n, decoding):
        seeded = dict(decoding, seed=SAMPLING_SEED) if decoding else {}
        return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, **seeded)

    return fn, model


def _seeded_hf(generate, inputs: dict, n: int, decoding: dict) -> torch.Tensor:
    """Hugging Face's generate(): a sampled run seeded as `seed=` seeds ours (torch.manual_seed just before)."""
    if decoding:
        torch.manual_seed(SAMPLING_SEED)
    return generate(**inputs, max_new_tokens=n, min_new_tokens=n, **(decoding or {"do_sample": False}))


def make_engine(name: str, loaded, settings, args) -> Callable[[dict, int, dict], torch.Tensor]:
    """The engine `name` over the shared weights, as (inputs, new tokens, sampling keywords or {} for greedy) ->
    whole sequences; or Unavailable with the reason."""
    import importlib.util

    import nndf

    device = torch.device(args.device)
    if name in CUDA_ONLY and device.type != "cuda":
        raise Unavailable(CUDA_ONLY[name])
    if name == "hf-eager":
        reference = nndf.load(loaded.spec.family, loaded.variant.name, loaded=loaded, settings=settings)
        fn = lambda inputs, n, decoding: _seeded_hf(reference.hf_generate, inputs, n, decoding)  # noqa: E731
    elif name == "hf-compile":
        model = loaded.model

        def fn(inputs, n, decoding):
            ids = {k: v.to(device) for k, v in inputs.items()}
            with torch.inference_mode():
                return _seeded_hf(model.generate, dict(ids, cache_implementation="static"), n, decoding).cpu()
    elif name == "ours-eager":
        fn, _ = _ours(loaded, settings)
    elif name == "ours-static":
        fn, _ = _ours(loaded, settings, static=True)
    elif name == "ours-cuda-graph":
        fn, _ = _ours(loaded, settings, cuda_graph=True)
    elif name == "onnxrt":
        if device.type == "cuda" and importlib.util.find_spec("onnxruntime") is not None:
            import onnxruntime

            if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
                raise Unavailable("ONNX Runtime here has no CUDA provider (install the onnxruntime-gpu extra)")
        fn, model = _ours(loaded, settings, backend="onnxrt", working_dir=args.working_dir)
        if device.type == "cuda" and getattr(model.decoder.session, "provider", "") != "CUDAExecutionProvider":
            raise Unavailable("ONNX Runtime fell back to the CPU (no CUDA provider in this session)")
    elif name == "trt":
        if importlib.util.find_spec("tensorrt") is None or device.type != "cuda":
            raise Unavailable("TensorRT is not installed" if device.type == "cuda" else "TensorRT needs a CUDA GPU")
        fn, _ = _ours(loaded, settings, backend="trt", working_dir=args.working_dir)
    else:
        raise Unavailable(f"unknown engine; known: {', '.join(ENGINES)}")
    return fn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(engine: Engine, inputs: dict, n: int, device: torch.device) -> tuple[float, torch.Tensor]:
    _sync(device)
    start = time.perf_counter()
    tokens = engine.generate(inputs, n)
    _sync(device)
    return time.perf_counter() - start, tokens


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy reads (and writes): the memory speed a decode step can reach."""
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times[2:])  # each byte is read once and written once


def prompts(loaded, batch: int, length: int) -> dict:
    generator = torch.Generator().manual_seed(batch)
    vocab = int(loaded.spec.hooks.vocab_size(loaded.config))
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def measure(engines: list[Engine], loaded, batch: int, args) -> None:
    device = torch.device(args.device)
    inputs = prompts(loaded, batch, args.input_len)
    for engine in engines:  # warm-up: compilation, graph capture, autotuning
        for n in (1, args.output_len):
            timed(engine, inputs, n, device)
    for round_index in range(args.rounds):
        for engine in engines[round_index % len(engines):] + engines[: round_index % len(engines)]:
            engine.t1.append(timed(engine, inputs, 1, device)[0])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds, engine.tokens = timed(engine, inputs, args.output_len, device)
            engine.tn.append(seconds)
            if device.type == "cuda":
                engine.peak = max(engine.peak or 0, torch.cuda.max_memory_allocated(device))


def summary(engine: Engine, batch: int, args) -> dict:
    t1, tn = statistics.median(engine.t1), statistics.median(engine.tn)
    return {"first_token_ms": 1000 * t1, "step_ms": 1000 * (tn - t1) / (args.output_len - 1),
            "tokens_per_s": batch * args.output_len / tn, "peak_bytes": engine.peak}


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> str:
    if tokens.shape == reference.shape and torch.equal(tokens, reference):
        return "identical"
    width = min(tokens.shape[1], reference.shape[1])
    return f"{100 * (tokens[:, :width] == reference[:, :width]).float().mean():.0f}% equal"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", default="GPT2")
    p.add_argument("--variant", default=None, help="default: the family's first variant")
    p.add_argument("--torch-dir", help="a local Hugging Face folder instead of seeded random weights")
    p.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=positive, default=128, help="prompt (encoder input for T5/BART) tokens")
    p.add_argument("--output-len", type=positive, default=128, help="new tokens (at least 2)")
    p.add_argument("--rounds", type=positive, default=5)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--fp32", action="store_true", help="fp32 weights (default fp16 on CUDA; the CPU runs fp32)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--working-dir", default="temp", help="ONNX exports and TensorRT engines")
    p.add_argument("--sample", action="store_true",
                   help="also time each engine sampling (top-k 50, seeded), beside its greedy run")
    p.add_argument("--top-p", type=float, help="with --sample: top-p as well (its warper sorts the vocabulary)")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = parse_checked(p, argv)
    if args.top_p is not None and not (args.sample and 0 < args.top_p <= 1):
        p.error("--top-p applies to --sample and lies in (0, 1]")
    if args.output_len < 2:
        p.error("--output-len must be at least 2: the decode step is (T(N) - T(1)) / (N - 1)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("decoder_gpu.py: no CUDA device here; it measures a GPU (--device cpu checks the script on the CPU "
              "engines)", file=sys.stderr)
        return 2

    from nndf.architectures import architecture
    from nndf.loading import load_model
    from nndf.registry import resolve
    from nndf.spec import BuildSettings

    spec, variant = resolve(args.family, args.variant)
    if architecture(spec).takes_images:
        print(f"error: bench/decoder_gpu.py measures text generation; {spec.family} captions images (time it with "
              "run.py benchmark ... --image)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" and not args.fp32 else torch.float32
    start = time.perf_counter()
    loaded = load_model(spec, variant, torch_dir=args.torch_dir, random_weights=args.torch_dir is None, dtype=dtype,
                        device=device)
    loaded.model  # noqa: B018 (built now, so that its time is reported apart)
    print(f"{spec.family} {variant.name}: weights ready in {time.perf_counter() - start:.1f} s on {device}",
          file=sys.stderr)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bandwidth = copy_bandwidth(device)
    floor_ms = 1000 * weight_bytes / bandwidth
    report = {"family": spec.family, "variant": variant.name, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "dtype": str(dtype), "input_len": args.input_len,
              "output_len": args.output_len, "rounds": args.rounds, "weight_bytes": weight_bytes,
              "copy_bandwidth": bandwidth, "floor_ms": floor_ms, "skipped": {}, "batches": {}}
    sampled = {"do_sample": True, "top_k": 50} if args.sample else None
    if sampled and args.top_p is not None:
        sampled["top_p"] = args.top_p
    report["sampling"] = sampled
    for batch in args.batch_sizes:
        settings = BuildSettings(batch_size=batch, input_seq_len=args.input_len, output_seq_len=args.output_len,
                                 fp16=dtype == torch.float16)
        engines = []
        for name in args.engines:
            try:
                run = make_engine(name, loaded, settings, args)
            except Unavailable as why:
                report["skipped"][name] = str(why)
                continue
            engines.append(Engine(name, lambda inputs, n, run=run: run(inputs, n, {})))
            if sampled:  # its sampled twin, in the same rounds
                engines.append(Engine(name + SAMPLED, lambda inputs, n, run=run: run(inputs, n, sampled)))
        measure(engines, loaded, batch, args)
        tokens = {e.name: e.tokens for e in engines}
        rows = {}
        for engine in engines:
            rows[engine.name] = summary(engine, batch, args)
            reference = tokens.get("hf-eager" + (SAMPLED if engine.name.endswith(SAMPLED) else ""))
            rows[engine.name]["tokens"] = agreement(engine.tokens, reference) if reference is not None else "-"
        report["batches"][batch] = rows
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


def _ratio(rows: dict, engine: str, reference: str) -> float | None:
    if engine in rows and reference in rows and rows[reference]["step_ms"] > 0:
        return rows[engine]["step_ms"] / rows[reference]["step_ms"]
    return None


def render(report: dict) -> str:
    fmt = (lambda v, d=2: "-" if v is None else f"{v:.{d}f}")
    times = (lambda v, d=2: "-" if v is None else f"{v:.{d}f}x")
    lines = [f"# {report['family']} {report['variant']} on {report['device']}, {report['dtype']}, "
             f"{report['input_len']} + {report['output_len']} tokens, {report['rounds']} rounds",
             f"floor: {report['weight_bytes'] / 1e9:.3f} GB of weights / {report['copy_bandwidth'] / 1e12:.2f} TB/s "
             f"copy bandwidth = {report['floor_ms']:.3f} ms per step", ""]
    sampling = report.get("sampling")
    for batch, rows in report["batches"].items():
        table = []
        for name, r in rows.items():
            twin = SAMPLED if name.endswith(SAMPLED) else ""  # a sampled row is set against sampled rows
            row = [name, fmt(r["first_token_ms"]), fmt(r["step_ms"], 3), fmt(r["tokens_per_s"], 1),
                   "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}", r["tokens"],
                   times(_ratio(rows, name, "hf-eager" + twin)), times(_ratio(rows, name, "hf-compile" + twin)),
                   times(r["step_ms"] / report["floor_ms"], 1)]
            if sampling:
                row.append(times(_ratio(rows, name, name[: -len(SAMPLED)])) if twin else "-")
            table.append(row)
        header = ["engine", "first token ms", "ms/step", "tok/s", "peak MiB", "tokens vs hf-eager", "/ hf-eager",
                  "/ hf-compile", "/ floor"] + (["/ greedy"] if sampling else [])
        lines += [f"## batch {batch}", format_table(header, table), ""]
    if sampling:
        settings = ", ".join(f"{key}={value}" for key, value in sampling.items())
        lines += [f"sampled rows: generate({settings}), seeded with {SAMPLING_SEED}; their tokens against hf-eager "
                  "sampled's,", "/ hf-eager and / hf-compile against those engines' sampled rows, / greedy: the step "
                  "over the same engine's greedy one", ""]
    for name, why in report["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    lines += goal_lines(report)
    return "\n".join(lines)


def goal_lines(report: dict) -> list[str]:
    """The issue's goals at batch 1, PASS / FAIL, or why they were not measured."""
    rows = report["batches"].get(1)
    if rows is None:
        return ["goals: not measured (they are set at batch 1)"]
    out = ["", "goals (batch 1):"]

    def check(label: str, value: float | None, bound: float) -> None:
        if value is None:
            out.append(f"  SKIP {label}: a row it needs did not run")
        else:
            out.append(f"  {'PASS' if value <= bound else 'FAIL'} {label}: {value:.2f} (bound {bound})")

    check("ours-eager / hf-eager ms per step", _ratio(rows, "ours-eager", "hf-eager"), 1.0)
    vs_compile, vs_floor = GOALS.get((report["family"], report["variant"]), (None, None))
    if vs_compile is not None:
        check("ours-cuda-graph / hf-compile ms per step", _ratio(rows, "ours-cuda-graph", "hf-compile"), vs_compile)
    if vs_floor is not None and "ours-cuda-graph" in rows:
        check("ours-cuda-graph / floor", rows["ours-cuda-graph"]["step_ms"] / report["floor_ms"], vs_floor)
    greedy = {name: r for name, r in rows.items() if not name.endswith(SAMPLED)}
    unequal = [name for name, r in greedy.items() if r["tokens"] not in ("identical", "-")]
    out.append(f"  {'FAIL' if unequal else 'PASS'} tokens equal hf-eager's" + (f" (not: {unequal})" if unequal
                                                                                 else ""))
    ours = {name: r for name, r in rows.items() if name.endswith(SAMPLED) and name.startswith("ours")}
    if ours:  # seeded sampling means generate()'s draws (issue 22); HF's compiled kernels round otherwise
        unequal = [name for name, r in ours.items() if r["tokens"] not in ("identical", "-")]
        out.append(f"  {'FAIL' if unequal else 'PASS'} our sampled tokens equal hf-eager sampled's"
                   + (f" (not: {unequal})" if unequal else ""))
    return out


if __name__ == "__main__":
    sys.exit(run_script("decoder_gpu.py", main))
