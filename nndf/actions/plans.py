"""What this machine lacks for a run (the trt backend's GPU and TensorRT, a CUDA GPU for --cuda-graph), checked
after every usage error, and what `--info` prints where it is lacking: the plan a GPU machine would build and run.

Why an order: a wrong flag (a length past the model's positions, a backend the family lacks) is the user's to fix
wherever they type the command, a missing GPU only by moving to another machine. Said the other way round, a user
preparing a GPU run on a laptop learns of the wrong flag only on the GPU machine. So `open_models` checks every flag
first (exit 2) and this machine last (`check_machine`), just before the weights load; with `--info` the plan is
printed before the refusal, so that a build can be prepared where it cannot run.
"""

from __future__ import annotations

from nndf.architectures import architecture
from nndf.backends import BackendOptions, backend_module
from nndf.errors import HarnessError, UsageError
from nndf.loading import load_model
from nndf.model import default_device
from nndf.results import Column, Result
from nndf.spec import BuildSettings, ShapeSpec

CUDA_GRAPH_NEEDS_GPU = "--cuda-graph replays decode steps on a CUDA GPU, and none is visible to PyTorch here"
CUDA_GRAPH_NOTE = ("--cuda-graph: decode steps replayed as CUDA graphs, which need a "
                   "CUDA GPU, and none is visible here, so this is the plan for a GPU machine")


def check_machine(args, spec, variant, backends: list[str], settings: BuildSettings, options: BackendOptions,
                  shapes: ShapeSpec) -> None:
    """Refuse what this machine cannot run, after the flags are checked: a backend's `check_settings` (settings it
    refuses here, before a tokenizer, a load or an export could fail first), then its own `check_available` (trt:
    a GPU and TensorRT), then --cuda-graph without a CUDA GPU. With --info, each refused backend's plan is printed
    first (trt: its engines' profiles and trtexec commands; frameworks with --cuda-graph: its static-cache tensors)
    and the first refusal follows."""
    for name in backends:  # settings a backend refuses on this machine (onnxrt's --fp16 on the CPU): usage errors
        check = getattr(backend_module(name), "check_settings", None)
        if check is not None:
            check(settings, options)
    refused: list[tuple[str, Exception]] = []
    for name in backends:
        check = getattr(backend_module(name), "check_available", None)
        if check is not None:
            try:
                check()
            except HarnessError as exc:
                refused.append((name, exc))
    if options.cuda_graph and default_device().type != "cuda":  # each plan says so; a refused trt's already
        refused += [(name, UsageError(CUDA_GRAPH_NEEDS_GPU)) for name in ("frameworks", "trt")
                    if name in backends and name not in {done for done, _ in refused}]
    if not refused:
        return
    if getattr(args, "info", False):  # show what would be built and run, then refuse
        for name, _ in refused:
            plan = engine_plan_result if name == "trt" else static_plan_result
            print(plan(args, spec, variant, name, settings, options).render(verbose=True))
            print()
    raise refused[0][1]


def _plan_model(args, spec, variant):
    """The model as the plans read it: its config and names, no weights (`load_model` loads them on first use)."""
    return load_model(spec, variant, torch_dir=args.torch_dir, random_weights=args.random_weights,
                      tokenizer_dir=args.tokenizer_dir, seed=args.weights_seed)


def engine_plan_result(args, spec, variant, backend: str, settings: BuildSettings, options: BackendOptions) -> Result:
    """`--info` where the trt backend cannot run: the settings, each graph's profiles and its trtexec command, from
    the config alone (no weights, no GPU), so that a build can be prepared on this machine."""
    from nndf.actions.export_command import onnx_export_command
    from nndf.backends.trt.plan import engine_plan

    loaded = _plan_model(args, spec, variant)
    rows = engine_plan(loaded, settings, options)
    columns = [Column("graph", "graph"), Column("onnx", "ONNX file"), Column("profiles", "profiles")]
    context = {"model": spec.family, "variant": loaded.name, "weights": loaded.source,
               "settings": settings.as_dict()}
    notes = [f"{row['graph']}: {row['trtexec']}" + (f" ({row.pop('pending')})" if "pending" in row else "")
             for row in rows]
    if options.cuda_graph:
        notes.append(CUDA_GRAPH_NOTE)
    notes.append("These engines need a GPU with TensorRT. Engine files are named here after their graph; the "
                 "backend's own names also hash the GPU they are built on. The ONNX files they read are written on "
                 f"any machine by: {onnx_export_command(args, spec)}")
    return Result("info", f"{spec.family} {loaded.name}: the {backend} engines these settings build", columns, rows,
                  context, notes)


def shapes_result(title: str, shapes: ShapeSpec, context: dict, notes: list[str], fp16: bool) -> Result:
    """`--info`'s table: every decoder tensor's shape from the one ShapeSpec, and the KV cache's size."""
    rows = [{"tensor": name, "shape": shape} for name, shape in shapes.describe()]
    if shapes.use_cache:
        notes = [*notes, shapes.kv_cache_note(2 if fp16 else 4)]
    return Result(action="info", title=title, columns=[Column("tensor", "tensor"), Column("shape", "shape")],
                  rows=rows, context=context, notes=notes)


def static_plan_result(args, spec, variant, backend: str, settings: BuildSettings,
                       options: BackendOptions) -> Result:
    """`--info` for --cuda-graph where no CUDA GPU is: the tensors of the static-cache steps a GPU would replay."""
    loaded = _plan_model(args, spec, variant)
    shapes = architecture(spec).derive_shapes(settings, spec, loaded.config)
    context = {"model": spec.family, "variant": loaded.name, "weights": loaded.source, "backend": backend,
               "settings": settings.as_dict()}
    notes = [f"static KV cache of {shapes.total.max} positions per row", CUDA_GRAPH_NOTE]
    return shapes_result(f"{spec.family} {loaded.name}: the {backend} steps these settings run", shapes, context,
                         notes, settings.fp16)
