"""The main process's side of the engines: the weights folder they all load, the Optimum virtual environment, and
the worker processes (prepared in a short-lived process first, then kept alive and driven by JSON lines)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.worker import OPTIMUM_PACKAGES, versions

# The Optimum environment. torch is pinned: this exact build lies on this machine's disk (an unpinned torch pulls
# a multi-GB CUDA build); onnxruntime is pinned to the version of this environment (optimum_requirements), so both
# ONNX Runtime engines run the same runtime; accelerate lets Optimum's exporter store GPT-2's tied embedding once.
OPTIMUM_REQUIREMENTS = ("torch==2.13.0", "transformers<4.58", "optimum-onnx==0.1.0", "accelerate")

_T0 = time.perf_counter()


def say(message: str) -> None:
    """Progress for people, on stderr, so that stdout is only the report."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def elapsed() -> float:
    return time.perf_counter() - _T0


class EngineError(Exception):
    """An engine cannot run; the message is the reason shown in its row."""


def log_tail(path: Path, lines: int = 3) -> str:
    """The last few meaningful lines of a log, for a one-line reason."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    useful = [t.strip() for t in text if t.strip() and "Warning" not in t and not t.startswith(" ")]
    errors = [t for t in useful if "error" in t.lower()]
    picked = (errors or useful)[-lines:]
    return " | ".join(picked)[-400:]


def folder_signature(folder: Path) -> list:
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(folder.iterdir()) if p.is_file()]


def short_hash(obj: object) -> str:
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
    from nndf.registry import resolve

    spec, variant = resolve(args.family, args.variant)
    if args.hub:
        kind, what = "hub", f"hub {variant.hub_id}"
    else:
        kind, what = f"random-seed{args.seed}", f"random weights (seed {args.seed})"
    key = short_hash([spec.family, variant.name, sorted(variant.config.items()), kind])
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
    ort = versions(["onnxruntime"]).get("onnxruntime")
    reqs.append(f"onnxruntime=={ort}" if ort else "onnxruntime")
    return reqs


def run_logged(cmd: list, log: Path, timeout: float, env: dict | None = None, cwd: Path | None = None) -> int:
    """Run `cmd` with its output appended to `log`: its exit code, -1 when it timed out or could not start."""
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env,
                                  cwd=cwd).returncode
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {timeout:.0f} s\n")
            return -1
        except OSError as exc:
            f.write(f"{exc}\n")
            return -1


def venv_environment(venv: Path, log: Path, reqs: list[str], probe_imports: str, packages) -> tuple[Path, dict]:
    """A virtual environment's python and the versions of `packages` in it; created (python -m venv + pip install
    `reqs`, then `import probe_imports` as a check) on first use, reused while its marker lists the same `reqs`."""
    python = venv / "bin" / "python"
    marker = venv / "nndf-bench-ready.json"
    try:
        ready = json.loads(marker.read_text())
        if ready.get("requirements") == reqs and python.exists():
            return python, ready["versions"]
    except (OSError, ValueError, KeyError):
        pass
    say(f"{venv.name}: creating it once, reused afterwards (pip install {' '.join(reqs)}: a few minutes and over 1 GB "
        f"with torch; log {log}) ...")
    shutil.rmtree(venv, ignore_errors=True)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    if run_logged([sys.executable, "-m", "venv", str(venv)], log, 300, env) != 0:
        raise EngineError(f"python -m venv failed: {log_tail(log)} (log {log})")
    if run_logged([str(python), "-m", "pip", "install", *reqs], log, 1800, env) != 0:
        raise EngineError(f"pip install failed: {log_tail(log)} (log {log})")
    probe = (f"import json, {probe_imports}; from importlib import metadata; "
             f"print(json.dumps({{n: metadata.version(n) for n in {list(packages)!r}}}))")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        with open(log, "a", encoding="utf-8") as f:
            f.write(done.stderr)
        raise EngineError(f"{probe_imports} do(es) not import in {venv}: {log_tail(log)} (log {log})")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    marker.write_text(json.dumps({"requirements": reqs, "versions": found}, indent=2))
    say(f"{venv.name}: ready: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    return python, found


def optimum_environment(working_dir: Path, logs: Path) -> tuple[Path, dict]:
    """The Optimum venv's python and its package versions; created on first use."""
    return venv_environment(working_dir / "optimum-venv", logs / "optimum-venv-setup.log", optimum_requirements(),
                            "optimum.onnxruntime, transformers, torch, onnxruntime", OPTIMUM_PACKAGES)


