"""The worker process side: one engine per process, one JSON command per stdin line, one JSON answer per line.

This module also runs inside the Optimum virtual environment (old transformers, no nndf): at import time it uses
the standard library only, and the Optimum and plain-transformers runners import only torch, numpy, transformers
and optimum. The nndf runner imports nndf, in the main environment only.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness.inputs import read_inputs

# The Optimum environment's packages whose versions the report shows.
OPTIMUM_PACKAGES = ("torch", "transformers", "optimum", "optimum-onnx", "onnxruntime", "onnx", "accelerate", "numpy")


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Ticks:
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


class CallTimer:
    """Time spent in one callable attribute of an object (an encoder's forward, ONNX Runtime's run), summed until
    reset(), and each call's in `calls`, in call order.

    `wrap(obj, name)` replaces obj.name by a timed wrapper on that instance; for a torch module, wrap "forward"
    (nn.Module.__call__ calls self.forward). `seconds` is None until a wrapped call happened.
    """

    def __init__(self) -> None:
        self.seconds: float | None = None
        self.calls: list[float] = []

    def reset(self) -> None:
        self.seconds = None
        self.calls = []

    def wrap(self, obj, name: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - started)
                self.seconds = (self.seconds or 0.0) + self.calls[-1]

        setattr(obj, name, timed)


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def status_kib(pid: int | str, fields: tuple[str, ...]) -> dict:
    """Fields of /proc/PID/status in KiB (`pid` "self" for this process; missing ones, or no /proc, left out)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    found[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass  # no /proc (macOS) or a process that just ended: the caller falls back or reports nothing
    return found


def rss_file_bytes() -> int | None:
    """The file-backed part of the resident set now (RssFile: mmap'd files such as weights), None without /proc."""
    kib = status_kib("self", ("RssFile",)).get("RssFile")
    return None if kib is None else kib * 1024


def ru_maxrss_bytes() -> int:
    """ru_maxrss: KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_rss_bytes() -> int:
    """This process's own peak resident set: VmHWM where /proc has it, else ru_maxrss.

    On Linux, ru_maxrss is kept across fork + exec, so a worker's ru_maxrss is at least the parent's peak RSS when
    it was started (the main process that built GPT-2's weights is ~1 GB): VmHWM is the same high-water mark for
    the worker's own address space only.
    """
    kib = status_kib("self", ("VmHWM",)).get("VmHWM")
    return ru_maxrss_bytes() if kib is None else kib * 1024


def versions(names) -> dict:
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


class Runner:
    """What every runner shares: a `generate` command's inputs as generate()'s keyword arguments (harness.inputs),
    and the new tokens of an output.

    A decoder-only model returns prompt + new tokens; an encoder-decoder one (`seq2seq`) the decoder's sequence from
    its start token. `encoder` times the encoder where the runner can reach it (None: not available).
    """

    seq2seq = False
    encoder: CallTimer | None = None

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def inputs(self, command: dict) -> dict:
        return read_inputs(command)

    def new_tokens(self, out, inputs: dict) -> list[list[int]]:
        return out[:, 1 if self.seq2seq else inputs["input_ids"].shape[1]:].tolist()


class NndfRunner(Runner):
    """hf, nndf-frameworks and onnxrt*: nndf.load on the shared weights folder (main environment only)."""

    def __init__(self, args, quantize: dict, seq2seq: bool = False, kv_layouts: dict | None = None) -> None:
        super().__init__()
        import nndf

        torch = self.torch
        engine = args.worker
        self.seq2seq = seq2seq
        pytorch = engine in ("hf", "nndf-frameworks")
        if args.threads and pytorch:
            torch.set_num_threads(args.threads)
        self.model = nndf.load(
            args.family, variant=args.variant, backend="frameworks" if pytorch else "onnxrt",
            torch_dir=args.weights_dir, working_dir=args.working_dir, quantize=quantize.get(engine),
            threads=args.threads, **({"kv_layout": kv_layouts[engine]} if engine in (kv_layouts or {}) else {}),
        )
        self.run = self.model.hf_generate if engine == "hf" else self.model.generate
        self.versions = versions(["torch", "transformers", "onnxruntime", "nndf"])
        self.versions["torch_threads"] = torch.get_num_threads()

    def generate(self, inputs: dict, new_tokens: int, tick):
        return self.run(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=1, on_token=tick)


class GenerateRunner(Runner):
    """A model with Hugging Face's generate(): Optimum's ORTModelFor* or a plain transformers model. No nndf here.

    Greedy, exactly `new_tokens` new tokens, KV cache on; every other rule comes from the model's generation config.
    A logits processor ticks once per step right after the forward pass, as nndf's hf_generate does. `pad`: pass
    the config's pad token (else eos) as pad_token_id; False for a model whose generate() passes its own (BLIP).
    """

    def __init__(self, model, seq2seq: bool, pad: bool = True) -> None:
        super().__init__()
        self.model = model
        self.seq2seq = seq2seq
        gen = model.generation_config
        eos = gen.eos_token_id[0] if isinstance(gen.eos_token_id, (list, tuple)) else gen.eos_token_id
        self.pad = {"pad_token_id": gen.pad_token_id if gen.pad_token_id is not None else eos} if pad else {}

    def generate(self, inputs, new_tokens: int, tick):
        from transformers import LogitsProcessor, LogitsProcessorList

        class Tick(LogitsProcessor):
            def __call__(self, ids, scores):
                tick()
                return scores

        with self.torch.inference_mode():
            return self.model.generate(
                **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=1, do_sample=False,
                use_cache=True, logits_processor=LogitsProcessorList([Tick()]), **self.pad,
            )


def optimum_model(args, class_name: str, **export_kwargs):
    """Optimum's `class_name` (ORTModelForCausalLM, ORTModelForFeatureExtraction...) loaded from --onnx-dir, with
    --threads for both its torch and its ONNX Runtime session. With --prepare-only, exports --weights-dir into
    --onnx-dir with Optimum's own exporter (when not there yet) and returns None: the export happens in a
    short-lived process, so that the worker's peak memory is that of running only."""
    import torch
    import optimum.onnxruntime

    ort_class = getattr(optimum.onnxruntime, class_name)
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
            model = ort_class.from_pretrained(args.weights_dir, export=True, **export_kwargs)
            model.save_pretrained(tmp)
            os.replace(tmp, onnx_dir)
        return None
    return ort_class.from_pretrained(onnx_dir, **export_kwargs, **kwargs)


def optimum_versions(model) -> dict:
    """What the report shows of an Optimum worker: its packages, threads, providers and IO binding."""
    import torch

    found = versions(OPTIMUM_PACKAGES)
    found["torch_threads"] = torch.get_num_threads()
    found["providers"] = ",".join(model.providers) if hasattr(model, "providers") else "?"
    found["use_io_binding"] = str(getattr(model, "use_io_binding", "?"))
    return found


def optimum_runner(args, class_name: str, seq2seq: bool) -> GenerateRunner | None:
    """optimum: `class_name` (ORTModelForCausalLM, ORTModelForSeq2SeqLM) with KV cache on its own export of the same
    weights. With --prepare-only, exports into --onnx-dir (when not there yet) and returns None."""
    model = optimum_model(args, class_name, use_cache=True)
    if model is None:
        return None
    if not getattr(model, "use_cache", True):
        raise RuntimeError(f"{args.onnx_dir} was exported without KV cache")
    runner = GenerateRunner(model, seq2seq)
    runner.versions = optimum_versions(model)
    return runner


def worker_main(args, make_runner) -> int:
    """Serve one engine (`make_runner(args)` builds it): one JSON command per stdin line, one JSON answer per line on
    the protocol channel.

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
        runner = make_runner(args)
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
    ticks = Ticks()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            kind = command.get("cmd")
            if kind in getattr(runner, "commands", {}):  # a runner's own commands (a peer's generate and memory)
                answer(dict(runner.commands[kind](command), ok=True))
            elif kind == "generate":
                inputs = runner.inputs(command)
                if runner.encoder is not None:
                    runner.encoder.reset()
                ticks.start()
                out = runner.generate(inputs, int(command["new_tokens"]), ticks.mark)
                end = time.perf_counter()
                result = dict(ticks.result(end), ok=True, tokens=runner.new_tokens(out, inputs))
                if runner.encoder is not None:
                    result["encoder_s"] = runner.encoder.seconds
                answer(result)
            elif kind == "memory":
                answer({"ok": True, "peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes(),
                        "ru_maxrss_bytes": ru_maxrss_bytes(), "rss_file_bytes": rss_file_bytes()})
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
