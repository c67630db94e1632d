"""`triton`: a Triton Inference Server model that serves a generative model with our loop (text in, text out).

The onnxrt backend's decoder graph (fp32, `--int8` or `--int4`) is built or reused as by `export`, then laid out
with its config, generation config and tokenizer as a Python-backend model (`nndf.triton.generative`). Start a
server on it with `tritonserver --model-repository <output>` (docs/triton.md).
"""

from __future__ import annotations

import re
from pathlib import Path

from nndf.actions.common import describe, open_models
from nndf.backends import split_backend
from nndf.errors import UsageError
from nndf.results import Column, Result
from nndf.sampling import SAMPLING_STREAMS
from nndf.triton.generative import MODEL_NAME, SCHEDULERS

BACKENDS_HELP = "onnxrt, or onnxrt-int8 / onnxrt-int4 (or --int8 / --int4): the exported graph Triton serves"
UNUSED_FLAGS = {  # nndf.cli.check_unused_flags
    "batch_size": "a request brings up to --max-batch-size prompts, and Triton batches requests",
    "input_seq_len": "requests bring prompts of any length up to the model's positions",
    "output_seq_len": "a request's new tokens are its MAX_NEW_TOKENS input (--max-new-tokens where it has none)",
    "seed": "a sampled request's draws are seeded by its own SEED input (where it has none, by the server's "
            "random stream)",
    "use_mask": "it always feeds a mask",
    # TensorRT's and CUDA graphs' flags: the shared rule says "name trt", which triton refuses
    **dict.fromkeys(("dynamic_batch", "min_dynamic_batch", "max_dynamic_batch", "disable_preview_dynamic_shapes",
                     "engine_postfix", "decoder_engine", "encoder_engine", "cache_generator_engine"),
                    "it serves the onnxrt backend's ONNX graph (--decoder-onnx gives one), not a TensorRT engine"),
    "cuda_graph": "it serves the onnxrt backend's ONNX graph; CUDA graphs replay the frameworks and trt backends' "
                  "decode steps",
}


def add_arguments(parser) -> None:
    g = parser.add_argument_group("triton")
    g.add_argument("-o", "--output", default="triton_models", help="the model repository (default triton_models)")
    g.add_argument("-n", "--name", help="the Triton model's name: letters, digits, '.', '-' and '_' (default: the "
                   "--torch-dir folder's name, else the variant's, e.g. gpt2; in lower case)")
    g.add_argument("--max-batch-size", type=int, default=8, help="most prompts in one request (default 8)")
    g.add_argument("--nb-instances", type=int, default=1, help="model instances in the server (default 1)")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="new tokens when a request does not say (its MAX_NEW_TOKENS input; default 32)")
    g.add_argument("--scheduler", choices=SCHEDULERS, default="continuous",
                   help="continuous (default): requests join one running batch at each step and leave when done; "
                        "sequential: one request at a time, each as its own batch")
    g.add_argument("--max-rows", type=int, default=None,
                   help="prompts generated together in the continuous batch (default: --max-batch-size); more wait")
    g.add_argument("--max-queue-delay-us", type=int, default=0,
                   help="how long Triton's dynamic batcher holds a request for others to arrive with it "
                        "(microseconds, default 0; continuous scheduler)")
    g.add_argument("--sampling-stream", choices=SAMPLING_STREAMS, default="generate",
                   help="where sampled requests' draws come from: generate (default: generate()'s own random stream, "
                        "so SEED S gives the tokens of torch.manual_seed(S) before generate()) or fast (the same "
                        "distribution from a stream of our own, a fraction of the CPU cost per token; "
                        "nndf/fast_draw.py)")
    g.add_argument("--streaming", action="store_true",
                   help="also write <name>_stream, a decoupled model that sends each new piece of text as it is "
                        "generated (gRPC streaming)")


def default_name(torch_dir: str | None, variant_name: str) -> str:
    """The model's name where --name is not given: what titles call it (a --torch-dir folder's name, as
    `LoadedModel.name`), where that makes a plain Triton model name, else the variant's."""
    folder = Path(torch_dir).resolve().name.lower() if torch_dir else ""
    return folder if re.fullmatch(MODEL_NAME, folder) else variant_name.lower()


def run(args) -> list[Result]:
    from nndf.architectures import architecture
    from nndf.continuous import ContinuousBatcher
    from nndf.registry import resolve
    from nndf.triton.generative import check_serving, write_generative_repository
    from nndf.triton.repository import config_schema, explicit_load_flags, serve_command, stray_folders
    from nndf.triton.validate import validate_config

    served = list(dict.fromkeys(args.backends))
    if len(served) != 1 or split_backend(served[0])[0] != "onnxrt":
        raise UsageError("triton serves one backend, onnxrt (its exported graph, on the CPU or on CUDA with "
                         "onnxruntime-gpu): name only onnxrt, onnxrt-int8 or onnxrt-int4")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    spec, variant = resolve(args.model, args.variant)
    if architecture(spec).takes_images:  # said before the load and the export, which it made first
        raise UsageError(f"triton serves text generation; {spec.family} captions images")
    name = args.name if args.name is not None else default_name(args.torch_dir, variant.name)  # -n '' is refused
    served_rows = check_serving(args.output, name, args.max_batch_size, args.nb_instances, args.scheduler,
                                args.streaming, args.max_rows, args.max_queue_delay_us, args.sampling_stream,
                                args.num_beams)  # before the load
    if args.scheduler == "continuous":
        ContinuousBatcher.check_architecture(spec.family, architecture(spec), args.use_cache)
    # tritonclient missing is said after every flag (a usage error is the first thing to fix), before the load
    model = open_models(args, needs_text=True, new_tokens_flag="--max-new-tokens", before_load=config_schema,
                        info_rows=served_rows)[0]
    folders = write_generative_repository(args.output, name, model, args.max_batch_size, args.nb_instances,
                                          max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
                                          scheduler=args.scheduler, streaming=args.streaming,
                                          max_rows=args.max_rows, queue_delay_us=args.max_queue_delay_us,
                                          sampling_stream=args.sampling_stream)
    for folder in folders:
        validate_config(folder / "config.pbtxt")
    rows = [{"model": folder.name, "folder": str(folder), "graph": model.artifacts[-1]} for folder in folders]
    columns = [Column("model", "Triton model"), Column("folder", "folder"), Column("graph", "decoder graph")]
    serve = serve_command(args.output)
    strays = stray_folders(args.output)
    if strays:  # said by the write; the command to serve it must not be one that fails
        serve += (f" {explicit_load_flags(args.output)} (or move "
                  f"{', '.join(p.name for p in strays)} out: folders that are not models stop a server's start)")
    notes = [f"serve it: {serve} (its Python needs nndf[onnxruntime]); "
             f"query it with inputs TEXT (and MAX_NEW_TOKENS, MIN_NEW_TOKENS, NUM_BEAMS, DO_SAMPLE, TEMPERATURE, "
             f"TOP_K, TOP_P, SEED, REPETITION_PENALTY, STOP), output GENERATED; scheduler {args.scheduler}"]
    if args.streaming:
        notes.append(f"{name}_stream streams each new piece of text (gRPC stream_infer; a final empty response "
                     f"flagged complete)")
    return [Result("triton", f"triton {model.spec.family} {model.loaded.name}", columns, rows, describe(model),
                   notes)]
