#!/usr/bin/env python
"""Decoder speed on the CPU, side by side in one run: Hugging Face eager, our loop on PyTorch and ONNX Runtime
(fp32 / int8 / int4), and Hugging Face Optimum's ORTModelForCausalLM.

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
  needs 5.x), created under the working dir on first use. Its code is the `_optimum_*` part of this file and
  imports only the standard library, torch, numpy, transformers and optimum: never nndf.
- After one warm-up generation per engine and batch size, every round runs each batch size on each engine in
  turn (the engine order rotates from round to round), on the same seeded random prompt, greedy, with exactly
  `--output-len` new tokens (EOS suppressed until then).
- Per engine and batch: decode ms/step (median over rounds of each run's median step), time to first token and
  end-to-end tokens/s (batch * output_len / generation time), with the spread (max - min) / median over rounds.
- Ratios last: each engine against hf and against optimum, then the goals as PASS / FAIL / SKIP lines.

Nothing in this module imports nndf, torch or transformers at import time: the same file is the Optimum worker.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("hf", "nndf-frameworks", "onnxrt", "onnxrt-int8", "onnxrt-int4", "optimum")
DEFAULT_ENGINES = ("hf", "onnxrt", "onnxrt-int8", "onnxrt-int4", "optimum")
ENGINE_HELP = {
    "hf": "Hugging Face eager generate() with KV cache (PyTorch, transformers 5.x)",
    "nndf-frameworks": "our generation loop on PyTorch",
    "onnxrt": "our generation loop on ONNX Runtime, fp32",
    "onnxrt-int8": "our generation loop on ONNX Runtime, int8 weights",
    "onnxrt-int4": "our generation loop on ONNX Runtime, int4 weights",
    "optimum": "Hugging Face Optimum ORTModelForCausalLM (KV cache), in its own virtual environment",
}
QUANTIZE = {"onnxrt-int8": "int8", "onnxrt-int4": "int4"}
EXACT_ENGINES = ("nndf-frameworks", "onnxrt")  # must give hf's tokens exactly (fp32, same weights)
REFERENCES = ("hf", "optimum")

# The Optimum environment. torch is pinned: this exact build lies on this machine's disk (an unpinned torch pulls
# a multi-GB CUDA build); onnxruntime is pinned to the version of this environment, so both ONNX Runtime engines
# run the same runtime; accelerate lets Optimum's exporter store GPT-2's tied embedding once.
OPTIMUM_REQUIREMENTS = ("torch==2.13.0", "transformers<4.58", "optimum-onnx==0.1.0", "accelerate")
OPTIMUM_PACKAGES = ("torch", "transformers", "optimum", "optimum-onnx", "onnxruntime", "onnx", "accelerate", "numpy")


SCRIPT = Path(__file__).resolve()

# The goals: (engine, batch, metric, reference, op, target). `metric` is "step_ms" (decode ms/step, lower is
# better), "tok_s" (end-to-end tokens/s, higher is better) or "peak_rss" (worker peak memory, any batch).
GOALS = (
    ("onnxrt", 1, "step_ms", "hf", "<=", 0.90),
    ("onnxrt", 1, "step_ms", "optimum", "<=", 0.85),
    ("onnxrt", 4, "tok_s", "hf", ">=", 1.9),
    ("onnxrt", 4, "tok_s", "optimum", ">=", 1.3),
    ("onnxrt-int8", 1, "step_ms", "hf", "<=", 0.40),
    ("onnxrt-int4", 1, "step_ms", "hf", "<=", 0.30),
    ("onnxrt-int4", 4, "tok_s", "hf", ">=", 3.0),
    ("onnxrt", None, "peak_rss", "hf", "<=", 1.3),
)
BUSY_CORES = 0.25  # foreign CPU use (in cores) during the measurement above which the report warns
METRIC_LABELS = {"step_ms": "decode ms/step", "tok_s": "tok/s", "peak_rss": "peak memory", "ttft_ms": "first token ms"}

_T0 = time.perf_counter()


def say(message: str) -> None:
    """Progress for people, on stderr, so that stdout is only the report."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------------ arguments

