"""`convert_model` (and `python run.py convert`): a Hugging Face encoder model to ONNX Runtime and TensorRT, checked
against PyTorch, benchmarked, and laid out as a Triton Inference Server model repository.

The steps, as transformer-deploy's `convert_model` takes them:
1. load the tokenizer and the task's PyTorch model (fp32, on `--device`);
2. PyTorch's outputs on seeded random inputs of the min, opt and max shapes of -b / -s (the reference);
3. `onnx`: export (`<output>/model-original.onnx`), ONNX Runtime's optimizer (`model.onnx`; fp16 on a GPU), and
   with -q dynamic int8 on the CPU (`model-int8.onnx`) or static QDQ int8 on a GPU (`model-qdq.onnx`);
   `tensorrt`: a plan from the export (fp16, or int8 from the QDQ graph with -q) with one profile over -b / -s;
4. every backend checked against PyTorch within --atol, then timed on the opt shape (`--nb-measures` calls);
5. the Triton repository (`nndf.triton.repository`) for the ONNX graph served and the TensorRT plan, once what an
   earlier run left in the output folder and this one does not write is removed (`nndf.convert.outputs`).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

from nndf.convert import engines as eng
from nndf.convert import graphs, report
from nndf.convert.options import ConvertOptions, parse
from nndf.convert.outputs import GRAPHS, remove_stale
from nndf.convert.tasks import (TASKS, TaskModule, load_task_model, model_inputs, sentence_tokenizer, transformer_of,
                                usable_positions)
from nndf.errors import HarnessError, UsageError, run_command
from nndf.measure import available_host_memory
from nndf.progress import say
from nndf.triton.repository import model_names
from nndf.workspace import artifact_lock, atomic_write_json


def _load(opts: ConvertOptions):
    """The tokenizer, the task's model and its config, each check made as soon as what it needs is loaded. A
    sentence-transformers model (--task embedding) tokenizes with its own tokenizer, as its encode() does (its
    max_seq_length, its lowercasing): that one is checked and served, and -t may only name the same."""
    from transformers import AutoConfig

    task = TASKS[opts.task]
    own = task.auto_class is None
    tokenizer = None if own and opts.tokenizer == opts.model else _tokenizer(opts)
    try:  # the config alone first: a wrong -s or tokenizer is said before the weights load
        early = AutoConfig.from_pretrained(opts.model, token=opts.auth_token)
    except (OSError, ValueError):
        early = None  # the model's own load below says what is wrong (or, for an older sentence-transformers
        # folder, whose config is in 0_Transformer/, loads it)
    if early is not None:
        _check_positions(opts, early)
        _check_memory(opts, early)
        if tokenizer is not None:
            _check_tokenizer(opts, tokenizer, early)
    model = load_task_model(task, opts.model, opts.device, opts.auth_token)
    if own:
        tokenizer = sentence_tokenizer(model, opts.model, tokenizer, opts.tokenizer)
    names = model_inputs(model, tokenizer)
    config = transformer_of(model).config
    _check_positions(opts, config, transformer_of(model))
    _check_memory(opts, config)
    _check_tokenizer(opts, tokenizer, config)
    return tokenizer, TaskModule(model, task, names), config


def _tokenizer(opts: ConvertOptions):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(opts.tokenizer, token=opts.auth_token)
    except (OSError, ValueError) as exc:
        why = str(exc).splitlines()[0]
        if opts.tokenizer != opts.model:
            raise UsageError(f"-t/--tokenizer {opts.tokenizer}: cannot load a tokenizer ({why})") from None
        if not Path(opts.model).expanduser().is_dir():  # a hub id the hub did not give
            raise UsageError(f"-m/--model {opts.model}: cannot load it from the Hugging Face hub ({why}); give a "
                             "local folder (what save_pretrained() writes), or a hub id with the hub reachable"
                             ) from None
        raise UsageError(f"-m/--model {opts.model}: cannot load its tokenizer ({why}); -t/--tokenizer names one "
                         "elsewhere") from None


def _check_positions(opts: ConvertOptions, config, model=None) -> None:
    """-s MAX within the positions the model takes (`usable_positions`: from the config, on any device)."""
    positions = usable_positions(config, model)
    if positions and opts.seq_len[2] > positions:
        table = config.max_position_embeddings
        why = f" (max_position_embeddings {table}, less the {table - positions} rows its position table keeps " \
              "before the first position)" if positions != table else ""
        raise UsageError(f"-s/--seq-len MAX {opts.seq_len[2]} exceeds the {positions} positions of {opts.model}{why}")


def _check_memory(opts: ConvertOptions, config) -> None:
    """Refuse -b / -s maxima whose one inference cannot fit in memory, before anything is allocated: the least it
    holds is one layer's feed-forward activations in fp32 (the check runs the largest shape; torch would otherwise
    fail in an allocation, or the system kill the process)."""
    hidden = graphs.attention_sizes(config)[1]
    widest = max(hidden, int(getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None) or 0))
    (_, _, batch), (_, _, seq) = opts.batch_size, opts.seq_len
    need = batch * seq * widest * 4
    if opts.device == "cuda":
        free, where = torch.cuda.mem_get_info()[0], "free on the GPU"
    else:
        free, where = available_host_memory(), "available on this machine"
    if free and need > free:
        raise UsageError(f"-b/--batch-size MAX {batch} with -s/--seq-len MAX {seq} needs at least {need / 2**30:,.1f} "
                         f"GiB for one inference (one layer's activations), more than the {free / 2**30:,.1f} GiB "
                         f"{where}: lower -b or -s MAX")


def _check_tokenizer(opts: ConvertOptions, tokenizer, config) -> None:
    """The tokenizer must fit the model (its ids within the vocabulary) and pad batches: the Triton tokenize model
    pads every request's texts, and the check inputs are random ids, which would never show either problem."""
    vocab = getattr(config, "vocab_size", None)
    if vocab and len(tokenizer) > vocab:
        flag = f"-t/--tokenizer {opts.tokenizer}" if opts.tokenizer != opts.model else f"-m/--model {opts.model}"
        raise UsageError(f"{flag}: the tokenizer has {len(tokenizer)} tokens and the model's vocabulary "
                         f"{vocab}, so some of its ids have no embedding: give the model's own tokenizer")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None and opts.batch_size[2] > 1:
            raise UsageError(f"the tokenizer of {opts.tokenizer} has no padding token (nor an end token to pad "
                             f"with), so batches of up to {opts.batch_size[2]} texts (-b) cannot be padded: use -b "
                             "1 1 1, or a tokenizer that pads")
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # as transformer-deploy's generative models do
            say(f"the tokenizer has no padding token: padding with its end token {tokenizer.eos_token!r} (the "
                "attention mask hides it)")


