"""`--random-weights` build time, side by side: transformers' `from_config` against `nndf.random_weights`.

    HF_HUB_OFFLINE=1 python bench/random_weights.py                      # gpt2-large, gpt2-xl, a 1B Llama; fp32
    HF_HUB_OFFLINE=1 python bench/random_weights.py --models GPT2:gpt2 GPT2:gpt2-medium --rounds 3 --dtype fp16

`from_config` (seeded with `torch.manual_seed`, built on the CPU in the final dtype) is what `--random-weights` ran
before issue 20; `nndf` is `nndf.random_weights.build_random_model`, what it runs now. Every build runs in a fresh
child process (this script with `--child`), so that neither starts with memory the other freed; the child imports
the model's module first (about 2 s here, the same for both, and paid by any run before it builds a model), then
times the build from its start to a model whose weights are drawn and tied.
Builds alternate between the two, round by round. A model is `FAMILY:VARIANT` from the registry (its known
config).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.bench import BUSY_CORES  # noqa: E402
from harness.render import format_table  # noqa: E402
from harness.stats import CpuWatch  # noqa: E402
from harness.cli import parse_checked, positive, run_script  # noqa: E402

DEFAULT_MODELS = ["GPT2:gpt2-large", "GPT2:gpt2-xl", "Llama:Llama-3.2-1B"]
BUILDERS = ("from_config", "nndf")
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# Issue 20's goals, in seconds for the nndf build (fp32, CPU): gpt2-large, and any model of about 1 G parameters.
GOALS = {"GPT2:gpt2-large": 5.0, "Llama:Llama-3.2-1B": 10.0}


def model_config(name: str):
    """(transformers auto class, known config) of a registry `FAMILY:VARIANT`."""
    import transformers
    from nndf.loading import known_config
    from nndf.registry import resolve

    family, _, variant = name.partition(":")
    spec, var = resolve(family, variant or None)
    return getattr(transformers, spec.auto_class), known_config(var)


def child(name: str, builder: str, dtype_name: str, seed: int) -> dict:
    """One build in this process: seconds from its start to a model with drawn, tied weights."""
    import torch

    from nndf.random_weights import build_random_model

    auto, config = model_config(name)
    dtype = getattr(torch, DTYPES[dtype_name])
    auto._model_mapping[type(config)]  # imports the model's module (and transformers' modeling code): not timed
    watch = CpuWatch()
    watch.start([os.getpid()])
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    if builder == "from_config":
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = auto.from_config(config, dtype=dtype)
    else:
        model = build_random_model(auto, config, dtype=dtype, device="cpu", seed=seed)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_started
    foreign = watch.foreign_cores()
    params = sum(p.numel() for p in model.parameters())
    return {"seconds": seconds, "cpu_seconds": cpu, "parameters": params, "foreign_cores": foreign}


def _cpu_seconds() -> float:
    """CPU time of this process, all threads (user + system: page faults of fresh memory are system time)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(name: str, builder: str, args) -> dict:
    command = [sys.executable, __file__, "--child", name, builder, "--dtype", args.dtype, "--seed", str(args.seed)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {builder} build of {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                   help="FAMILY:VARIANT of the registry (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights' dtype (default: %(default)s)")
    p.add_argument("--rounds", type=positive, default=1, help="builds of each kind per model (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "BUILDER"), help=argparse.SUPPRESS)
    args = parse_checked(p, argv)
    from nndf.errors import UsageError
    from nndf.registry import resolve

    for name in args.models:
        if ":" not in name:
            p.error(f"--models {name}: give FAMILY:VARIANT (python run.py list)")
        try:
            resolve(*name.split(":", 1))
        except UsageError as exc:
            p.error(f"--models {name}: {exc}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.dtype, args.seed)))
        return 0
    rows, busiest = [], 0.0
    for name in args.models:
        times = {builder: [] for builder in BUILDERS}
        cpu = {builder: [] for builder in BUILDERS}
        params = 0
        for round_ in range(args.rounds):
            for builder in BUILDERS if round_ % 2 == 0 else BUILDERS[::-1]:
                print(f"{name}: {builder} build, round {round_ + 1} of {args.rounds} ...", file=sys.stderr,
                      flush=True)
                result = run_child(name, builder, args)
                times[builder].append(result["seconds"])
                cpu[builder].append(result["cpu_seconds"])
                params = result["parameters"]
                busiest = max(busiest, result["foreign_cores"] or 0.0)
        old, new = (statistics.median(times[b]) for b in BUILDERS)
        old_cpu, new_cpu = (statistics.median(cpu[b]) for b in BUILDERS)
        goal = GOALS.get(name) if args.dtype == "fp32" else None
        rows.append([name, f"{params / 1e9:.2f} G", f"{old:.1f}", f"{new:.1f}", f"{old / new:.1f}x",
                     f"{old_cpu:.1f}", f"{new_cpu:.1f}",
                     "-" if goal is None else f"< {goal:.0f} s: {'met' if new < goal else 'NOT met'}"])
    print(f"random weights on the CPU, {args.dtype}, seed {args.seed}, median of {args.rounds} build(s) each: "
          f"seconds from the start of the build to drawn, tied weights (wall clock, and CPU time of all threads)")
    print(format_table(["model", "parameters", "from_config s", "nndf s", "ratio", "from_config CPU s",
                        "nndf CPU s", "goal (nndf s)"], rows))
    note = f"other processes used up to {busiest:.2f} of {os.cpu_count()} cores during a build"
    print(f"WARNING: {note}: the times are inflated" if busiest >= BUSY_CORES else note)
    return 0


if __name__ == "__main__":
    sys.exit(run_script("random_weights.py", main))
