"""What every action does first: validate flags, load the PyTorch model once, open one Model per backend."""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Callable

import torch

from nndf.architectures import architecture
from nndf.backends import RUNS_ONNX_FILES, RUNS_TORCH_MODEL, BackendOptions, split_backend
from nndf.errors import UsageError
from nndf.generation import BEAMS_WITH_SAMPLING
from nndf.images import caption_inputs, image_files
from nndf.keyword_terms import in_flag_terms
from nndf.measure import TimingSettings
from nndf.model import Model, default_device, target_language_token
from nndf.option_checks import check_kv_layout
from nndf.actions.plans import check_machine, shapes_result
from nndf.progress import say  # noqa: F401 - the actions' progress lines
from nndf.loading import LoadedModel, load_config, load_model
from nndf.machine import cpu_description, gpu_description
from nndf.registry import resolve
from nndf.results import Result
from nndf.sampling import SAMPLING_KEYWORDS, Sampling, check_repetition_penalty
from nndf.spec import BuildSettings, ShapeSpec


def build_settings(args) -> BuildSettings:
    """The flags' BuildSettings; its refusals name the flags (it names its own fields)."""
    try:
        return _build_settings(args)
    except UsageError as exc:
        exc.args = (in_flag_terms(str(exc), {f.name for f in dataclasses.fields(BuildSettings)}),)
        raise


def _build_settings(args) -> BuildSettings:
    return BuildSettings(
        batch_size=args.batch_size,
        num_beams=args.num_beams,
        input_seq_len=args.input_seq_len,
        output_seq_len=args.output_seq_len,
        use_cache=args.use_cache,
        use_mask=args.use_mask,
        fp16=args.fp16,
        dynamic_batch=args.dynamic_batch,
        min_dynamic_batch=args.min_dynamic_batch,
        max_dynamic_batch=args.max_dynamic_batch,
        preview_dynamic_shapes=not args.disable_preview_dynamic_shapes,
        engine_postfix=args.engine_postfix,
    )


def compared_backends(args) -> None:
    """`compare` and `chat` take their backends as positionals and/or after `--compare/-c` (NVIDIA's demo's way):
    one list, before anything loads (a backend named twice is refused by `open_models`)."""
    args.backends = [*args.backends, *args.compare]
    if not args.backends:
        raise UsageError(f"{args.action} needs the backends to run: name them after the model "
                         f"({args.action} {args.model} frameworks onnxrt) or after --compare, as NVIDIA's demo does")


def data_seed(args) -> int:
    """--seed for random inputs and samples of a data set (0 when not given); the weights have --weights-seed."""
    return 0 if args.seed is None else args.seed


def decoding_flags(args) -> dict:
    """`Model.generate`'s decoding keywords from the sampling flags (None: the model's generation config), with the
    seed sampling draws from: --seed, else one drawn here once per command (`decoding_note` shows it, so that a
    sampled run can be repeated). Every backend gets the same seed, so backends whose logits agree draw alike."""
    flags = {key: getattr(args, key, None) for key in (*SAMPLING_KEYWORDS, "repetition_penalty", "sampling_stream")}
    if getattr(args, "sampling_seed", None) is None:
        args.sampling_seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    return dict(flags, seed=args.sampling_seed)


def check_draw_flags_apply(decoding: dict, samples: bool | None) -> None:
    """The flags that shape sampled draws (--temperature, --top-k, ...), refused when tokens are not sampled: with
    --no-do-sample, or a model whose generation config does not sample and no --do-sample. generate() only warns
    and goes on greedily; a user who set a temperature expects it to change something."""
    given = [key for key in (*SAMPLING_KEYWORDS[1:], "sampling_stream") if decoding.get(key) is not None]
    if given and not samples:
        why = "--no-do-sample was given" if decoding.get("do_sample") is False else \
            "the model's generation config does not sample"
        flags = " and ".join(_flag(key) for key in given)
        raise UsageError(f"{flags} shape{'s' if len(given) == 1 else ''} sampled draws, and this run does not "
                         f"sample ({why}): add --do-sample, or leave {'it' if len(given) == 1 else 'them'} out")


