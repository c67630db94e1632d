"""`evaluate`: lm-evaluation-harness tasks on each backend through our loop, lm-eval's own table per backend, then
each metric's difference from the first backend (what int8 or int4 weights cost in the figures people quote).

    python run.py evaluate GPT2 frameworks onnxrt onnxrt-int8 --tasks lambada_openai \\
        --dataset-file lambada_test.jsonl

Each backend runs `lm_eval.simple_evaluate` once with `nndf.lm_eval.NndfLM` over it; lm-eval itself, the task
names and every other flag are checked before the tasks' data is read, and that before any model loads
(nndf.lm_eval_tasks, `open_models`' before_load). lm-eval's progress and its bootstrap
messages go to stderr, so stdout holds the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from nndf.errors import HarnessError, UsageError
from nndf.interrupt import KeepOnInterrupt
from nndf.results import Column, Result

DEFAULT_BATCH_SIZE = 16
BATCH_HELP = ("loglikelihood requests per forward pass (requests of one length together, so the figures equal "
              "those of one request at a time) and generation requests per batch (equal context lengths)")
EXTRA = "eval"  # the optional dependency that brings lm-eval
UNUSED_FLAGS = {  # nndf.cli.check_unused_flags
    "num_beams": "lm-eval's generation requests decode greedily, as its hf model does (the task's own settings)",
    "input_seq_len": "the task's requests set their own lengths (contexts are cut to the model's positions)",
    "output_seq_len": "generation requests take the task's own limit, else --max-gen-toks",
    "use_mask": "it always feeds a mask",
}


def add_arguments(parser) -> None:
    e = parser.add_argument_group("evaluate (lm-evaluation-harness)")
    e.add_argument("--tasks", required=True, metavar="T1,T2",
                   help="lm-eval tasks, groups or tags separated by commas, e.g. lambada_openai,hellaswag")
    e.add_argument("--limit", type=_limit, metavar="N",
                   help="at most N documents per task (below 1: that share of them), as lm-eval's --limit")
    e.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (default: the task's)")
    e.add_argument("--include-path", nargs="+", action="extend", metavar="DIR",
                   help="folders of lm-eval task YAML files, as lm-eval's --include_path (e.g. tasks reading local "
                   "data: dataset_path: json, dataset_kwargs: {data_files: {test: FILE}})")
    e.add_argument("--dataset-file", nargs="+", action="extend", metavar="[TASK=]FILE", dest="task_files",
                   help="the task (TASK= may be left out when one task is given) reads this local json/jsonl, csv or "
                   "parquet file as the split it evaluates instead of its hub data set; prompts and metrics stay "
                   "lm-eval's (e.g. lambada_openai=../shared/data/lambada/lambada_test.jsonl)")
    e.add_argument("--max-gen-toks", type=int, default=256,
                   help="most new tokens of a generation task's answer unless the task sets its own (default 256, "
                   "as lm-eval's hf model)")
    e.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="bootstrap resamples for the stderr of metrics without a closed form, e.g. perplexity; 0 "
                   "skips stderr (default 100000, as lm-eval)")


LIMIT_TAKES = "a number of documents per task (e.g. 200) or a share of them below 1 (e.g. 0.1)"


def _limit(text: str) -> int | float:
    """--limit's value as lm-eval takes it (a whole count, or a share below 1). argparse says an
    ArgumentTypeError's own sentence; a ValueError would show this function's name instead. NaN and infinity pass
    float() but would stop lm-eval after the models load."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # 2.5 is neither: lm-eval would take 2 documents while the results said 2.5
    if not math.isfinite(value) or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError(f"{LIMIT_TAKES}, not '{text}'")
    return int(value) if value >= 1 else value


def require_lm_eval():
    """lm-eval itself, or the sentence that says how to install it (before any model loads)."""
    try:
        import lm_eval
        import lm_eval.evaluator  # noqa: F401 - simple_evaluate
    except ImportError as exc:
        raise UsageError(f"evaluate needs lm-evaluation-harness, which is not installed ({exc.msg}); install the "
                         f"'{EXTRA}' extra: pip install -e \".[{EXTRA}]\" (lm-eval 0.4.13)") from exc
    return lm_eval


@contextlib.contextmanager
def _bootstrap_in_process():
    """lm-eval's bootstrap for stderr runs in this process (its DISABLE_MULTIPROC), with the same seeds and figures
    as its worker pool: forking a process that holds ONNX Runtime sessions or a CUDA context is unsafe, and the
    forked workers would inherit the CLI's SIGTERM handler."""
    previous = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = previous


@contextlib.contextmanager
def _quiet_git_hash():
    """lm-eval records the git commit of the working folder (`git describe --always`, its results' `git_hash`); run
    from a folder outside any repository, git printed "fatal: not a git repository ..." on stderr in the middle of a
    run that went well. The same hash, with git's own complaint left out."""
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_hash():
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):  # not a repository; git not installed
            return get_commit_from_path(os.getcwd())

    previous = getattr(lm_eval.evaluator, "get_git_commit_hash", None)
    if previous is None:  # another lm-eval, which asks no git (or otherwise): nothing to quiet
        yield
        return
    lm_eval.evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = previous


