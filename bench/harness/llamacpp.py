"""llama.cpp as a peer engine: built from the llama-cpp-python sdist's vendored sources, fed GGUF files converted
from the bench's own weights folder, measured by its own `llama-batched-bench`.

Why these pieces:
- The sources come from PyPI (`pip download --no-binary :all: llama-cpp-python==VERSION`): PyPI is the registry this
  machine reaches, and the sdist vendors llama.cpp whole, with `convert_hf_to_gguf.py` and `gguf-py`. cmake builds
  the tools natively (`GGML_NATIVE`: this CPU's instructions, as a user building it here gets), about 8 minutes on
  2 cores, once: the tree and its build stay in the working dir, reused while the marker matches.
- F32 and Q8_0 come from the converter (`--outtype`), Q4_0 from `llama-quantize` on the F32 file, as llama.cpp's
  README does it. The converter runs in the main environment with the tree's gguf-py on PYTHONPATH.
- `llama-batched-bench -npp P -ntg T -npl B` measures what our rows measure, at any batch: B separate prompts of P
  random tokens decoded at once (T_PP: the prefill, our "first token"), then T steps that each decode one token
  for each of the B sequences, logits included (T_TG / T: the mean decode step). We ask for output_len - 1 steps,
  so that prefill + steps make as many tokens as our generations do. It draws its own random token ids (the
  speed of a step does not depend on them) and samples nothing, so its rows have no tokens to compare.
- One tool process per timed run, like our workers' one `generate`: the file is mmap'd, so after the first run the
  model comes from the page cache. Its peak memory is the tool's VmHWM, polled from /proc while it runs: the
  mmap'd weights count in it once touched (RssFile), which a whole decode step does.

Standard library only at import time (harness.engines too): the worker is this script under the main python,
without torch.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from harness.engines import log_tail, run_logged
from harness.worker import status_kib

SDIST = ("llama-cpp-python", "0.3.36")
TARGETS = ("llama-batched-bench", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
# x86: never AMX. -march=native turns ggml's AMX kernels on where the CPU lists amx_tile / amx_int8, but a virtual
# machine may list them without enabling the tiles: on this one (a Xeon guest) every Q8_0 and Q4_0 matmul then
# dies of SIGILL inside tinygemm_kernel_amx. The AVX-512 / VNNI kernels stay, as -march=native finds them.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
X86_FLAGS = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def cmake_flags() -> tuple[str, ...]:
    return CMAKE_FLAGS + (X86_FLAGS if platform.machine().lower() in ("x86_64", "amd64") else ())


# engine -> (GGUF type, how it is made: the converter's --outtype, or llama-quantize from the F32 file)
ENGINES = {"llamacpp-f32": ("f32", "convert"), "llamacpp-q8_0": ("q8_0", "convert"),
           "llamacpp-q4_0": ("q4_0", "quantize")}


class LlamaCppError(Exception):
    """llama.cpp cannot run here; the message is the row's one-line reason."""


def sdist_name() -> str:
    return f"{SDIST[0].replace('-', '_')}-{SDIST[1]}"


def tree(root: Path) -> Path:
    """The vendored llama.cpp sources inside the unpacked sdist under `root`."""
    return root / sdist_name() / "vendor" / "llama.cpp"


def tool(root: Path, name: str) -> Path:
    return tree(root) / "build" / "bin" / name


def build(root: Path, log: Path, say) -> Path:
    """The built tree under `root` (downloaded, unpacked and built with cmake on first use); LlamaCppError when
    cmake, the download or the build fails."""
    marker = tree(root) / "build" / "nndf-bench-build.json"
    wanted = {"sdist": list(SDIST), "flags": list(cmake_flags()), "targets": list(TARGETS)}
    try:
        if json.loads(marker.read_text()) == wanted and all(tool(root, t).is_file() for t in TARGETS):
            return tree(root)
    except (OSError, ValueError):
        pass  # no marker yet, or an unreadable one: build
    cmake = shutil.which("cmake")
    if cmake is None:
        raise LlamaCppError("cmake is not on PATH (needed to build llama.cpp)")
    root.mkdir(parents=True, exist_ok=True)
    archive = root / f"{sdist_name()}.tar.gz"
    if not archive.is_file():
        say(f"llama.cpp: downloading the {SDIST[0]} {SDIST[1]} sdist (log {log}) ...")
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"{SDIST[0]}=={SDIST[1]}", "-d", str(root)]
        if run_logged(download, log, 900, env) != 0 or not archive.is_file():
            raise LlamaCppError(f"pip download of {SDIST[0]}=={SDIST[1]} failed (no network?): {log_tail(log)}")
    if not (tree(root) / "CMakeLists.txt").is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    say(f"llama.cpp: building {', '.join(TARGETS)} with cmake (about 8 minutes on 2 cores; log {log}) ...")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    source = tree(root)
    if run_logged([cmake, "-B", "build", *generator, *cmake_flags()], log, 600, cwd=source) != 0:
        raise LlamaCppError(f"cmake configure failed: {log_tail(log)}")
    jobs = str(os.cpu_count() or 2)
    if run_logged([cmake, "--build", "build", "-j", jobs, "--target", *TARGETS], log, 3600, cwd=source) != 0:
        raise LlamaCppError(f"cmake build failed: {log_tail(log)}")
    marker.write_text(json.dumps(wanted))
    return source