def check_draws(args, generation_config) -> None:
    """`decoding_note`'s refusals, from the model's generation config alone (no weights, no Model): flags that
    shape draws where nothing is sampled, and sampling with beams, said before an export or an engine build."""
    given = {key: getattr(args, key, None) for key in SAMPLING_KEYWORDS}
    sampling = Sampling.resolve(generation_config, **given)
    check_draw_flags_apply(dict(given, sampling_stream=getattr(args, "sampling_stream", None)), sampling.do_sample)
    beams = args.num_beams if getattr(args, "num_beams", None) is not None else generation_config.num_beams or 1
    if beams > 1 and sampling.samples:
        raise UsageError(BEAMS_WITH_SAMPLING)


def check_decoding_flags(args) -> None:
    """The sampling flags' values, checked before any model loads (one sentence naming the flag)."""
    given = {key: getattr(args, key, None) for key in SAMPLING_KEYWORDS}
    sampling = Sampling(seed=args.seed, stream=getattr(args, "sampling_stream", None) or "generate",
                        **{key: value for key, value in given.items() if value is not None})
    if given.get("do_sample") and sampling.samples and (getattr(args, "num_beams", None) or 1) > 1:
        raise UsageError(BEAMS_WITH_SAMPLING)  # (a model whose generation config samples is told after its load)
    if given.get("do_sample") is False:  # else the model's generation config decides, after its load
        check_draw_flags_apply(dict(given, sampling_stream=getattr(args, "sampling_stream", None)), False)
    if getattr(args, "repetition_penalty", None) is not None:
        check_repetition_penalty(args.repetition_penalty)


def decoding_note(model: Model, decoding: dict, num_beams: int | None) -> str:
    """How tokens are picked, for a title: "greedy", "beams 4" or the sampling settings and seed (checked: beam
    search with sampling is refused here, before anything runs)."""
    options = model.generation_options(1, 0, num_beams, **decoding)
    check_draw_flags_apply(decoding, options.sampling.do_sample)
    if options.num_beams > 1:
        return f"beams {options.num_beams}"
    return options.sampling.describe()


def weights_and_cache(args) -> str:
    """What a title says of the precision and the KV cache (what most changes a generation's speed besides the
    backend): "fp32, cache on"."""
    return f"{'fp16' if args.fp16 else 'fp32'}, cache {'on' if args.use_cache else 'off'}"


def timing_settings(args) -> TimingSettings:
    return TimingSettings(
        iterations=args.iterations, number=args.number, warmup=args.warmup, duration=args.duration,
        percentile=args.percentile,
    )


GIVEN_ONNX = ("decoder_onnx", "encoder_onnx", "cache_generator_onnx")  # BackendOptions fields, flags with dashes
GIVEN_ENGINES = ("decoder_engine", "encoder_engine", "cache_generator_engine")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def backend_options(args) -> BackendOptions:
    """Backend options from the flags (`check_backend_flags`)."""
    check_backend_flags(args, args.backends)
    quantize = "int8" if args.int8 else "int4" if args.int4 else None
    return BackendOptions(working_dir=args.working_dir, threads=args.threads, quantize=quantize,
                          block_size=getattr(args, "block_size", None), int8_method=_int8_method(args),
                          cuda_graph=args.cuda_graph,
                          kv_layout=getattr(args, "kv_layout", None) or "shared",
                          **{f: getattr(args, f) for f in (*GIVEN_ONNX, *GIVEN_ENGINES)})


def _int8_method(args) -> str | None:
    given = getattr(args, "int8_method", None)
    return given.replace("-", "_") if given else None