# simple_evaluate's seeds, which lm-eval's own `--seed N` sets all to N (its defaults: 0, 1234, 1234, 1234); numpy's
# takes no more than 32 bits
LM_EVAL_SEEDS = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")


def lm_eval_seeds(seed: int | None) -> dict:
    """--seed as lm-eval's own `--seed N`: every seed of `simple_evaluate` (few-shot examples, the bootstrap) is N;
    without it, lm-eval's defaults."""
    return {} if seed is None else dict.fromkeys(LM_EVAL_SEEDS, seed)


def _check_flags(args) -> None:
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed seeds lm-eval's numpy generator too, which takes 0 to 2**32 - 1; got {args.seed}")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit must be positive, got {args.limit:g}")  # 0, not the 0.0 `_limit` made of it
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UsageError(f"--num-fewshot must be 0 or more, got {args.num_fewshot}")
    if args.max_gen_toks < 1:
        raise UsageError(f"--max-gen-toks must be at least 1, got {args.max_gen_toks}")
    if args.bootstrap_iters < 0:
        raise UsageError(f"--bootstrap-iters must be 0 or more, got {args.bootstrap_iters}")


def check_generation_room(generation: dict[str, int | None], max_gen_toks: int, positions: int | None) -> None:
    """A decoder-only model's context and answer share its positions (lm-eval's hf model cuts the context to
    positions - max_gen_toks): new tokens that fill them all left no context, which NndfLM said only after the
    load and the exports, as 'max_gen_toks 256', the default the user never typed."""
    from nndf.lm_eval import DEFAULT_MAX_GEN_TOKS

    if positions is None:  # an encoder-decoder model's answer has the decoder's positions to itself
        return
    for name, own in generation.items():
        if own is not None and own >= positions:
            raise HarnessError(f"lm-eval task {name} sets max_gen_toks {own}, which leaves no position for its context "
                               f"in this model's {positions} positions: evaluate it with a model of more positions")
        if own is None and max_gen_toks >= positions:
            default = " (its default)" if max_gen_toks == DEFAULT_MAX_GEN_TOKS else ""
            raise UsageError(f"--max-gen-toks {max_gen_toks}{default}, the new tokens of lm-eval task {name}'s "
                             f"answers, leaves no position for their context in this model's {positions} positions; "
                             f"give less than {positions}")


def run(args) -> list[Result]:
    lm_eval = require_lm_eval()
    from nndf.actions.common import describe, label, open_models, say
    from nndf.architectures import architecture
    from nndf.lm_eval import NndfLM, check_text_family
    from nndf.lm_eval_tasks import check_tasks, load_task_data
    from nndf.registry import resolve

    _check_flags(args)
    spec = resolve(args.model, args.variant)[0]
    check_text_family(spec)

    def evaluate(model) -> tuple:  # one backend's lm-eval run (tasks and models are set below, before it runs)
        say(f"evaluating {', '.join(tasks.names)} on {label(model)} ({models.index(model) + 1} of {len(models)})")
        lm = NndfLM(model, batch_size=args.batch_size, max_gen_toks=args.max_gen_toks)
        started = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr), _bootstrap_in_process(), _quiet_git_hash():  # lm-eval's progress
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks.specs, task_manager=tasks.manager,
                                          num_fewshot=args.num_fewshot, limit=args.limit,
                                          batch_size=args.batch_size, bootstrap_iters=args.bootstrap_iters,
                                          log_samples=False, **lm_eval_seeds(args.seed))
        return model, out, time.perf_counter() - started

    positions = {}  # a decoder-only model's, from its config before the load (open_models' check_inputs)

    def before_load() -> None:  # the tasks' data, then their answers' new tokens against the model's positions
        load_task_data(tasks)
        check_generation_room(tasks.generation, args.max_gen_toks, positions.get("causal"))

    keep = KeepOnInterrupt()
    with tempfile.TemporaryDirectory(prefix="nndf-tasks-") as folder:
        tasks = check_tasks(args.tasks, args.task_files, args.include_path, folder, args.working_dir)
        models = open_models(args, needs_text=True, before_load=before_load,
                             check_inputs=lambda loaded, shapes: positions.update(
                                 causal=shapes.max_positions if architecture(spec).lm_eval_backend == "causal"
                                 else None))
        runs = keep.each(models, "evaluating", "not evaluated", evaluate, name=label)
    context = dict(describe(*models), tasks=tasks.names, limit=args.limit, num_fewshot=args.num_fewshot,
                   seed=args.seed, dataset_files=args.task_files, include_path=args.include_path)
    results = [backend_table(model, out, seconds, context) for model, out, seconds in runs]
    if len(runs) > 1:
        results.append(difference_table([label(m) for m, _, _ in runs], [out for _, out, _ in runs], models[0],
                                        context))
    results[-1].notes.extend(keep.notes())
    return keep.finish(results)


# --------------------------------------------------------------------------------------------------------- tables
HIGHER_IS_BETTER = {True: " ↑", False: " ↓"}  # as lm-eval's table marks them