def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="decoder_cpu.py",
        description="Decoder speed on the CPU, side by side in one run: Hugging Face eager, our loop on PyTorch and "
                    "ONNX Runtime fp32/int8/int4, and Optimum's ORTModelForCausalLM. Report on stdout, progress on "
                    "stderr.",
        epilog="engines: " + "; ".join(f"{k}: {v}" for k, v in ENGINE_HELP.items()),
    )
    p.add_argument("--family", default="GPT2", help="registered model family (default GPT2)")
    p.add_argument("--variant", default="gpt2", help="variant of the family (default gpt2)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--random-weights", action="store_true",
                        help="the variant's known config with seeded random weights (the default)")
    source.add_argument("--torch-dir", help="a local Hugging Face model folder to load instead")
    source.add_argument("--hub", action="store_true", help="the variant's hub weights (needs the hub or its cache)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and of the prompts (default 0)")
    p.add_argument("--batch-sizes", type=_positive, nargs="+", default=[1, 4], metavar="N")
    p.add_argument("--input-len", type=_positive, default=64, help="prompt tokens (default 64)")
    p.add_argument("--output-len", type=_positive, default=64, help="new tokens, no early stop (default 64)")
    p.add_argument("--rounds", type=_positive, default=5, help="timed rounds after the warm-up (default 5)")
    p.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES), metavar="ENGINE",
                   help=f"engines to compare, from {', '.join(ENGINES)} (default: {' '.join(DEFAULT_ENGINES)})")
    p.add_argument("--threads", type=_positive, default=None,
                   help="intra-op threads of every engine (default: each runtime's own, one per core)")
    p.add_argument("--working-dir", default="temp", help="weights, exports, the Optimum venv and logs (default temp)")
    p.add_argument("--json", metavar="FILE", help="also write every figure, raw runs included, as JSON")
    # Worker mode: this same file, started by the main process; not for people.
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--weights-dir", help=argparse.SUPPRESS)
    p.add_argument("--onnx-dir", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return args
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        parser.error(f"argument --engines: unknown engine(s) {', '.join(unknown)}; allowed: {', '.join(ENGINES)}")
    args.engines = list(dict.fromkeys(args.engines))
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    if args.torch_dir is None and not args.hub:
        args.random_weights = True
    return args


# --------------------------------------------------------------------------------------------------------- worker
# Everything in this part runs inside a worker process. The optimum worker runs in another environment (old
# transformers, no nndf): it may import only the standard library, torch, numpy, transformers and optimum.

class _Ticks:
    """One generation's token times: start() before the call, mark() once per generated token."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.marks: list[float] = []

    def start(self) -> None:
        self.marks = []
        self.t0 = time.perf_counter()

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def result(self, end: float) -> dict:
        steps = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return {
            "ttft_s": self.marks[0] - self.t0 if self.marks else None,
            "step_median_s": statistics.median(steps) if steps else None,
            "e2e_s": end - self.t0,
            "marks": len(self.marks),
        }


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _ru_maxrss_bytes() -> int:
    """ru_maxrss: KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _peak_rss_bytes() -> int:
    """This process's own peak resident set: VmHWM where /proc has it, else ru_maxrss.

    On Linux, ru_maxrss is kept across fork + exec, so a worker's ru_maxrss is at least the parent's peak RSS when
    it was started (the main process that built GPT-2's weights is ~1 GB): VmHWM is the same high-water mark for
    the worker's own address space only.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _ru_maxrss_bytes()


def _versions(names) -> dict:
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


class _NndfRunner:
    """hf, nndf-frameworks and onnxrt*: nndf.load on the shared weights folder."""

    def __init__(self, args) -> None:
        import torch

        import nndf

        engine = args.worker
        pytorch = engine in ("hf", "nndf-frameworks")
        if args.threads and pytorch:
            torch.set_num_threads(args.threads)
        self.torch = torch
        self.model = nndf.load(
            args.family, variant=args.variant, backend="frameworks" if pytorch else "onnxrt",
            torch_dir=args.weights_dir, working_dir=args.working_dir, quantize=QUANTIZE.get(engine),
            threads=args.threads,
        )
        self.run = self.model.hf_generate if engine == "hf" else self.model.generate
        self.versions = _versions(["torch", "transformers", "onnxruntime", "nndf"])
        self.versions["torch_threads"] = torch.get_num_threads()

    def inputs(self, rows):
        ids = self.torch.tensor(rows, dtype=self.torch.long)
        return ids, self.torch.ones_like(ids)

    def generate(self, inputs, new_tokens: int, tick):
        ids, mask = inputs
        return self.run(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        num_beams=1, on_token=tick)

    def new_tokens(self, out, inputs) -> list[list[int]]:
        return out[:, inputs[0].shape[1]:].tolist()


class _OptimumRunner:
    """optimum: ORTModelForCausalLM with KV cache on its own export of the same weights. No nndf here."""

    def __init__(self, args) -> None:
        import torch
        from optimum.onnxruntime import ORTModelForCausalLM

        self.torch = torch
        kwargs = {}
        if args.threads:
            import onnxruntime  # optimum's own runtime, for its session options

            torch.set_num_threads(args.threads)
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = args.threads
            kwargs["session_options"] = options
        onnx_dir = Path(args.onnx_dir)
        if args.prepare_only:
            if not (onnx_dir / "config.json").is_file():
                tmp = onnx_dir.with_name(f"{onnx_dir.name}.tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                print(f"optimum: exporting {args.weights_dir} to ONNX ...", file=sys.stderr, flush=True)
                model = ORTModelForCausalLM.from_pretrained(args.weights_dir, export=True, use_cache=True)
                model.save_pretrained(tmp)
                os.replace(tmp, onnx_dir)
            self.model = None
            return
        self.model = ORTModelForCausalLM.from_pretrained(onnx_dir, use_cache=True, **kwargs)
        if not getattr(self.model, "use_cache", True):
            raise RuntimeError(f"{onnx_dir} was exported without KV cache")
        gen = self.model.generation_config
        eos = gen.eos_token_id[0] if isinstance(gen.eos_token_id, (list, tuple)) else gen.eos_token_id
        self.pad = gen.pad_token_id if gen.pad_token_id is not None else eos
        self.versions = _versions(OPTIMUM_PACKAGES)
        self.versions["torch_threads"] = torch.get_num_threads()
        self.versions["providers"] = ",".join(self.model.providers) if hasattr(self.model, "providers") else "?"
        self.versions["use_io_binding"] = str(getattr(self.model, "use_io_binding", "?"))

    def inputs(self, rows):
        ids = self.torch.tensor(rows, dtype=self.torch.long)
        return ids, self.torch.ones_like(ids)

    def generate(self, inputs, new_tokens: int, tick):
        from transformers import LogitsProcessor, LogitsProcessorList

        class Tick(LogitsProcessor):  # called once per step right after the forward pass, as in nndf's hf_generate
            def __call__(self, ids, scores):
                tick()
                return scores

        ids, mask = inputs
        with self.torch.inference_mode():
            return self.model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=1,
                do_sample=False, use_cache=True, pad_token_id=self.pad, logits_processor=LogitsProcessorList([Tick()]),
            )

    def new_tokens(self, out, inputs) -> list[list[int]]:
        return out[:, inputs[0].shape[1]:].tolist()


def worker_main(args) -> int:
    """Serve one engine: one JSON command per stdin line, one JSON answer per line on the protocol channel.

    The protocol channel is the original stdout; fd 1 itself is pointed at stderr, so that whatever a library
    prints (C code included) lands in the worker's log rather than in the answers.
    """
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)

    def answer(obj: dict) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    started = time.perf_counter()
    try:
        runner = (_OptimumRunner if args.worker == "optimum" else _NndfRunner)(args)
    except BaseException as exc:  # noqa: BLE001 - the main process needs the reason, whatever it is
        import traceback

        traceback.print_exc()
        answer({"ok": False, "error": one_line(exc)})
        return 1
    if args.prepare_only:
        answer({"ok": True, "prepared": True, "seconds": time.perf_counter() - started})
        return 0
    answer({"ok": True, "ready": True, "engine": args.worker, "pid": os.getpid(),
            "load_s": time.perf_counter() - started, "versions": runner.versions})
    ticks = _Ticks()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            kind = command.get("cmd")
            if kind == "generate":
                inputs = runner.inputs(command["input_ids"])
                ticks.start()
                out = runner.generate(inputs, int(command["new_tokens"]), ticks.mark)
                end = time.perf_counter()
                answer(dict(ticks.result(end), ok=True, tokens=runner.new_tokens(out, inputs)))
            elif kind == "memory":
                answer({"ok": True, "peak_rss_bytes": _peak_rss_bytes(), "rss_bytes": _rss_bytes(),
                        "ru_maxrss_bytes": _ru_maxrss_bytes()})
            elif kind == "quit":
                answer({"ok": True})
                sys.stderr.flush()
                os._exit(0)  # nothing left to save; skips seconds of torch / ONNX Runtime teardown
            else:
                answer({"ok": False, "error": f"unknown command {kind!r}"})
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            answer({"ok": False, "error": one_line(exc)})
    return 0


# ---------------------------------------------------------------------------------------------- main: preparation

class EngineError(Exception):
    """An engine cannot run; the message is the reason shown in its row."""


def _log_tail(path: Path, lines: int = 3) -> str:
    """The last few meaningful lines of a log, for a one-line reason."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    useful = [t.strip() for t in text if t.strip() and "Warning" not in t and not t.startswith(" ")]
    errors = [t for t in useful if "error" in t.lower()]
    picked = (errors or useful)[-lines:]
    return " | ".join(picked)[-400:]


def _folder_signature(folder: Path) -> list:
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(folder.iterdir()) if p.is_file()]