def optimum_setup(engine: str, args, weights: Path, working_dir: Path, logs: Path, env_info: dict):
    """Optimum's python (its venv) and the folder of its own export of the weights (made by --prepare-only)."""
    python, found = optimum_environment(working_dir, logs)
    env_info["optimum"] = {"python": str(python), "requirements": optimum_requirements(), "versions": found}
    key = short_hash([str(weights), folder_signature(weights), found])
    (working_dir / "bench-optimum-onnx").mkdir(exist_ok=True)
    return python, ["--onnx-dir", str(working_dir / "bench-optimum-onnx" / f"{weights.name}-{key}")]


def worker_env(isolated: bool) -> dict:
    """A worker's environment; `isolated`: it runs another environment's python (no PYTHONPATH, no user site)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if isolated:
        env.pop("PYTHONPATH", None)
        env["PYTHONNOUSERSITE"] = "1"
    return env


class Worker:
    """One engine's process (`script` with `argv`), kept alive and driven by one-line JSON commands."""

    def __init__(self, engine: str, python: Path | str, script: Path, argv: list[str], log: Path, env: dict) -> None:
        self.engine = engine
        self.log_path = log
        self._log = open(log, "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [str(python), str(script), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, bufsize=1, env=env,
        )

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise EngineError(f"worker exited with code {code}: {log_tail(self.log_path)} (log {self.log_path})")
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
            raise EngineError(f"worker exited with code {code}: {log_tail(self.log_path)} (log {self.log_path})")
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


def start_engine(bench, engine: str, args, weights: Path, working_dir: Path, logs: Path, env_info: dict) -> Worker:
    """Prepare the engine's files in a short-lived process (exports, quantization), then start its worker."""
    log = logs / f"{engine}.log"
    log.write_text("")
    argv = ["--worker", engine, "--weights-dir", str(weights), "--working-dir", str(working_dir)]
    if getattr(args, "family", None):  # encoder_cpu.py has no families
        argv += ["--family", args.family, "--variant", args.variant]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    python: Path | str = sys.executable
    setup = getattr(bench, "setups", {}).get(engine) or (optimum_setup if engine == "optimum" else None)
    if setup is not None:  # an engine of its own environment or with files of its own: python, extra arguments
        python, extra = setup(engine, args, weights, working_dir, logs, env_info)
        argv += extra
    env = worker_env(str(python) != sys.executable)
    if engine not in bench.unprepared:
        from nndf.progress import ticking  # the main process's environment has nndf (a worker's may not)

        quantization = ", quantization" if engine in bench.quantize else ""
        say(f"{engine}: preparing (export{quantization}; reused when cached; log {log}) ...")
        with open(log, "a", encoding="utf-8") as f, ticking(f"{engine}: preparing"):
            done = subprocess.run([str(python), str(bench.script), *argv, "--prepare-only"], stdout=subprocess.PIPE,
                                  stderr=f, text=True, env=env)
        answers = [json.loads(t) for t in done.stdout.splitlines() if t.startswith("{")]
        if done.returncode != 0 or not answers or not answers[-1].get("ok"):
            why = answers[-1].get("error") if answers else f"exit code {done.returncode}: {log_tail(log)}"
            raise EngineError(f"preparation failed: {why} (log {log})")
    say(f"{engine}: starting its worker ...")
    worker = Worker(engine, python, bench.script, argv, log, env)
    try:
        worker.ready = worker.receive()
    except (EngineError, ValueError) as exc:
        worker.close()
        raise EngineError(str(exc)) from None
    say(f"{engine}: ready in {worker.ready['load_s']:.1f} s (pid {worker.ready['pid']})")
    return worker