def _graphs(opts: ConvertOptions, module: TaskModule, config, tokenizer, example, out: Path) -> dict[str, Path]:
    """Every ONNX graph the options ask for, by role: original, optimized, int8 (CPU) or qdq (GPU)."""
    paths = {"original": out / GRAPHS["original"]}
    say(f"exporting {opts.model} to ONNX ...")
    module.graph_inputs = graphs.export_graph(module, example, paths["original"], opts.verbose)
    module.to(opts.device)
    if "onnx" in opts.backends:
        paths["optimized"] = out / GRAPHS["optimized"]
        fused = graphs.optimize_graph(paths["original"], paths["optimized"], config, use_gpu=opts.device == "cuda",
                                      fp16=opts.device == "cuda", verbose=opts.verbose)
        module.fusions = fused
        say("ONNX Runtime optimizer fusions: " + (", ".join(f"{k} {v}" for k, v in fused.items()) or "none"))
    if opts.quantization and opts.device == "cpu" and "onnx" in opts.backends:
        paths["int8"] = out / GRAPHS["int8"]
        graphs.quantize_dynamic_int8(paths["optimized"], paths["int8"], opts.verbose)
    if opts.quantization and opts.device == "cuda":
        paths["qdq"] = out / GRAPHS["qdq"]
        calibration = eng.text_feeds(tokenizer, module.graph_inputs, eng.CALIBRATION_TEXTS, opts.batch_size[1],
                                     opts.seq_len[2])
        say(f"calibrating int8 (QDQ) on {len(eng.CALIBRATION_TEXTS)} sentences ...")
        graphs.quantize_static_qdq(paths["original"], paths["qdq"], calibration, opts.verbose)
    return paths


