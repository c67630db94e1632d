"""`convert_model`'s flags: every flag of transformer-deploy's `convert_model`, under the same names and defaults
(`--backend` also takes `pytorch`, and `--json` writes the report), validated into one `ConvertOptions`.
`--load-external-data` is accepted and changes nothing (each graph is one file with its weights, under protobuf's
2 GB cap: `nndf.convert.graphs.check_graph_size`);
`--generative-model t5` (also spelled `--generative_model`, as transformer-deploy once did) is refused: T5
generates through `run.py`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from nndf.backends import usable_cores
from nndf.convert.tasks import TASKS
from nndf.errors import OneSentenceParser, UsageError
from nndf.paths import check_output_file, check_output_folder
from nndf.progress import say

BACKENDS = ("onnx", "tensorrt", "pytorch")
INT32_MAX = 2**31 - 1
WORKSPACE_MIB = 10000  # -w's default, as transformer-deploy's
WORKSPACE_MAX_MIB = 2**44 - 1
SEED_MAX = 2**32 - 1  # the usual seed range (numpy's); well within torch's 64 bits for the seed + shape index
_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a Triton model folder and a URL path segment, as they are


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, as transformer-deploy shows them, but not "(default: None)" for the
    flags that have none (their help says what happens without them) nor a default for switches ("(default: True)"
    on --no-load-external-data read as though that switch were on)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool) or action.required:
            return action.help or ""
        return super()._get_help_string(action)


def _check_local(flag: str, value: str, needs: tuple[str, ...] = ()) -> None:
    """A value written as a path (absolute, or starting with . or ~) must exist, and a local path must be a folder
    (holding one of `needs`): the hub's or the tokenizer's message for it is about something else."""
    if not value.strip():  # Path("") is the current folder; -t '' was taken as no -t at all
        raise UsageError(f"{flag} is empty; it takes a local folder or a hub id")
    path = Path(value).expanduser()
    if not path.exists():
        if value.startswith(("/", ".", "~")):
            raise UsageError(f"{flag} {value} does not exist (it takes a local folder or a hub id)")
        return  # a hub id
    if not path.is_dir():
        raise UsageError(f"{flag} {value} is a file; it takes a folder (what save_pretrained() writes) or a hub id")
    if needs and not any((path / name).is_file() for name in needs):
        raise UsageError(f"{flag} {value} holds no {' nor '.join(needs)}; it takes a folder that save_pretrained() "
                         "wrote (the config and the weights) or a hub id")


def parser() -> argparse.ArgumentParser:
    p = OneSentenceParser(
        prog="convert_model",
        description="Convert a Hugging Face encoder model (BERT, RoBERTa, MiniLM, DistilBERT, ALBERT, XLM-R, ELECTRA, "
                    "CamemBERT...) to ONNX Runtime (plain, optimized, int8) and TensorRT, check every output against "
                    "PyTorch, benchmark every backend, and write a Triton Inference Server model repository.",
        formatter_class=_DefaultsShown)
    p.add_argument("-m", "--model", required=True, help="hub id or local Hugging Face folder of the model")
    p.add_argument("-t", "--tokenizer", help="hub id or local folder of the tokenizer (default: the model's; "
                                             "--task embedding serves the sentence-transformers model's own, and -t "
                                             "may only name one that tokenizes as it does)")
    p.add_argument("--task", default="classification", choices=list(TASKS),
                   help="what the model computes; embedding is for sentence-transformers models")
    p.add_argument("-b", "--batch-size", type=int, nargs=3, default=[1, 1, 1], metavar=("MIN", "OPT", "MAX"),
                   help="batch sizes: TensorRT profile range (MIN 1 with --backend tensorrt: Triton sends one "
                        "text as a batch of 1), and OPT is the benchmark's")
    p.add_argument("-s", "--seq-len", type=int, nargs=3, default=[16, 16, 16], metavar=("MIN", "OPT", "MAX"),
                   help="sequence lengths: TensorRT profile range, and OPT is the benchmark's")
    p.add_argument("--backend", nargs="+", default=["onnx"], choices=BACKENDS,
                   help="what to convert, check, benchmark and serve; PyTorch is always the reference")
    p.add_argument("-q", "--quantization", action="store_true",
                   help="int8: dynamic quantization on the CPU, static QDQ with calibration on a GPU (TensorRT)")
    p.add_argument("-w", "--workspace-size", type=int, help=f"TensorRT workspace in MiB (default: {WORKSPACE_MIB})")
    p.add_argument("-o", "--output", default="triton_models", help="folder for the graphs and the Triton repository")
    p.add_argument("-n", "--name", default="transformer", help="model name in Triton")
    p.add_argument("-v", "--verbose", action="store_true", help="show the exporters' and optimizers' logs")
    p.add_argument("--fast", action="store_true", help="skip the PyTorch fp16 benchmark (GPU)")
    p.add_argument("-d", "--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible, else cpu")
    p.add_argument("--nb-threads", type=int, default=1, help="CPU threads of PyTorch and ONNX Runtime")
    p.add_argument("--nb-instances", type=int, default=1, help="model instances in Triton")
    p.add_argument("--warmup", type=int, default=10, help="untimed inferences before each benchmark")
    p.add_argument("--nb-measures", type=int, default=1000, help="timed inferences per backend")
    p.add_argument("--seed", type=int, default=123, help="seed of the random inputs")
    p.add_argument("--atol", type=float, default=3e-1, help="largest difference allowed from PyTorch's outputs")
    p.add_argument("--json", metavar="FILE", help="also write the report (timings, differences, files) as JSON")
    # transformer-deploy spelled it --generative_model from its T5 work (Aug. 2022) until --generative-model
    # replaced it (Nov. 2022): scripts written in between use the underscore
    p.add_argument("--generative-model", "--generative_model", default="gpt", choices=("gpt", "t5"),
                   help="the kind of model --task text-generation converts: gpt (decoder-only; T5 runs with "
                        "`run.py ... T5 onnxrt trt`)")
    p.add_argument("--auth-token", help="Hugging Face Hub token for private models (true: the one stored by "
                                        "`huggingface-cli login`)")
    p.add_argument("--load-external-data", action="store_true",
                   help="kept for transformer-deploy's scripts; changes nothing: each graph is written as one file "
                        "with its weights (models up to 2 GiB of weights; larger ones are refused)")
    p.add_argument("--no-load-external-data", dest="load_external_data", action="store_false",
                   help="kept for transformer-deploy's scripts; changes nothing either")
    return p


@dataclass(frozen=True)
class ConvertOptions:
    model: str
    tokenizer: str
    task: str
    batch_size: tuple[int, int, int]
    seq_len: tuple[int, int, int]
    backends: tuple[str, ...]
    quantization: bool
    workspace_size: int
    output: str
    name: str
    verbose: bool
    fast: bool
    device: str
    nb_threads: int
    nb_instances: int
    warmup: int
    nb_measures: int
    seed: int
    atol: float
    json: str | None
    auth_token: str | bool | None = None  # from_pretrained's `token`


def say_what_changes_nothing(fast_on_cpu: bool, workspace_without_tensorrt: bool) -> None:
    """transformer-deploy's scripts pass -w and --fast whatever they convert to, so both are taken everywhere; where
    one changes nothing in this run, a line on stderr says so rather than leaving it to look applied (after every
    check: a refusal stays one sentence)."""
    if fast_on_cpu:
        say("note: --fast skips the PyTorch fp16 benchmark, which runs on a GPU only; on the CPU it changes nothing")
    if workspace_without_tensorrt:
        say("note: -w/--workspace-size sizes TensorRT's build; without --backend tensorrt it changes nothing")


def _check_range(flag: str, values: list[int]) -> tuple[int, int, int]:
    lo, opt, hi = values
    if lo < 1:
        raise UsageError(f"{flag} values must be at least 1, got {lo}")
    if not lo <= opt <= hi:
        raise UsageError(f"{flag} takes MIN OPT MAX with MIN <= OPT <= MAX, got {lo} {opt} {hi}")
    return lo, opt, hi


def parse(argv: list[str] | None = None) -> ConvertOptions:
    """Parsed and checked options; a UsageError names the flag (argparse itself exits 2 on unknown flags)."""
    args = parser().parse_args(argv)
    for flag in ("model", "tokenizer", "output", "json"):  # the shell leaves ~ alone in --model=~/x: expand it here
        value = getattr(args, flag)
        if value and value.startswith("~"):
            setattr(args, flag, str(Path(value).expanduser()))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("-d/--device cuda needs a CUDA GPU, and none is visible to PyTorch here; use -d cpu")
    if "tensorrt" in args.backend and device != "cuda":
        raise UsageError("--backend tensorrt builds a TensorRT plan, which needs a CUDA GPU; use --backend onnx "
                         "pytorch on the CPU")
    workspace_given = args.workspace_size is not None
    if not workspace_given:
        args.workspace_size = WORKSPACE_MIB
    for flag, value, least in (("--nb-threads", args.nb_threads, 1), ("--nb-instances", args.nb_instances, 1),
                               ("--warmup", args.warmup, 0), ("--nb-measures", args.nb_measures, 1),
                               ("-w/--workspace-size", args.workspace_size, 1)):
        if value < least:
            raise UsageError(f"{flag} must be at least {least}, got {value}")
    if args.workspace_size > WORKSPACE_MAX_MIB:  # TensorRT's pool limit is a size_t of bytes
        raise UsageError(f"-w/--workspace-size must be at most {WORKSPACE_MAX_MIB} MiB (2**64 bytes, TensorRT's "
                         f"limit), got {args.workspace_size}")
    if args.nb_instances > INT32_MAX:  # Triton's instance count is an int32: the config could not be written
        raise UsageError(f"--nb-instances must be at most {INT32_MAX} (Triton's limit), got {args.nb_instances}")
    if not 0 <= args.seed <= SEED_MAX:  # torch's generators take 64-bit seeds; the check inputs use seed + 0, 1, 2
        raise UsageError(f"--seed must be from 0 to {SEED_MAX}, got {args.seed}")
    if not args.atol > 0:  # NaN too: every comparison with it fails, and the check would blame the machine
        raise UsageError(f"--atol must be a positive number, got {args.atol}")
    cores = usable_cores()
    if args.nb_threads > cores:  # far past the cores, OpenBLAS cannot start its threads and kills the process
        raise UsageError(f"--nb-threads {args.nb_threads} is more than the {cores} CPU cores this process may use; "
                         f"give 1 to {cores}")
    if args.quantization and not {"onnx", "tensorrt"} & set(args.backend):
        raise UsageError("-q/--quantization makes int8 ONNX graphs (--backend onnx) or an int8 TensorRT plan (--backend "
                         "tensorrt); with --backend pytorch alone there is nothing to quantize: add onnx or tensorrt")
    if args.generative_model == "t5":
        raise UsageError("--generative-model t5: convert_model converts decoder-only (gpt) text generation; T5 "
                         "generates with run.py (python run.py benchmark T5 frameworks onnxrt trt --variant t5-small)")
    batch_size = _check_range("-b/--batch-size", args.batch_size)
    if "tensorrt" in args.backend and batch_size[0] > 1:  # Triton's batcher hands the plan any batch from 1 up
        raise UsageError(f"-b/--batch-size MIN {batch_size[0]} with --backend tensorrt: the served TensorRT plan "
                         "gets batches of 1 to MAX texts from Triton (a single text is a batch of 1), which a profile "
                         f"from {batch_size[0]} refuses; give -b 1 {batch_size[1]} {batch_size[2]}")
    if not _NAME.fullmatch(args.name):  # before the conversion: the repository writer refuses it only at the end
        raise UsageError(f"-n/--name '{args.name}' names Triton models: use letters, digits, - and _")
    # a sentence-transformers folder is its modules.json (older ones keep config.json in 0_Transformer/)
    sentence_model = TASKS[args.task].auto_class is None
    _check_local("-m/--model", args.model, needs=("config.json", "modules.json") if sentence_model else
                 ("config.json",))
    if args.tokenizer is not None:
        _check_local("-t/--tokenizer", args.tokenizer)
    check_output_folder("-o/--output", args.output, into=True)
    check_output_file("--json", args.json, "report.json")
    say_what_changes_nothing(args.fast and device != "cuda", workspace_given and "tensorrt" not in args.backend)
    return ConvertOptions(
        model=args.model, tokenizer=args.tokenizer or args.model, task=args.task,
        batch_size=batch_size, seq_len=_check_range("-s/--seq-len", args.seq_len),
        backends=tuple(dict.fromkeys(args.backend)), quantization=args.quantization,
        workspace_size=args.workspace_size, output=args.output, name=args.name, verbose=args.verbose, fast=args.fast,
        device=device, nb_threads=args.nb_threads, nb_instances=args.nb_instances, warmup=args.warmup,
        nb_measures=args.nb_measures, seed=args.seed, atol=args.atol, json=args.json,
        auth_token=True if (args.auth_token or "").lower() in ("true", "t") else args.auth_token)