def _short_hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:12]


def prepare_weights(args, working_dir: Path) -> tuple[Path, str]:
    """The Hugging Face folder every worker loads, and a description of where its weights come from."""
    if args.torch_dir:
        folder = Path(args.torch_dir).resolve()
        if not (folder / "config.json").is_file():
            from nndf.errors import UsageError

            raise UsageError(f"--torch-dir {args.torch_dir} has no config.json")
        return folder, f"local folder {folder}"
    from nndf.loading import load_model
    from nndf.registry import get_spec

    spec = get_spec(args.family)
    variant = spec.variant(args.variant)
    if args.hub:
        kind, what = "hub", f"hub {variant.hub_id}"
    else:
        kind, what = f"random-seed{args.seed}", f"random weights (seed {args.seed})"
    key = _short_hash([spec.family, variant.name, sorted(variant.config.items()), kind])
    folder = working_dir / "bench-weights" / f"{spec.family}-{variant.name}-{kind}-{key}"
    if (folder / "config.json").is_file():
        say(f"weights: reusing {folder}")
        return folder, what
    say(f"weights: building {spec.family} {variant.name} ({what}) into {folder} ...")
    loaded = load_model(spec, variant, random_weights=not args.hub, seed=args.seed, device="cpu")
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    loaded.model.save_pretrained(tmp)
    os.replace(tmp, folder)
    del loaded
    return folder, what