@dataclass
class LmEvalResult(Result):
    """One backend's lm-eval results: printed as lm-eval's own table (`lm_eval.utils.make_table`), kept whole in
    the JSON (`lm_eval`: its results, configs, versions, n-shot; no per-document samples)."""

    lm_eval: dict = field(default_factory=dict)

    def render(self, verbose: bool = False, shown: dict | None = None) -> str:
        from lm_eval.utils import make_table

        lines = [self.title] + (self.context_lines(shown) if verbose else [])
        lines.append(make_table(self.lm_eval).rstrip())
        if self.lm_eval.get("groups"):
            lines.append(make_table(self.lm_eval, "groups").rstrip())
        return "\n".join(lines + list(self.notes))

    def to_dict(self) -> dict:
        return dict(super().to_dict(), lm_eval=self.lm_eval)


def _jsonable(out: dict) -> dict:
    """lm-eval's results as plain JSON, as its own CLI writes them (functions and other objects as strings)."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps({k: v for k, v in out.items() if k != "samples"}, default=handle_non_serializable))


def metric_rows(out: dict) -> list[dict]:
    """Every (task, filter, metric) of lm-eval's results as a row: value, stderr (None where lm-eval has none)."""
    rows = []
    for task in table_order(out):
        metrics, better = out["results"][task], out.get("higher_is_better", {}).get(task, {})
        for key, value in sorted(metrics.items()):
            metric, comma, filter_name = key.partition(",")
            if not comma or metric.endswith("_stderr"):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            rows.append({"task": task, "filter": filter_name, "n_shot": out.get("n-shot", {}).get(task),
                         "metric": metric + HIGHER_IS_BETTER.get(better.get(metric), ""), "value": value,
                         "stderr": stderr if _is_number(stderr) else None})
    return rows


def table_order(out: dict) -> list[str]:
    """The tasks and groups of lm-eval's results in the order its own table prints them: each group before its
    subtasks, depth first, names sorted at each level, then whatever no group holds (lm-eval's results dict has
    the groups last)."""
    results, subtasks = out["results"], out.get("group_subtasks", {})
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in results and name not in ordered:
            ordered.append(name)
        for child in sorted(subtasks.get(name, [])):
            visit(child)

    children = {child for names in subtasks.values() for child in names}
    for name in sorted(subtasks):
        if name not in children:
            visit(name)
    return ordered + sorted(name for name in results if name not in ordered)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def backend_table(model, out: dict, seconds: float, context: dict) -> LmEvalResult:
    from importlib.metadata import version

    from nndf.actions.common import label

    notes = []
    if out.get("config", {}).get("limit") is not None:
        notes.append(f"--limit {out['config']['limit']}: the first documents of each task only (lm-eval: for checks, "
                     "not for reporting).")
    title = (f"evaluate {model.spec.family} {model.loaded.name} on {label(model)}: lm-evaluation-harness "
             f"{version('lm_eval')}, {seconds:.1f} s")
    columns = [Column("task", "task"), Column("filter", "filter"), Column("n_shot", "n-shot"),
               Column("metric", "metric"), Column("value", "value", "{:.6g}"), Column("stderr", "stderr", "{:.4g}")]
    return LmEvalResult("evaluate", title, columns, metric_rows(out), dict(context, backend=label(model),
                        seconds=seconds), notes, lm_eval=_jsonable(out))


def difference_table(labels: list[str], outs: list[dict], first_model, context: dict) -> Result:
    """Each numeric metric of every backend beside the first backend's, with the difference and its share."""
    def keyed(out):
        rows = metric_rows(out)
        return {(r["task"], r["filter"], r["metric"]): r["value"] for r in rows if _is_number(r["value"])}

    base, others = keyed(outs[0]), [keyed(out) for out in outs[1:]]
    rows = []
    for (task, filter_name, metric), value in base.items():
        row = {"task": task, "metric": metric if filter_name == "none" else f"{metric} ({filter_name})", "v0": value}
        for i, other in enumerate(others, start=1):
            theirs = other.get((task, filter_name, metric))
            row[f"v{i}"] = theirs
            row[f"d{i}"] = None if theirs is None else theirs - value
            row[f"r{i}"] = None if theirs is None or value == 0 else 100 * (theirs - value) / abs(value)
        rows.append(row)
    columns = [Column("task", "task"), Column("metric", "metric"), Column("v0", labels[0], "{:.6g}")]
    for i, name in enumerate(labels[1:], start=1):
        columns += [Column(f"v{i}", name, "{:.6g}"), Column(f"d{i}", f"{name} - {labels[0]}", "{:+.4g}"),
                    Column(f"r{i}", "relative", "{:+.3g}%")]
    notes = [f"difference: the backend's value minus {labels[0]}'s on the same documents; relative: that over "
             f"{labels[0]}'s value, in percent. ↑ higher is better (a negative difference is what the backend "
             "costs), ↓ lower is better (a positive one is)."]
    title = f"evaluate {first_model.spec.family} {first_model.loaded.name}: each metric against {labels[0]}"
    return Result("evaluate", title, columns, rows, context, notes)
