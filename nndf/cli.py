"""Command line: `python run.py ACTION MODEL BACKEND... --variant NAME [flags]`.

Parsing and validation live here; each action is a small function in `nndf.actions` that returns `Result`s,
which this module prints as tables and, with `--json FILE`, writes as JSON. Usage errors are one sentence on
stderr and exit code 2; known runtime failures are one sentence and exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nndf.errors import OneSentenceParser, UsageError, run_command
from nndf.interrupt import Interrupted
from nndf.paths import check_output_file, check_output_folder

# Action name -> (module in nndf.actions, one-line help). Each module has `add_arguments(parser)` and `run(args)`.
ACTIONS: dict[str, tuple[str, str]] = {
    "benchmark": ("benchmark", "time generation at fixed input/output lengths on random inputs (no early stop)"),
    "accuracy": ("accuracy", "LAMBADA top-N accuracy and perplexity (NVIDIA demo and lm-evaluation-harness)"),
    "evaluate": ("evaluate", "lm-evaluation-harness tasks on each backend: lm-eval's table, and each metric against "
                 "the first backend"),
    "chat": ("chat", "type prompts and see each backend's reply as it is generated, with its time; the chat remembers "
             "the conversation (/reset forgets it); exit, quit, /exit or Ctrl-D ends"),
    "run": ("run", "the family's sample inputs from checkpoint.toml: accuracy against labels and runtimes"),
    "compare": ("compare", "one table of checkpoint accuracy and runtimes across the backends given"),
    "export": ("export", "build (or reuse) the ONNX graphs and engines the given backends run, and show where"),
    "triton": ("triton", "a Triton Inference Server model that generates with our loop on the onnxrt graph"),
    "list": ("listing", "families, their variants, hub ids and sizes (every family runs on every backend)"),
}


class _Parser(OneSentenceParser):
    """One sentence and exit 2 for a usage error, and for a flag of NVIDIA's demo what to write instead."""

    def error(self, message: str):
        from nndf.demo_flags import hint

        super().error(hint(message))

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an unrecognized flag that another action takes is named as such (`--num-samples is a
        flag of accuracy`), with the action's own --help: argparse alone says only "unrecognized arguments"."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._elsewhere(extras, namespace)}")
        return namespace

    def _elsewhere(self, extras: list[str], namespace) -> str:
        from nndf.demo_flags import REPLACED, synonym  # a flag of NVIDIA's demo gets its own hint (`error`)

        action = getattr(namespace, "action", None)
        parsers = getattr(self, "action_parsers", {})
        if action not in parsers:
            return ""
        notes = []
        for flag in dict.fromkeys(word.split("=")[0] for word in extras if word.startswith("-")):
            if flag in REPLACED:
                continue
            same = synonym(flag, parsers[action]._option_string_actions)
            if same:
                notes.append(same)
                continue
            others = actions_with_flag(flag, parsers, action)
            if others:
                notes.append(f"{flag} is a flag of {', '.join(others)}")
        return f" ({'; '.join(notes)}; see python run.py {action} --help)" if notes else ""


def actions_with_flag(flag: str, parsers: dict, action: str) -> list[str]:
    """The actions other than `action` whose parser (`build_parser().action_parsers`) takes `flag`: what to name for
    a flag given to the wrong action, on the command line and through nndf.run."""
    return [name for name, parser in parsers.items() if name != action and flag in parser._option_string_actions]