def check_backend_flags(args, names: list[str]) -> None:
    """--int8/--int4 and given ONNX files need a backend that runs ONNX files, given engines the trt backend,
    --cuda-graph frameworks or trt (and a CUDA GPU: `check_machine`, after the other flags). `names`: the backends
    as named (onnxrt-int8). Also run by nndf.cli before the given paths are checked: a flag that does not apply is
    said first, not that its file is missing."""
    backends = list(dict.fromkeys(split_backend(name)[0] for name in names))
    quantize = "int8" if args.int8 else "int4" if args.int4 else None
    onnx_flags = [f"--{quantize}"] * bool(quantize) + [_flag(f) for f in GIVEN_ONNX if getattr(args, f)]
    if onnx_flags and not any(b in RUNS_ONNX_FILES for b in backends):
        raise UsageError(f"{onnx_flags[0]} applies to the {', '.join(RUNS_ONNX_FILES)} backend(s); add one of them")
    block_size = getattr(args, "block_size", None)
    if block_size is not None and not (quantize or any(split_backend(name)[1] for name in names)):
        raise UsageError("--block-size applies to quantized weights; add --int8 or --int4, or a backend such as "
                         "onnxrt-int8")
    if _int8_method(args) and not (quantize == "int8" or any(split_backend(name)[1] == "int8" for name in names)):
        raise UsageError("--int8-method applies to int8 weights; add --int8 or the backend onnxrt-int8")
    trt_flags = [_flag(f) for f in GIVEN_ENGINES if getattr(args, f)]
    if trt_flags and "trt" not in backends:
        raise UsageError(f"{trt_flags[0]} applies to the trt backend; add trt")
    if args.cuda_graph and not {"trt", "frameworks"} & set(backends):
        raise UsageError("--cuda-graph applies to the frameworks and trt backends; add one of them")


def add_image_argument(parser, help_text: str) -> None:
    parser.add_argument_group("image-to-text").add_argument("--image", nargs="+", metavar="PATH", help=help_text)


def given_images(args, spec) -> list[Path] | None:
    """The image files of `--image` (folders expanded), checked to be readable PNG or JPEG files; None when no
    --image was given. Only image-to-text families read images."""
    paths = getattr(args, "image", None)
    if not paths:
        return None
    if not architecture(spec).takes_images:
        raise UsageError(f"--image applies to image-to-text families (BLIP); {spec.family} reads text")
    return image_files(paths)