def _tensorrt(opts: ConvertOptions, module: TaskModule, paths: dict[str, Path], out: Path) -> eng.Engine:
    """A TensorRT engine from the export (fp16), or int8 from the QDQ graph, with one profile over -b / -s, built
    by the decoders' engine cache (reused while its metadata matches, memory checked first) into `out`; `paths`
    gets the plan and the timing cache the build used."""
    from nndf.backends.trt import _free_gpu_memory, _gpu
    from nndf.export import engine_cache
    from nndf.export.engine_request import EngineRequest

    source = paths.get("qdq", paths["original"])
    gpu = _gpu()
    (b0, b1, b2), (s0, s1, s2) = opts.batch_size, opts.seq_len
    profile = {name: ((b0, s0), (b1, s1), (b2, s2)) for name in module.graph_inputs}
    int8 = opts.quantization
    request = EngineRequest(stem=opts.name, onnx_path=source, onnx_id=f"{source.name}:{_digest(source)}",
                            input_names=module.graph_inputs, output_names=module.task.outputs,
                            profiles=[profile], fp16=not int8, graph="encoder", int8=int8,
                            workspace_mib=opts.workspace_size)
    params = sum(p.numel() for p in module.parameters())
    plan, _ = engine_cache.obtain_engine(request, gpu.info, out, params, free_gpu=_free_gpu_memory(gpu.device),
                                         free_host=available_host_memory(), report=say)
    paths["plan"], paths["timing_cache"] = plan, engine_cache.timing_cache_path(out, gpu.info)
    name = "TensorRT (INT-8)" if int8 else "TensorRT (FP16)"
    return eng.tensorrt_engine(name, plan, module.graph_inputs, module.task.outputs, profile, gpu)