def gguf(engine: str, source: Path, peer_folder: Path, out_dir: Path, log: Path, say) -> Path:
    """The GGUF file of `engine`, converted (and quantized) from the peers' weights folder once."""
    kind, how = ENGINES[engine]
    target = out_dir / f"model-{kind}.gguf"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    if how == "quantize":
        f32 = gguf("llamacpp-f32", source, peer_folder, out_dir, log, say)
        say(f"{engine}: llama-quantize {f32.name} -> {target.name} ...")
        quantize = str(source / "build" / "bin" / "llama-quantize")
        code = run_logged([quantize, str(f32), str(tmp), kind.upper()], log, 1800)
    else:
        say(f"{engine}: convert_hf_to_gguf.py --outtype {kind} ...")
        env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"), HF_HUB_OFFLINE="1")
        code = run_logged([sys.executable, str(source / "convert_hf_to_gguf.py"), str(peer_folder), "--outtype", kind,
                           "--outfile", str(tmp)], log, 1800, env)
    if code != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"{'llama-quantize' if how == 'quantize' else 'convert_hf_to_gguf.py'} failed: "
                            f"{log_tail(log)}")
    os.replace(tmp, target)
    return target


def bench_command(binary: str, model: str, batch: int, prompt: int, steps: int, threads: int | None) -> list[str]:
    """llama-batched-bench for one timed run: `batch` prompts of `prompt` tokens, then `steps` decode steps."""
    cmd = [binary, "-m", model, "-c", str(batch * (prompt + steps)), "-npp", str(prompt), "-ntg", str(steps),
           "-npl", str(batch), "--output-format", "jsonl"]
    return cmd + (["-t", str(threads)] if threads else [])


def parse_bench(output: str, batch: int, prompt: int, steps: int) -> dict:
    """The worker's result of one run from llama-batched-bench's JSONL line (times in seconds, the step the mean)."""
    for line in output.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if (row.get("pl"), row.get("pp"), row.get("tg")) == (batch, prompt, steps):
            t_pp, t_tg = float(row["t_pp"]), float(row["t_tg"])
            return {"ttft_s": t_pp, "step_median_s": t_tg / steps if steps else None, "e2e_s": t_pp + t_tg,
                    "marks": steps + 1, "tokens": None, "tool": row}
    raise ValueError(f"no result line for batch {batch}, {prompt} + {steps} tokens in llama-batched-bench's output")


def run_watched(cmd: list[str], every: float = 0.01) -> tuple[int, str, dict]:
    """Run `cmd` (its stderr: ours, so the worker's log), polling its VmHWM and RssFile until it exits: (exit code,
    stdout, the largest of each seen; RssFile's largest, since a process that is exiting unmaps its file first)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    seen: dict = {}

    def watch():
        while proc.poll() is None:
            for name, value in status_kib(proc.pid, ("VmHWM", "RssFile")).items():
                seen[name] = max(value, seen.get(name, 0))
            time.sleep(every)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out = proc.communicate()[0]
    watcher.join()
    return proc.returncode, out, seen


class LlamaCppRunner:
    """The worker side of llamacpp-*: one llama-batched-bench run per `generate`, its peak memory for `memory`."""

    encoder = None

    def __init__(self, args) -> None:
        self.binary, self.model, self.threads = args.peer_tool, args.peer_model, args.threads
        self.peak_kib = self.file_kib = 0
        self.versions = {"llama-cpp-python sdist": SDIST[1], "gguf": Path(self.model).name,
                         "threads": self.threads or "llama.cpp default"}
        self.commands = {"generate": self.generate, "memory": self.memory}

    def generate(self, command: dict) -> dict:
        ids = command["input_ids"]
        batch, prompt, steps = len(ids), len(ids[0]), max(1, int(command["new_tokens"]) - 1)
        code, out, seen = run_watched(bench_command(self.binary, self.model, batch, prompt, steps, self.threads))
        if code != 0:
            raise RuntimeError(f"llama-batched-bench exited with code {code} (its messages are in this engine's log)")
        result = parse_bench(out, batch, prompt, steps)
        self.versions["flash_attn"] = result["tool"].get("flash_attn")
        self.peak_kib = max(self.peak_kib, seen.get("VmHWM", 0))
        self.file_kib = max(self.file_kib, seen.get("RssFile", 0))
        return result

    def memory(self, command: dict) -> dict:
        """The largest VmHWM of the tool's runs (mmap'd weights included; the largest RssFile is in the answer)."""
        return {"peak_rss_bytes": self.peak_kib * 1024, "rss_bytes": None, "ru_maxrss_bytes": None,
                "rss_file_bytes": self.file_kib * 1024}