def _model_arguments(p: argparse.ArgumentParser, batch_size: int = 1, batch_help: str = "sequences per batch",
                     compare: bool = False, backends_help: str | None = None) -> None:
    """The model, backend and build flags every model action shares. `compare`: the backends may come as
    positionals and/or with `--compare/-c`, as NVIDIA's demo's compare and chat take them; `backends_help`: what
    an action that takes only some backends says of them."""
    from nndf.backends import BACKENDS, backend_names

    p.add_argument("model", metavar="MODEL", help="model family, e.g. GPT2 (see `run.py list`)")
    quantized = [name for name in backend_names() if name not in BACKENDS]
    p.add_argument(
        "backends", metavar="BACKEND", nargs="*" if compare else "+", type=str.lower,  # TRT, ONNXRT as well
        help=backends_help or f"one or more of: {', '.join(BACKENDS)}; {', '.join(quantized)} run quantized weights "
        "beside the others (e.g. frameworks onnxrt onnxrt-int8 gives one table)"
        + (", here or after --compare" if compare else ""))
    if compare:
        p.add_argument("--compare", "-c", nargs="+", metavar="BACKEND", default=[], type=str.lower,
                       help="backends to run side by side, after those named before (NVIDIA's demo's --compare)")
    g = p.add_argument_group("model")
    g.add_argument("--variant", "-m", help="variant of the family, e.g. gpt2-medium (default: the family's first)")
    g.add_argument("--torch-dir", help="load the PyTorch model from this local Hugging Face folder")
    g.add_argument("--random-weights", action="store_true",
                   help="build the variant from its known config with random weights (works offline)")
    g.add_argument("--tokenizer-dir", help="load the tokenizer from this folder (needed offline with --random-weights)")
    g.add_argument("--seed", type=int,
                   help="seed for random data (benchmark's prompts, the passages accuracy's --num-samples picks; "
                   "without it: 0) and, where tokens are sampled, for the draws: --seed S draws what "
                   "torch.manual_seed(S) before generate() draws (without it: a fresh seed, shown in the output so "
                   "that a run can be repeated); evaluate: every seed of lm-eval, as its own --seed N; the weights "
                   "stay those of --weights-seed")
    g.add_argument("--weights-seed", type=int, default=0,
                   help="seed of --random-weights (default 0, as nndf.load's): another seed is other weights, so a "
                   "new export")
    g.add_argument("--working-dir", "-wd", default="temp",
                   help="where exported and built artifacts go (default: temp)")
    b = p.add_argument_group("build and generation")
    b.add_argument("--batch-size", "-b", type=int, default=batch_size, help=f"{batch_help} (default {batch_size})")
    b.add_argument("--num-beams", type=int, default=1, help="beam search width; 1 is greedy (default 1)")
    b.add_argument("--fp16", action="store_true",
                   help="run in half precision (for GPUs: on the CPU PyTorch computes it far slower than fp32 and "
                        "onnxrt refuses it)")
    b.add_argument("--use-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse past keys and values between steps (default on; -kv and --enable-kv-cache, the names "
                   "of NVIDIA's demo, turn it on too)")
    b.add_argument("-kv", "--enable-kv-cache", dest="use_cache", action="store_const", const=True,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    b.add_argument("--use-mask", action=argparse.BooleanOptionalAction, default=False,
                   help="feed an attention mask; needed for batches of prompts of different lengths (default off)")
    b.add_argument("--input-seq-len", type=int,
                   help="prompt length in tokens (the encoder's input length for encoder-decoder models)")
    b.add_argument("--output-seq-len", type=int, help="tokens to generate (after the decoder's start token)")
    b.add_argument("--tgt-lang", metavar="CODE",
                   help="mBART-50: the language to generate, forced as the first token (e.g. de_DE, ro_RO)")
    b.add_argument("--dynamic-batch", action="store_true", help="build for a range of batch sizes")
    b.add_argument("--min-dynamic-batch", type=int, help="smallest batch of the range (default 1)")
    b.add_argument("--max-dynamic-batch", type=int, help="largest batch of the range (default: the batch "
                   "size, or --min-dynamic-batch where larger)")
    b.add_argument("--engine-postfix", default="", help="text appended to built engine names")
    b.add_argument("--disable-preview-dynamic-shapes", action="store_true",
                   help="turn off TensorRT's faster-dynamic-shapes preview feature")
    r = p.add_argument_group("backends")
    r.add_argument("--threads", type=int, help="intra-op threads for PyTorch and ONNX Runtime (default: "
                   "$OMP_NUM_THREADS where it is set, for both, else one per core)")
    r.add_argument("--decoder-onnx", metavar="PATH", help="onnxrt: run this decoder ONNX file instead of exporting")
    r.add_argument("--encoder-onnx", metavar="PATH",
                   help="onnxrt, encoder-decoder models: run this encoder ONNX file instead of exporting")
    r.add_argument("--cache-generator-onnx", metavar="PATH", help="onnxrt, encoder-decoder models: run this "
                   "cross-attention cache generator ONNX file instead of exporting")
    r.add_argument("--decoder-engine", metavar="PATH", help="trt: run this TensorRT engine instead of building one")
    r.add_argument("--encoder-engine", metavar="PATH",
                   help="trt, encoder-decoder models: run this encoder engine instead of building one")
    r.add_argument("--cache-generator-engine", metavar="PATH", help="trt, encoder-decoder models: run this "
                   "cross-attention cache generator engine instead of building one")
    r.add_argument("--cuda-graph", "--use-cuda-graph", action="store_true",
                   help="frameworks and trt on a CUDA GPU: capture each decode step once as a CUDA graph and replay "
                   "it (one launch per token instead of hundreds). Worth it where launches dominate: small models, "
                   "batch 1-8; little gain on a large model at a large batch. frameworks needs a model that steps "
                   "over a static KV cache (all families but GPT-Neo)")
    r.add_argument("--kv-layout", choices=("shared", "growing"),
                   help="onnxrt: the decoder graph's KV cache: 'shared' (default): one buffer per layer of the "
                   "generation's length that ONNX Runtime's GroupQueryAttention writes in place, or 'growing': "
                   "past/present tensors concatenated in the graph at every step. A model whose attention cannot "
                   "have the shared layout (BLOOM, GPT-Neo) or a run on the CUDA provider keeps growing; --info "
                   "says which layout a build uses")
    q = r.add_mutually_exclusive_group()
    q.add_argument("--int8", action="store_true", help="onnxrt: int8 weights (8-bit MatMulNBits on a CPU with "
                   "VNNI and no AMX, else ONNX Runtime's dynamic quantization; the embedding tables 8-bit block-wise)")
    q.add_argument("--int4", action="store_true", help="onnxrt: 4-bit block-wise weights (MatMulNBits)")
    r.add_argument("--block-size", type=int, metavar="N", help="onnxrt-int8/int4: every block-wise part (MatMulNBits, "
                   "int8's tables) in blocks of N, each with its own scale; a power of two >= 16 (default: int4 128; "
                   "int8 128, its tables 32; smaller blocks are more exact, larger ones faster)")
    r.add_argument("--int8-method", choices=("matmul-nbits", "dynamic"), help="onnxrt-int8: how int8 weight "
                   "MatMuls run, in place of the CPU's choice (--info says it): 'matmul-nbits', 8-bit MatMulNBits in "
                   "blocks (the shorter decode step on a CPU with VNNI and no AMX), or 'dynamic', ONNX Runtime's "
                   "dynamic quantization (per-channel scales, activations quantized per step: the faster prompt and "
                   "batch there, and the faster everything on AMX or without VNNI)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    o.add_argument("--info", action="store_true", help="print the settings and tensor shapes before running")
    p.output_group = o  # where an action's own output flags (--plot) are listed


def _sampling_arguments(p: argparse.ArgumentParser) -> None:
    """generate()'s sampling keywords as flags; a flag left out takes the model's generation config, as generate()
    does (a model whose config says do_sample samples unless --no-do-sample)."""
    s = p.add_argument_group("sampling (default: the model's generation config, else greedy)")
    s.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="draw each token from the distribution the flags below shape, as generate(do_sample=True); "
                   "--no-do-sample: greedy (or beam) search whatever the model's config says")
    s.add_argument("--temperature", type=float, help="divide the logits by this before drawing (0: greedy; "
                   "generate()'s default 1)")
    s.add_argument("--top-k", type=int, help="draw among the K likeliest tokens (0: all; generate()'s default 50)")
    s.add_argument("--top-p", type=float, help="draw among the likeliest tokens whose probabilities sum to P "
                   "(nucleus sampling; 1: all)")
    s.add_argument("--min-p", type=float, help="drop tokens less likely than P times the likeliest one")
    s.add_argument("--typical-p", type=float, help="locally typical sampling with mass P (1: off)")
    s.add_argument("--repetition-penalty", type=float, help="scale down the logits of tokens already in the "
                   "sequence (CTRL's penalty, as generate(); 1: off); applies to greedy and beam search too")
    s.add_argument("--sampling-stream", metavar="{generate,fast}", help="where the draws come from: generate "
                   "(default: generate()'s own random stream, so --seed S gives the tokens of torch.manual_seed(S) "
                   "before generate()) or fast (the same distribution from a stream of our own: on the CPU a "
                   "fraction of the cost per token, reproducible with --seed, but not generate()'s tokens)")


def _timing_arguments(p: argparse.ArgumentParser) -> None:
    # %(default)s: an action may set its own (run and compare time each sample 3 times after 1 warm-up call)
    t = p.add_argument_group("timing")
    t.add_argument("--iterations", type=int, default=10, help="timed samples (default %(default)s)")
    t.add_argument("--number", type=int, default=1, help="calls averaged into one sample (default %(default)s)")
    t.add_argument("--warmup", type=int, default=3, help="untimed calls first (default %(default)s)")
    t.add_argument("--duration", type=float, default=0.0,
                   help="keep timing runs, past --iterations, until this many seconds have passed (default 0)")
    t.add_argument("--percentile", type=float, default=50.0, help="percentile reported as latency (default 50)")


# Flags that name a path, and whether it must be a folder or a file: checked before any model or data set loads.
GIVEN_PATHS = {"torch_dir": "folder", "tokenizer_dir": "folder", "dataset_file": "file", "decoder_onnx": "file",
               "encoder_onnx": "file", "cache_generator_onnx": "file", "decoder_engine": "file",
               "encoder_engine": "file", "cache_generator_engine": "file"}


def check_given_paths(args) -> None:
    """One sentence for the first path flag whose path is missing or of the wrong kind."""
    from pathlib import Path

    for attribute, kind in GIVEN_PATHS.items():
        value = getattr(args, attribute, None)
        if value is None:
            continue
        flag = "--" + attribute.replace("_", "-")
        if not str(value).strip():  # Path("") is the current folder: "--dataset-file  is a folder"
            raise UsageError(f"{flag} is empty; it takes the path of a {kind}")
        path = Path(value)
        if not path.exists():
            raise UsageError(f"{flag} {value} does not exist")
        if (kind == "folder") != path.is_dir():
            raise UsageError(f"{flag} {value} is {'a file' if kind == 'folder' else 'a folder'}; it takes a {kind}")
    check_output_folder("--working-dir", getattr(args, "working_dir", None))
    check_output_folder("-o/--output", getattr(args, "output", None), into=True)
    check_output_file("--json", getattr(args, "json", None), "results.json")
    check_output_file("--plot", getattr(args, "plot", None), "bench.png")
    if getattr(args, "plot", None) and Path(args.plot).suffix.lower() != ".png":
        raise UsageError(f"--plot {args.plot}: the plot is a PNG image; give a file name ending in .png")


def check_unused_flags(args) -> None:
    """A shared flag that the action would silently ignore (`--num-beams` on `accuracy`) is one sentence instead: a
    user who set it expects it to change something. The action's `UNUSED_FLAGS` says why it has no use for it."""
    for dest, (default, why) in getattr(args, "unused_flags", {}).items():
        if getattr(args, dest, default) != default:
            raise UsageError(f"--{dest.replace('_', '-')} does not apply to {args.action}: {why}")
    _check_engine_flags(args)
    for flag in ("seed", "weights_seed"):
        seed = getattr(args, flag, None)
        if seed is not None and not 0 <= seed < 2**63:
            raise UsageError(f"--{flag.replace('_', '-')} must be a whole number from 0 to 2**63 - 1, got {seed}")
    if getattr(args, "weights_seed", 0) and not getattr(args, "random_weights", False):
        raise UsageError("--weights-seed seeds --random-weights, and the weights here are loaded: give "
                         "--random-weights or drop --weights-seed")


# Flags that shape only TensorRT engines (their profiles, features and names), with the value that leaves them off
ENGINE_ONLY_FLAGS = {"dynamic_batch": False, "min_dynamic_batch": None, "max_dynamic_batch": None,
                     "disable_preview_dynamic_shapes": False, "engine_postfix": ""}


def _check_engine_flags(args) -> None:
    """A TensorRT build flag without trt among the backends, or a dynamic-batch bound without --dynamic-batch,
    would change nothing: one sentence instead."""
    from nndf.backends import split_backend
    from nndf.option_checks import check_engine_postfix

    if not hasattr(args, "backends"):
        return
    named = [*args.backends, *getattr(args, "compare", [])]
    has_trt = any(split_backend(name)[0] == "trt" for name in named if isinstance(name, str))
    for dest, off in ENGINE_ONLY_FLAGS.items():
        if getattr(args, dest, off) != off and named and not has_trt:
            raise UsageError(f"--{dest.replace('_', '-')} shapes TensorRT engines; without trt among the backends "
                             "it changes nothing: name trt or drop it")
    if hasattr(args, "decoder_engine"):  # the actions that take given graphs and engines
        from nndf.actions.common import check_backend_flags

        check_backend_flags(args, [name for name in named if isinstance(name, str)])
    check_engine_postfix(getattr(args, "engine_postfix", ""))  # a name's characters, before anything loads
    for dest in ("min_dynamic_batch", "max_dynamic_batch"):
        if getattr(args, dest, None) is not None and not getattr(args, "dynamic_batch", False):
            raise UsageError(f"--{dest.replace('_', '-')} bounds --dynamic-batch's range: add --dynamic-batch")
    if getattr(args, "dynamic_batch", False):
        from nndf.actions.common import build_settings

        build_settings(args)  # its range checked now, before a backend (trt: the GPU) is looked for


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="run.py",
        description="Run Hugging Face generative models on PyTorch (frameworks), ONNX Runtime (onnxrt) and "
        "TensorRT (trt) with one decoding loop, and measure their speed and accuracy.",
        epilog="Example: python run.py benchmark GPT2 frameworks --variant gpt2 --random-weights. Encoder models "
        "(BERT, MiniLM, RoBERTa, ...): python run.py convert -m MODEL --task embedding, as transformer-deploy's "
        "convert_model (python run.py convert --help).",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser, required=True)
    parser.action_parsers = {}  # action name -> its parser (nndf.api reads which flags an action has)
    for name, (module, help_text) in ACTIONS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        parser.action_parsers[name] = p
        action = importlib.import_module(f"nndf.actions.{module}")
        if getattr(action, "NEEDS_MODEL", True):
            _model_arguments(p, getattr(action, "DEFAULT_BATCH_SIZE", 1),
                             getattr(action, "BATCH_HELP", "sequences per batch"), getattr(action, "COMPARES", False),
                             getattr(action, "BACKENDS_HELP", None))
        if getattr(action, "SAMPLES", False):
            _sampling_arguments(p)
        if getattr(action, "TIMED", False):
            _timing_arguments(p)
        action.add_arguments(p)
        unused = getattr(action, "UNUSED_FLAGS", {})  # shared flags this action has no use for: refused, not ignored
        for option in p._actions:
            if option.dest in unused:
                option.help = argparse.SUPPRESS
            elif option.dest == "output_seq_len" and option.default is not None:  # an action's own default
                option.help = f"{option.help} (default {option.default})"
            elif option.dest == "output_seq_len" and hasattr(action, "OUTPUT_LEN_DEFAULT"):  # set in its `run`
                option.help = f"{option.help} (default: {action.OUTPUT_LEN_DEFAULT})"
            elif option.dest == "input_seq_len" and hasattr(action, "INPUT_LEN_DEFAULT"):  # set in its `run`
                option.help = f"{option.help} (default {action.INPUT_LEN_DEFAULT})"
        p.set_defaults(run_action=action.run,
                       unused_flags={dest: (p.get_default(dest), why) for dest, why in unused.items()})
    # listed in the help only: `main` hands `convert` and its own flags to nndf.convert.cli before parsing
    sub.add_parser("convert", add_help=False, help="encoder models (BERT, MiniLM, RoBERTa...) to ONNX Runtime and "
                   "TensorRT, checked and timed, with a Triton repository, as transformer-deploy's convert_model "
                   "(run.py convert --help; `convert_model` is the same action)")
    return parser