def open_models(args, needs_text: bool = False, new_tokens_flag: str | None = None,
                before_load: Callable[[], None] | None = None,
                check_inputs: Callable[[LoadedModel, ShapeSpec], None] | None = None,
                info_rows: int | None = None) -> list[Model]:
    """One Model per backend named on the command line, sharing one loaded PyTorch model.

    Names, flags, image files and the family are all checked before the (possibly slow) load; with `needs_text`
    (actions that tokenize or decode), the tokenizer is loaded right after the weights, so that a missing one is
    said before any export or engine build. `new_tokens_flag` names an action's own count of new tokens (triton's
    --max-new-tokens), which must leave a position for a prompt, as --output-seq-len must. `before_load` reads an
    action's data (accuracy's LAMBADA, evaluate's tasks) after every flag and this machine are checked, so that a
    typo is told before a data set fails (offline, say), and a data set's failure before the load. `check_inputs`
    checks an action's inputs against the model (run's samples against its positions) from its config and
    tokenizer, before this machine's checks and the weights; what it loads is what the action then uses.
    `info_rows`: the most prompts the action runs together where that is not --batch-size (a Triton model's batch),
    for --info's shapes.
    """
    spec, variant = resolve(args.model, args.variant)
    given_images(args, spec)
    check_decoding_flags(args)
    twice = sorted({name for name in args.backends if args.backends.count(name) > 1})
    if twice:  # one row each: a second would be the same run under the same label
        raise UsageError(f"backend {', '.join(twice)} is named twice; name each backend once")
    named = [split_backend(name) for name in args.backends]
    backends = list(dict.fromkeys(name for name, _ in named))
    if any(quantize for _, quantize in named) and (args.int8 or args.int4):
        raise UsageError(f"--{'int8' if args.int8 else 'int4'} quantizes every onnxrt row; with a quantized backend "
                         "name such as onnxrt-int8 in the list, leave the flag out")
    check_kv_layout(getattr(args, "kv_layout", None), backends, spec, getattr(args, "use_cache", True))
    settings = build_settings(args)
    options = backend_options(args)  # its flags checked before the slow load
    for name in backends:
        if name not in spec.backends:
            raise UsageError(
                f"backend '{name}' does not support the {spec.family} family; allowed: {', '.join(spec.backends)}"
            )
    config = load_config(spec, variant, torch_dir=args.torch_dir, random_weights=args.random_weights)
    shapes = architecture(spec).derive_shapes(settings, spec, config)  # flags against the positions, before the load
    new_tokens = getattr(args, new_tokens_flag[2:].replace("-", "_")) if new_tokens_flag else None
    if new_tokens is not None and new_tokens >= shapes.max_positions:
        raise UsageError(f"{new_tokens_flag} {new_tokens} leaves no position for a prompt: this model has "
                         f"{shapes.max_positions} positions")
    if getattr(args, "tgt_lang", None):
        spec.hooks.language_token_id(args.tgt_lang, None, config)  # a family or code without it, before the load
    loaded = load_model(  # the weights load on first use: the generation config is read without them
        spec, variant, torch_dir=args.torch_dir, random_weights=args.random_weights,
        tokenizer_dir=args.tokenizer_dir, dtype=torch.float16 if settings.fp16 else torch.float32,
        device=default_device(), seed=args.weights_seed,
    )
    if hasattr(args, "do_sample"):  # actions with the sampling flags
        check_draws(args, loaded.generation_config)
    if check_inputs is not None:
        check_inputs(loaded, shapes)
    check_machine(args, spec, variant, backends, settings, options, shapes)  # after every flag, before the load
    if before_load is not None:
        before_load()
    if needs_text:
        loaded.tokenizer  # noqa: B018 (loads it, or says which --tokenizer-dir is missing)
    forced_bos = target_language_token(loaded, args.tgt_lang) if getattr(args, "tgt_lang", None) else None
    # opened with the backends that run the PyTorch model first: an export then builds from the weights they hold
    # instead of loading them for itself (and letting them go) before those backends load them again
    first = sorted(range(len(named)), key=lambda index: named[index][0] not in RUNS_TORCH_MODEL)
    opened = {index: Model(loaded, named[index][0], settings, _row_options(options, named[index][1]))
              for index in first}
    models = [opened[index] for index in range(len(named))]
    for model in models:
        model.forced_bos_token_id = forced_bos
    if getattr(args, "info", False):
        info = info_result(models[0], info_rows)
        print(info.render(verbose=True))
        print()
        args.info_context = info.context  # the results below show only what it did not
    return models


def _row_options(options: BackendOptions, named_quantization: str | None) -> BackendOptions:
    """One backend's options: its named quantization (onnxrt-int8) in place of the flags', and the quantization
    flags only where it quantizes (an fp32 row beside an int8 one has no block size and no int8 method)."""
    quantize = named_quantization or options.quantize
    row = dataclasses.replace(options, quantize=quantize, block_size=options.block_size if quantize else None)
    return dataclasses.replace(row, int8_method=row.int8_kernel)


def label(model: Model) -> str:
    """A backend's name in tables, with what changes its numbers (quantization, CUDA graphs)."""
    extra = [model.options.quantize] if model.options.quantize and not model.is_reference else []
    if extra and model.options.int8_kernel is not None:
        extra.append(model.options.int8_kernel.replace("_", "-"))
    if extra and model.options.block_size is not None:
        extra.append(f"block {model.options.block_size}")
    if model.options.cuda_graph and not model.is_reference:
        extra.append("cuda-graph")
    return " ".join([model.backend, *extra])