def optimum_requirements() -> list[str]:
    reqs = list(OPTIMUM_REQUIREMENTS)
    ort = _versions(["onnxruntime"]).get("onnxruntime")
    reqs.append(f"onnxruntime=={ort}" if ort else "onnxruntime")
    return reqs


def _run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> int:
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {timeout:.0f} s\n")
            return -1


def optimum_environment(working_dir: Path, logs: Path) -> tuple[Path, dict]:
    """The Optimum venv's python and its package versions; created (python -m venv + pip) on first use."""
    venv = working_dir / "optimum-venv"
    python = venv / "bin" / "python"
    marker = venv / "nndf-bench-ready.json"
    reqs = optimum_requirements()
    try:
        ready = json.loads(marker.read_text())
        if ready.get("requirements") == reqs and python.exists():
            return python, ready["versions"]
    except (OSError, ValueError, KeyError):
        pass
    log = logs / "optimum-venv-setup.log"
    say(f"optimum: creating its environment in {venv} (pip install {' '.join(reqs)}; log {log}) ...")
    shutil.rmtree(venv, ignore_errors=True)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    if _run_logged([sys.executable, "-m", "venv", str(venv)], log, 300, env) != 0:
        raise EngineError(f"python -m venv failed: {_log_tail(log)} (log {log})")
    if _run_logged([str(python), "-m", "pip", "install", *reqs], log, 1800, env) != 0:
        raise EngineError(f"pip install failed: {_log_tail(log)} (log {log})")
    probe = ("import json, optimum.onnxruntime, transformers, torch, onnxruntime; from importlib import metadata; "
             f"print(json.dumps({{n: metadata.version(n) for n in {list(OPTIMUM_PACKAGES)!r}}}))")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        with open(log, "a", encoding="utf-8") as f:
            f.write(done.stderr)
        raise EngineError(f"optimum does not import in its environment: {_log_tail(log)} (log {log})")
    versions = json.loads(done.stdout.strip().splitlines()[-1])
    marker.write_text(json.dumps({"requirements": reqs, "versions": versions}, indent=2))
    say("optimum: environment ready: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return python, versions


def worker_env(optimum: bool) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if optimum:
        env.pop("PYTHONPATH", None)
        env["PYTHONNOUSERSITE"] = "1"
    return env


class Worker:
    """One engine's process, kept alive and driven by one-line JSON commands."""

    def __init__(self, engine: str, python: Path | str, argv: list[str], log: Path, env: dict) -> None:
        self.engine = engine
        self.log_path = log
        self._log = open(log, "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [str(python), str(SCRIPT), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, bufsize=1, env=env,
        )

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise EngineError(f"worker exited with code {code}: {_log_tail(self.log_path)} (log {self.log_path})")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise EngineError(f"{answer.get('error')} (log {self.log_path})")
        return answer

    def request(self, command: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            code = self.proc.wait()
            raise EngineError(f"worker exited with code {code}: {_log_tail(self.log_path)} (log {self.log_path})")
        return self.receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                with contextlib.suppress(OSError):  # a quit already sent by close_all leaves the pipe open
                    self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self._log.close()


def close_all(workers: list[Worker]) -> None:
    """Ask every worker to quit first, then wait for each: their teardowns overlap instead of adding up."""
    for worker in workers:
        with contextlib.suppress(OSError):
            if worker.proc.poll() is None:
                worker.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                worker.proc.stdin.flush()
    for worker in workers:
        worker.close()


def start_engine(engine: str, args, weights: Path, working_dir: Path, logs: Path, env_info: dict) -> Worker:
    """Prepare the engine's files in a short-lived process (exports, quantization), then start its worker."""
    log = logs / f"{engine}.log"
    log.write_text("")
    argv = ["--worker", engine, "--family", args.family, "--variant", args.variant, "--weights-dir", str(weights),
            "--working-dir", str(working_dir)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    python: Path | str = sys.executable
    if engine == "optimum":
        python, versions = optimum_environment(working_dir, logs)
        env_info["optimum"] = {"python": str(python), "requirements": optimum_requirements(), "versions": versions}
        key = _short_hash([str(weights), _folder_signature(weights), versions])
        argv += ["--onnx-dir", str(working_dir / "bench-optimum-onnx" / f"{weights.name}-{key}")]
        (working_dir / "bench-optimum-onnx").mkdir(exist_ok=True)
    env = worker_env(engine == "optimum")
    if engine != "hf" and engine != "nndf-frameworks":
        say(f"{engine}: preparing (export{', quantization' if engine in QUANTIZE else ''}; reused when cached) ...")
        with open(log, "a", encoding="utf-8") as f:
            done = subprocess.run([str(python), str(SCRIPT), *argv, "--prepare-only"], stdout=subprocess.PIPE,
                                  stderr=f, text=True, env=env)
        answers = [json.loads(t) for t in done.stdout.splitlines() if t.startswith("{")]
        if done.returncode != 0 or not answers or not answers[-1].get("ok"):
            why = answers[-1].get("error") if answers else f"exit code {done.returncode}: {_log_tail(log)}"
            raise EngineError(f"preparation failed: {why} (log {log})")
    say(f"{engine}: starting its worker ...")
    worker = Worker(engine, python, argv, log, env)
    try:
        worker.ready = worker.receive()
    except (EngineError, ValueError) as exc:
        worker.close()
        raise EngineError(str(exc)) from None
    say(f"{engine}: ready in {worker.ready['load_s']:.1f} s (pid {worker.ready['pid']})")
    return worker


# ---------------------------------------------------------------------------------------------- main: measurement

class CpuWatch:
    """How much CPU processes other than ours used while we measured, in cores (from /proc; None elsewhere).

    On a 2-core machine one busy foreign process starves one of the two threads that each runtime uses by default,
    and the runtimes do not suffer alike (PyTorch's step waits for its slowest thread): the report says so.
    """

    def __init__(self) -> None:
        self.start_time = self.machine = None
        self.ours: dict[int, int] = {}

    @staticmethod
    def _machine_busy() -> int:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait

    @staticmethod
    def _process(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            return 0

    def start(self, pids: list[int]) -> None:
        try:
            self.machine = self._machine_busy()
        except OSError:
            return
        self.ours = {pid: self._process(pid) for pid in pids}
        self.start_time = time.perf_counter()

    def foreign_cores(self) -> float | None:
        if self.start_time is None:
            return None
        elapsed = time.perf_counter() - self.start_time
        machine = self._machine_busy() - self.machine
        ours = sum(self._process(pid) - before for pid, before in self.ours.items())
        return max(0.0, (machine - ours) / os.sysconf("SC_CLK_TCK") / elapsed) if elapsed > 0 else None


def stat(values: list[float]) -> dict | None:
    """Median, min, max and spread = (max - min) / median in % of a list of per-round values."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return {"median": med, "min": lo, "max": hi, "spread_pct": 100.0 * (hi - lo) / med if med else 0.0,
            "n": len(values), "values": values}


def token_agreement(reference: list[list[int]], runs: list[list[list[int]]]) -> dict:
    """How many new tokens of `runs` equal the reference's at the same row and position, and the first that do not."""
    equal = total = 0
    first = None
    for rows in runs:
        for r, (ref_row, row) in enumerate(zip(reference, rows)):
            for s, (a, b) in enumerate(zip(ref_row, row)):
                total += 1
                if a == b:
                    equal += 1
                elif first is None:
                    first = {"row": r, "step": s}
            total += abs(len(ref_row) - len(row))
    return {"equal": equal, "total": total, "share": equal / total if total else None,
            "identical": total > 0 and equal == total, "first_difference": first}


def summarize(runs: dict, warm: dict, args) -> dict:
    """Per batch and engine: statistics over the timed rounds and the token check against hf."""
    batches = {}
    for b in args.batch_sizes:
        per = {}
        reference = warm.get(b, {}).get("hf", {}).get("tokens")
        for engine, results in runs.get(b, {}).items():
            if not results:
                continue
            entry = {
                "step_ms": stat([r["step_median_s"] * 1e3 for r in results if r["step_median_s"] is not None]),
                "ttft_ms": stat([r["ttft_s"] * 1e3 for r in results if r["ttft_s"] is not None]),
                "tok_s": stat([b * args.output_len / r["e2e_s"] for r in results]),
                "e2e_s": stat([r["e2e_s"] for r in results]),
                "marks": sorted({r["marks"] for r in results}),
                "tokens": None,
            }
            if reference is not None:
                outputs = [warm[b][engine]["tokens"]] + [r["tokens"] for r in results]
                entry["tokens"] = token_agreement(reference, outputs)
            per[engine] = entry
        batches[b] = per
    return batches


def metric(report: dict, engine: str, batch: int | None, name: str) -> float | None:
    if name == "peak_rss":
        return report["engines"].get(engine, {}).get("peak_rss_bytes")
    entry = report["batches"].get(batch, {}).get(engine) or {}
    value = entry.get(name)
    return value["median"] if value else None


def ratio(report: dict, engine: str, reference: str, batch: int | None, name: str) -> float | None:
    a, b = metric(report, engine, batch, name), metric(report, reference, batch, name)
    return a / b if a is not None and b else None


def compute_ratios(report: dict) -> list[dict]:
    """Batch 1: decode ms/step / reference; larger batches: tok/s / reference; then peak memory / hf."""
    rows = []
    engines = [e for e in report["settings"]["engines"]]
    for b in report["settings"]["batch_sizes"]:
        name = "step_ms" if b == 1 else "tok_s"
        for e in engines:
            if metric(report, e, b, name) is None:
                continue
            rows.append({"batch": b, "metric": name, "engine": e,
                         "value": metric(report, e, b, name),
                         **{f"vs_{ref}": ratio(report, e, ref, b, name) for ref in REFERENCES}})
    for e in engines:
        if metric(report, e, None, "peak_rss") is not None:
            rows.append({"batch": None, "metric": "peak_rss", "engine": e, "value": metric(report, e, None, "peak_rss"),
                         "vs_hf": ratio(report, e, "hf", None, "peak_rss")})
    return rows


def _why_missing(report: dict, engine: str, batch: int | None) -> str:
    info = report["engines"].get(engine)
    if info is None:
        return f"{engine} was not among --engines"
    if info.get("status") != "ok" and info.get("reason"):
        return f"{engine} did not run: {info['reason']}"
    if batch is not None and batch not in report["settings"]["batch_sizes"]:
        return f"batch {batch} was not among --batch-sizes"
    return f"no figure for {engine}"


def evaluate_goals(report: dict) -> list[dict]:
    """Each goal as PASS, FAIL or SKIP (with the reason), plus the token check of onnxrt fp32 against hf."""
    goals = []
    for engine, batch, name, reference, op, target in GOALS:
        where = f"batch {batch} " if batch is not None else ""
        label = f"{where}{engine} {METRIC_LABELS[name]} / {reference}"
        value = ratio(report, engine, reference, batch, name)
        goal = {"engine": engine, "batch": batch, "metric": name, "reference": reference, "op": op, "target": target,
                "ratio": value, "label": label}
        if value is None:
            missing = engine if metric(report, engine, batch, name) is None else reference
            why = _why_missing(report, missing, batch)
            goal.update(status="SKIP", text=f"{label} (goal {op} {target:.2f}x): {why}")
        else:
            ok = value <= target if op == "<=" else value >= target
            shown = f"{value:.2f}" if f"{value:.2f}" != f"{target:.2f}" else f"{value:.4f}"  # 2.998 is not 3.00
            goal.update(status="PASS" if ok else "FAIL", text=f"{label} = {shown}x (goal {op} {target:.2f}x)")
        goals.append(goal)
    checked = [(b, e["onnxrt"]["tokens"]) for b, e in report["batches"].items()
               if e.get("onnxrt") and e["onnxrt"].get("tokens")]
    label = "onnxrt fp32 tokens equal hf's"
    if not checked:
        goals.append({"status": "SKIP", "label": label, "engine": "onnxrt", "metric": "tokens",
                      "text": f"{label}: needs both hf and onnxrt"})
    else:
        bad = [f"batch {b}: {100 * t['share']:.1f}% equal" for b, t in checked if not t["identical"]]
        text = f"{label} at batch {', '.join(str(b) for b, _ in checked)}" + (f" ({'; '.join(bad)})" if bad else "")
        goals.append({"status": "FAIL" if bad else "PASS", "label": label, "engine": "onnxrt", "metric": "tokens",
                      "text": text})
    return goals


# ------------------------------------------------------------------------------------------------------- rendering

def format_table(header: list[str], rows: list[list[str]], align: str | None = None, indent: str = "") -> str:
    """Columns padded to their widest cell; `align` has one 'l' or 'r' per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]

    def line(cells):
        out = [str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align)]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(s: dict | None) -> str:
    return "-" if not s else f"{s['spread_pct']:.1f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _tokens_cell(engine: str, entry: dict) -> str:
    t = entry.get("tokens")
    if engine == "hf":
        return "reference" if t is None or t["identical"] else f"reference, varies ({100 * t['share']:.1f}%)"
    if t is None:
        return "-"
    if t["identical"]:
        return "identical"
    text = f"{100 * t['share']:.1f}% equal"
    return f"MISMATCH {text}" if engine in EXACT_ENGINES else text


def render_report(report: dict) -> str:
    s = report["settings"]
    out = []
    out.append(f"decoder_cpu: {s['family']} {s['variant']} ({s['weights']}), {s['input_len']} prompt + "
               f"{s['output_len']} new tokens, greedy, KV cache, {s['rounds']} interleaved rounds after 1 warm-up")
    env = report.get("environment", {})
    main_env = env.get("main", {})
    out.append("main env: " + ", ".join(f"{k} {v}" for k, v in main_env.items()))
    if env.get("optimum"):
        out.append("optimum env: " + ", ".join(f"{k} {v}" for k, v in env["optimum"]["versions"].items()))
    threads = s.get("threads")
    out.append(f"threads: {threads if threads else 'each runtime default'}; figures are medians over rounds, "
               "spread = (max - min) / median")
    machine = report.get("machine") or {}
    foreign, cores = machine.get("foreign_cores"), machine.get("cores")
    if foreign is not None:
        note = f"other processes used {foreign:.2f} of {cores} cores on average while we measured"
        if foreign >= BUSY_CORES:
            note = ("WARNING: " + note + ": absolute figures are inflated and ratios skewed (a runtime whose step waits"
                    " for all of its threads, like PyTorch's, loses more to a busy core; try --threads 1)")
        out.append(note)
    for b in s["batch_sizes"]:
        out.append("")
        out.append(f"batch {b}")
        rows = []
        for e in s["engines"]:
            entry = report["batches"].get(b, {}).get(e)
            if not entry:
                continue
            rows.append([e, _num(metric(report, e, b, "step_ms")), _pct(entry["step_ms"]),
                         _num(metric(report, e, b, "ttft_ms"), 1), _pct(entry["ttft_ms"]),
                         _num(metric(report, e, b, "tok_s"), 1), _pct(entry["tok_s"]), _tokens_cell(e, entry)])
        header = ["engine", "decode ms/step", "spread", "first token ms", "spread", "tok/s", "spread", "tokens vs hf"]
        if rows:
            out.append(format_table(header, rows, "lrrrrrrl", indent="  "))
        for e in s["engines"]:
            info = report["engines"].get(e, {})
            if not report["batches"].get(b, {}).get(e):
                out.append(f"  {e}: not run: {info.get('reason') or 'no result'}")
    # Token check, loud when an exact engine differs.
    out.append("")
    out.append("tokens (greedy, every run against hf's warm-up run of the same batch)")
    for e in s["engines"]:
        if e == "hf":
            continue
        parts, loud = [], []
        for b in s["batch_sizes"]:
            t = (report["batches"].get(b, {}).get(e) or {}).get("tokens")
            if t is None:
                continue
            if t["identical"]:
                parts.append(f"batch {b}: identical")
            else:
                first = t["first_difference"] or {}
                parts.append(f"batch {b}: {100 * t['share']:.1f}% equal (first difference: row {first.get('row')}, "
                             f"new token {first.get('step')})")
            if e in EXACT_ENGINES and not t["identical"]:
                first = t["first_difference"] or {}
                loud.append(f"!!! TOKEN MISMATCH: {e} differs from hf at batch {b}: {100 * t['share']:.1f}% of "
                            f"tokens equal, first difference at row {first.get('row')}, new token {first.get('step')}")
        if parts:
            out.append(f"  {e}: " + "; ".join(parts))
        out.extend("  " + line for line in loud)
    # Ratios last.
    ratios = report["ratios"]
    out.append("")
    out.append("RATIOS (same run, side by side)")
    for b in s["batch_sizes"]:
        name = "step_ms" if b == 1 else "tok_s"
        rows = [[r["engine"], _num(r["value"], 2 if name == "step_ms" else 1), _x(r.get("vs_hf")),
                 _x(r.get("vs_optimum"))] for r in ratios if r["batch"] == b]
        if rows:
            better = "lower is faster" if name == "step_ms" else "higher is faster"
            out.append(f"  batch {b}: {METRIC_LABELS[name]} ({better})")
            out.append(format_table(["engine", METRIC_LABELS[name], "/ hf", "/ optimum"], rows, indent="    "))
    rows = [[r["engine"], f"{r['value'] / 2**20:.0f}", _x(r.get("vs_hf"))] for r in ratios if r["metric"] == "peak_rss"]
    if rows:
        out.append("  peak memory of each worker process (its peak RSS, VmHWM, read at the end)")
        out.append(format_table(["engine", "MiB", "/ hf"], rows, indent="    "))
    out.append("")
    out.append("GOALS")
    for g in report["goals"]:
        out.append(f"  {g['status']:4}  {g['text']}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- main: driver

def run_benchmark(args) -> dict:
    from nndf.actions.common import random_input_ids

    working_dir = Path(args.working_dir).resolve()
    logs = working_dir / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    weights, weights_what = prepare_weights(args, working_dir)
    config = json.loads((weights / "config.json").read_text())
    positions = config.get("n_positions") or config.get("max_position_embeddings")
    if positions and args.input_len + args.output_len > positions:
        from nndf.errors import UsageError

        raise UsageError(f"--input-len {args.input_len} + --output-len {args.output_len} is more than the "
                         f"{positions} positions of this model")
    env_info = {"main": {k: v for k, v in _versions(["torch", "transformers", "onnxruntime", "nndf"]).items()}}
    engines: dict[str, dict] = {e: {"status": "pending", "reason": None, "description": ENGINE_HELP[e]}
                                for e in args.engines}
    workers: dict[str, Worker] = {}

    def fail(engine: str, reason: str) -> None:
        say(f"{engine}: FAILED: {reason}")
        engines[engine].update(status="failed", reason=reason)
        worker = workers.pop(engine, None)
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.close()

    prompts = {b: random_input_ids(b, args.input_len, int(config["vocab_size"]), args.seed).tolist()
               for b in args.batch_sizes}
    warm: dict[int, dict] = {b: {} for b in args.batch_sizes}
    runs: dict[int, dict] = {b: {} for b in args.batch_sizes}

    def generate(engine: str, b: int, what: str) -> dict | None:
        try:
            command = {"cmd": "generate", "input_ids": prompts[b], "new_tokens": args.output_len}
            result = workers[engine].request(command)
        except (EngineError, ValueError) as exc:
            fail(engine, f"{what} at batch {b}: {exc}")
            return None
        if result["marks"] != args.output_len:
            say(f"{engine}: warning: {result['marks']} token marks for {args.output_len} new tokens")
        step = result["step_median_s"]
        say(f"{what} batch {b} {engine}: {result['e2e_s']:.2f} s, "
            f"{'-' if step is None else f'{step * 1e3:.1f}'} ms/step")
        return result

    watch = CpuWatch()
    foreign = None
    try:
        for engine in args.engines:
            try:
                workers[engine] = start_engine(engine, args, weights, working_dir, logs, env_info)
                engines[engine].update(status="ok", load_s=workers[engine].ready["load_s"],
                                       pid=workers[engine].ready["pid"], versions=workers[engine].ready["versions"])
            except EngineError as exc:
                fail(engine, str(exc))
        watch.start([os.getpid()] + [w.proc.pid for w in workers.values()])
        for b in args.batch_sizes:
            for engine in [e for e in args.engines if e in workers]:
                result = generate(engine, b, "warm-up")
                if result is not None:
                    warm[b][engine] = result
                    runs[b][engine] = []
        for r in range(args.rounds):
            for b in args.batch_sizes:
                live = [e for e in args.engines if e in workers]
                order = live[r % len(live):] + live[:r % len(live)] if live else []
                for engine in order:
                    result = generate(engine, b, f"round {r + 1}/{args.rounds}")
                    if result is not None:
                        runs[b][engine].append(result)
        foreign = watch.foreign_cores()
        for engine in list(workers):
            try:
                memory = workers[engine].request({"cmd": "memory"})
                engines[engine].update(peak_rss_bytes=memory["peak_rss_bytes"], rss_bytes=memory["rss_bytes"],
                                       ru_maxrss_bytes=memory["ru_maxrss_bytes"])
            except EngineError as exc:
                fail(engine, f"memory query: {exc}")
    finally:
        close_all(list(workers.values()))
    # An engine that failed mid-run keeps the figures it had, but not partial rounds' worth of comparisons.
    for b in args.batch_sizes:
        for engine in list(runs[b]):
            if engines[engine]["status"] != "ok":
                del runs[b][engine]
    report = {
        "settings": {
            "family": args.family, "variant": args.variant, "weights": weights_what, "weights_dir": str(weights),
            "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
            "batch_sizes": args.batch_sizes, "engines": args.engines, "threads": args.threads, "seed": args.seed,
            "working_dir": str(working_dir),
        },
        "machine": {"cores": os.cpu_count(), "foreign_cores": foreign},
        "environment": env_info,
        "engines": engines,
        "batches": summarize(runs, warm, args),
        "raw": {"warm_up": warm, "rounds": runs},
    }
    report["ratios"] = compute_ratios(report)
    report["goals"] = evaluate_goals(report)
    report["elapsed_s"] = time.perf_counter() - _T0
    return report


def write_json(path: str, report: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        report = run_benchmark(args)
    except Exception as exc:  # nndf's UsageError / HarnessError and the like: one sentence
        from nndf.errors import HarnessError, UsageError

        if isinstance(exc, (UsageError, HarnessError)):
            print(f"decoder_cpu.py: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, UsageError) else 1
        raise
    print(render_report(report), flush=True)
    if args.json:
        write_json(args.json, report)
        say(f"wrote {args.json}")
    say(f"done in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
