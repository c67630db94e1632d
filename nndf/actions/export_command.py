"""The `export` command that writes, on any machine, the ONNX files a TensorRT build reads.

Why a module of its own: `--info` on trt where no GPU is (nndf.actions.common) and `export ... trt` refused there
(nndf.actions.export) both point the user at it, and `export` takes only some of a run's flags (it refuses the
engine-only ones and --fp16's engine precision), so "the same flags" is not a command a user can paste.
"""

from __future__ import annotations

import shlex

from nndf.architectures import architecture


def onnx_export_argv(args, spec) -> list[str]:
    """`export FAMILY onnxrt ...` with the flags that shape the graph a TensorRT build of `args` reads, and no other:
    the weights (--variant, --torch-dir, --random-weights with its --weights-seed), the working dir the engines are built
    in, the cache, and --kv-layout growing where a decoder-only graph has a cache (TensorRT has no ONNX Runtime
    contrib ops, so it reads the growing layout; a cache-less graph has no layout, an encoder-decoder its own)."""
    argv = ["export", spec.family, "onnxrt"]
    if args.variant:
        argv += ["--variant", args.variant]
    if args.torch_dir:
        argv += ["--torch-dir", str(args.torch_dir)]
    if args.random_weights:
        argv.append("--random-weights")
        if args.weights_seed:
            argv += ["--weights-seed", str(args.weights_seed)]
    argv += ["--working-dir", str(args.working_dir)]
    if not args.use_cache:
        argv.append("--no-use-cache")
    elif not architecture(spec).has_encoder:
        argv += ["--kv-layout", "growing"]
    return argv


def onnx_export_command(args, spec) -> str:
    """`onnx_export_argv` as a line to paste into a shell."""
    return shlex.join(["python", "run.py", *onnx_export_argv(args, spec)])