# `main` hands these to nndf.convert.cli: `convert`, and transformer-deploy's own name for it, as its users type it
CONVERT_ACTIONS = ("convert", "convert_model")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(lambda: _main(argv))


def _main(argv: list[str]) -> int:
    if argv and argv[0] in CONVERT_ACTIONS:  # transformer-deploy's convert_model, with its own flags
        from nndf.convert.cli import main as convert_main

        return convert_main(argv[1:])
    parser = build_parser()
    if argv and argv[0] not in ACTIONS and not argv[0].startswith("-"):
        raise UsageError(f"unknown action '{argv[0]}'; allowed: {', '.join([*ACTIONS, *CONVERT_ACTIONS])}")
    args = parser.parse_args(argv)
    check_unused_flags(args)
    check_given_paths(args)
    try:
        results, code = args.run_action(args), 0
    except Interrupted as stopped:  # Ctrl-C after some backends were measured: their tables, then exit as interrupted
        results, code = stopped.results, 130
    from nndf.results import write_json

    rendered = [result.render(verbose=getattr(args, "info", False), shown=getattr(args, "info_context", None))
                for result in results]
    print("\n\n".join(rendered))  # a blank line between tables, none after the last
    if getattr(args, "json", None):
        write_json(results, args.json)
        print(f"\nresults written to {args.json}")
    if code:
        print("interrupted", file=sys.stderr)
    return code