def describe(model: Model, *others: Model) -> dict:
    """The context of a result: what ran, so that a JSON file is self-explanatory. `backend_options` are the first
    model's; with `others` (the other backends of one table), `backends` gives each row's own (its quantization,
    its graph's KV layout), which the first one's do not tell."""
    context = {
        "backend_options": _backend_options(model),
        "model": model.spec.family,
        "variant": model.loaded.name,  # a --torch-dir model is named after its folder
        "weights": model.loaded.source,
        "device": str(model.decoder.device),
        "cpu": cpu_description(),  # figures carry over only between machines that agree on it (nndf.machine)
        "settings": model.settings.as_dict(),
    }
    gpu = gpu_description(model.decoder.device)
    if gpu:
        context["gpu"] = gpu
    if others:
        context["backends"] = {label(m): _backend_options(m) for m in (model, *others)}
    return context


def _backend_options(model: Model) -> dict:
    """A model's backend options that are set. The KV layout is the one its graphs have (a model whose attention
    cannot share its cache keeps growing, whatever --kv-layout asked)."""
    options = {k: v for k, v in dataclasses.asdict(model.options).items() if v is not None and k != "kv_layout"}
    layouts = {getattr(session, "kv_layout", None) for session in model.decoder.sessions} - {None}
    if layouts:
        options["kv_layout"] = "/".join(sorted(layouts))
    return options


def info_result(model: Model, rows: int | None = None) -> Result:
    """`--info`: the settings and every decoder tensor shape, derived from the one ShapeSpec; with `rows`, those of
    1 to `rows` prompts at once (an action that batches requests), which the graph's dynamic batch takes as they
    are: the build's own settings, which name its files, stay as they were."""
    notes = [note for session in model.decoder.sessions for note in getattr(session, "info_notes", [])]
    settings, shapes = model.settings, model.shapes
    if rows is not None and rows != settings.batch_size:
        settings = dataclasses.replace(settings, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=rows)
        shapes = architecture(model.spec).derive_shapes(settings, model.spec, model.loaded.config)
    context = describe(model)
    context["settings"] = settings.as_dict()
    return shapes_result(f"{model.spec.family} {model.loaded.name}: tensor shapes", shapes, context, notes,
                         settings.fp16)


def random_input_ids(batch: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Seeded random prompts, as benchmarks use (their content does not affect the cost)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def encode_prompts(tokenizer, prompts: list[str], use_mask: bool,
                   pad_side: str = "left") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids of a batch of prompts, padded with a mask (on the left for decoder-only models, which continue
    every row from its end; an encoder reads the whole input, so `pad_side` "right" as its tokenizer does);
    prompts of different lengths need --use-mask."""
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    lengths = {len(e) for e in encoded}
    if min(lengths) == 0:
        raise UsageError("an empty prompt cannot be generated from; type some text")
    if len(lengths) > 1 and not use_mask:
        raise UsageError("the prompts of this batch differ in length; add --use-mask to pad them with a mask")
    width = max(lengths)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, tokens in enumerate(encoded):
        where = slice(width - len(tokens), width) if pad_side == "left" else slice(0, len(tokens))
        ids[row, where] = torch.tensor(tokens)
        mask[row, where] = 1
    return ids, (mask if use_mask else None)


def generation_inputs(model: Model, prompt: str, image: Path | None = None, use_mask: bool = False) -> dict:
    """`Model.generate`'s inputs for one prompt: its token ids (and mask), or for an image-to-text model the
    processor's pixels of `image` with `prompt` as the caption's text prefix (empty: none)."""
    if model.architecture.takes_images:
        return caption_inputs(model.processor, [image], prompt or None)
    ids, mask = encode_prompts(model.tokenizer, [prompt], use_mask, model.architecture.pad_side)
    model.architecture.check_token_ids(ids, model.shapes)  # before a reply's first words are printed
    return {"input_ids": ids, "attention_mask": mask}