def _digest(path: Path) -> str:
    """The graph's content hash: an engine is rebuilt when the graph it came from changed."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _engines(opts: ConvertOptions, module: TaskModule, paths: dict[str, Path], out: Path) -> list[eng.Engine]:
    found = [eng.pytorch_engine(module)]
    gpu = opts.device == "cuda"
    if gpu and not opts.fast:  # whatever --backend says, as transformer-deploy times it: --fast is the way out
        found.append(eng.pytorch_engine(module, "Pytorch (FP16)", fp16=True))
    if "onnx" in opts.backends:
        found.append(eng.ort_engine("ONNX Runtime (FP32)", paths["original"], opts.device, opts.nb_threads))
        label = "ONNX Runtime (optimized, FP16)" if gpu else "ONNX Runtime (optimized)"
        found.append(eng.ort_engine(label, paths["optimized"], opts.device, opts.nb_threads))
        for role, label in (("int8", "ONNX Runtime (INT-8)"), ("qdq", "ONNX Runtime (INT-8 QDQ)")):
            if role in paths:
                found.append(eng.ort_engine(label, paths[role], opts.device, opts.nb_threads))
    if "tensorrt" in opts.backends:
        found.append(_tensorrt(opts, module, paths, out))
    return found


def run(opts: ConvertOptions) -> dict:
    _check_triton(opts)
    torch.manual_seed(opts.seed)
    torch.set_num_threads(opts.nb_threads)
    tokenizer, module, config = _load(opts)
    vocab = int(config.vocab_size)
    shapes = list(zip(opts.batch_size, opts.seq_len))
    checks = [eng.random_feeds(module.input_names, b, s, vocab, opts.seed + i, opts.device)
              for i, (b, s) in enumerate(dict.fromkeys(shapes))]
    opt_feeds = eng.random_feeds(module.input_names, *shapes[1], vocab, opts.seed, opts.device)
    reference_engine = eng.pytorch_engine(module)
    reference = [_reference(reference_engine, feeds) for feeds in checks]
    out = Path(opts.output)
    converts = bool(_served(opts))  # --backend pytorch alone writes nothing in -o, and leaves it as it is
    # -o made (by its lock) after the load and the reference: a refusal leaves no folder behind
    with output_lock(out) if converts else contextlib.nullcontext():
        if converts:  # (where flock does not exist, the lock makes no folder)
            out.mkdir(parents=True, exist_ok=True)
        paths = _graphs(opts, module, config, tokenizer, checks[0], out) if converts else {}
        results: dict = {"model": opts.model, "task": opts.task, "device": opts.device, "batch_size": opts.batch_size,
                         "seq_len": opts.seq_len, "atol": opts.atol, "backends": {}}
        fidelity, lines, reruns = {}, [], []
        for engine in _engines(opts, module, paths, out):
            if engine.reruns_reference:
                reruns.append(engine.name)
            try:
                fidelity[engine.name] = report.check(engine, checks, reference, module.task.outputs, opts.atol)
            except HarnessError as exc:  # not faithful: the report still says what was measured before it
                results["backends"][engine.name] = {"error": str(exc), "file": str(engine.artifact or "") or None}
                _write_report(opts, results)
                raise
            say(f"timing {engine.name} ({opts.nb_measures} calls at batch {shapes[1][0]}, {shapes[1][1]} tokens) ...")
            timing = report.timings(engine, opt_feeds, opts.warmup, opts.nb_measures, opts.device)
            lines.append(report.latency_line(engine.name, timing))
            results["backends"][engine.name] = {"timing_ms": report.timing_ms(timing),
                                                "max_abs_diff": fidelity[engine.name].max_abs_diff,
                                                "mean_cosine": fidelity[engine.name].mean_cosine,
                                                "file": str(engine.artifact) if engine.artifact else None}
        results["fusions"] = getattr(module, "fusions", {})
        if converts:  # every backend checked: what an earlier run left in -o goes before the Triton models are written
            remove_stale(out, opts.name, [*paths.values(), *_triton_folders(opts, out)])
        results["triton"] = _triton(opts, module, paths, tokenizer, out, [o.shape for o in reference[0]])
    device = torch.cuda.get_device_name() if opts.device == "cuda" else "the CPU"
    print(f"Inference done on {device}")
    print("latencies:")
    print("\n".join(lines))
    print("\n".join(report.fidelity_lines(fidelity, opts.atol, reruns)))
    for model in results["triton"]:
        print(f"Triton model: {model}")
    return results


def output_lock(out: Path):
    """The lock a run holds on -o while it writes there (graphs, engines, the removal of an earlier run's files, the
    Triton models): the graph files have fixed names, whatever -n says, so a second run into the same -o waits for
    the first, then writes its own set whole, where the two used to interleave (one's Triton model serving the
    other's graph)."""
    return artifact_lock(out / "convert_model-output",
                         lambda _: say(f"waiting for another convert_model run writing in {out} ..."))


def _reference(engine: eng.Engine, feeds: dict[str, torch.Tensor]) -> list:
    """PyTorch's outputs for one check shape. Random ids stay within the vocabulary, so an index out of range is a
    position past the model's embeddings: a -s MAX within the positions `usable_positions` reads that the model's
    position ids still overrun (an offset its position table does not show), said as the flag's error, not as
    torch's traceback. (On CUDA that overrun is a device-side assert: hence the check up front.)"""
    batch, seq = next(iter(feeds.values())).shape
    try:
        return engine.infer(feeds)
    except IndexError as exc:
        raise UsageError(f"-s/--seq-len: PyTorch cannot run the model on {seq} tokens (batch {batch}): {exc}; the "
                         f"model's positions end before {seq} tokens: lower -s MAX") from None


def _check_triton(opts: ConvertOptions) -> None:
    """What writing the Triton repository at the end needs (tritonclient, room for its model folders), checked
    before the load, the conversion and the benchmark rather than after them."""
    from nndf.triton.repository import check_model_folders, config_schema

    if _served(opts):
        config_schema()
        check_model_folders(opts.output, [path.name for path in _triton_folders(opts, Path(opts.output))])


def _served(opts: ConvertOptions) -> list[str]:
    """The backends whose model is converted and served in Triton (PyTorch is the reference, only timed)."""
    return [engine for engine in ("onnx", "tensorrt") if engine in opts.backends]


def _triton_folders(opts: ConvertOptions, out: Path) -> list[Path]:
    """The Triton model folders this run writes in `out`."""
    return [out / folder for engine in _served(opts) for folder in model_names(opts.name, engine).values()]


def _triton(opts: ConvertOptions, module: TaskModule, paths: dict[str, Path], tokenizer, out: Path,
            output_shapes: list[tuple[int, ...]]) -> list[str]:
    """The Triton repository for the ONNX graph served (int8 with -q on the CPU, else the optimized one) and the
    TensorRT plan; PyTorch alone is benchmarked, not served."""
    from nndf.triton.repository import write_encoder_repository

    served = []
    dims = {name: [-1 if module.task.per_token and axis == 0 else size for axis, size in enumerate(shape[1:])]
            for name, shape in zip(module.task.outputs, output_shapes)}
    # sentence-transformers truncates at its own max_seq_length (256 for all-MiniLM-L6-v2), not at the tokenizer's
    # (512): the tokenize model must cut texts where it does, or long texts embed otherwise
    longest = module.model.max_seq_length if module.task.auto_class is None and module.model.max_seq_length \
        else tokenizer.model_max_length
    # nor past the model's positions: a tokenizer of another model (-t), or one without model_max_length (a huge
    # number then), would pass longer texts on, and the server would fail them with an index error
    inner = transformer_of(module.model)
    positions = usable_positions(inner.config, inner)
    longest = min(longest, positions or longest)
    # a TensorRT plan takes no more tokens than its profile's maximum (-s MAX): longer texts are cut there, not
    # refused by the server with a shape error; and no fewer than its minimum (-s MIN): shorter ones are padded
    limits = {"onnx": longest, "tensorrt": min(longest, opts.seq_len[2])}
    with tempfile.TemporaryDirectory() as scratch:
        for engine, model_file in (("onnx", paths.get("int8", paths.get("optimized"))),
                                   ("tensorrt", paths.get("plan"))):
            if engine in opts.backends and model_file is not None:
                tokenizer_dir = Path(scratch) / engine
                tokenizer.model_max_length = limits[engine]
                tokenizer.save_pretrained(tokenizer_dir)
                served += write_encoder_repository(out, opts.name, model_file, engine, tokenizer_dir,
                                                   module.graph_inputs, dims, opts.batch_size[2], opts.nb_instances,
                                                   opts.device, text_inputs=module.task.text_inputs,
                                                   min_length=opts.seq_len[0] if engine == "tensorrt" else 1)
    return [str(p) for p in served]


def _write_report(opts: ConvertOptions, results: dict) -> None:
    if opts.json:
        atomic_write_json(opts.json, results)
        print(f"results written to {opts.json}")


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    started = time.perf_counter()
    opts = parse(argv)
    _write_report(opts, run(opts))
    say(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def entrypoint() -> None:
    sys.exit(main())
