"""lm-evaluation-harness tasks for `evaluate`: names checked, local data files put in place of the hub's, and a task
whose data cannot be had said in one sentence, all before any model loads.

lm-eval's tasks name a data set on the Hugging Face hub (`lambada_openai` reads `EleutherAI/lambada_openai`).
Offline, a task reads local files in one of two ways, both lm-eval's own:

- `--include-path DIR`: a folder of task YAML files, as lm-eval's `--include_path` (a file there can `include:`
  a task's YAML and set `dataset_path: json` with `dataset_kwargs: {data_files: {test: FILE}}`);
- `--dataset-file [TASK=]FILE`: that YAML written for the user: a task that includes the named task's own YAML
  (prompts, metrics, filters unchanged) and reads FILE (json/jsonl, csv or parquet) as the split the task evaluates
  (its test split, else its validation split). Few-shot examples then come from the same file, as lm-eval does for
  a task with no other split.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from nndf.errors import HarnessError, UsageError
from nndf.lm_eval_index import task_manager

# Local data files by suffix -> the `datasets` builder that reads them.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# `datasets` builders that read local files (a task with one of these needs no hub).
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder"}
# huggingface_hub's and datasets' names for "the hub did not answer" (besides ConnectionError).
HUB_FAILURES = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError"}
DATASET_FILE_HINT = ("give the data as a local file with --dataset-file TASK=FILE (json/jsonl, csv or parquet; e.g. "
                     "lambada_openai=lambada_test.jsonl) or a task folder with --include-path DIR whose YAML reads "
                     "local files (dataset_path: json, dataset_kwargs: {data_files: ...})")


UNSET = -1  # max_gen_toks as lm-eval normalises a task's generation_kwargs that set none (no task sets -1)


@dataclass
class Tasks:
    """What `lm_eval.simple_evaluate` takes: the task manager and one spec per task (a name, or the path of a YAML
    written here that points the task at a local file), and the --dataset-file of each task given one."""

    manager: object
    specs: list[str]
    names: list[str]
    files: dict[str, Path] = field(default_factory=dict)
    # each generate_until task (a group's too, by its own name) and the max_gen_toks it sets (None: --max-gen-toks
    # decides), known once `load_task_data` has built the tasks
    generation: dict[str, int | None] = field(default_factory=dict)


def parse_task_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UsageError("--tasks names no task; give lm-eval task names separated by commas, e.g. lambada_openai")
    return list(dict.fromkeys(names))


def _dataset_files(values: list[str] | None, names: list[str]) -> dict[str, Path]:
    """--dataset-file values as {task: file}; a value without TASK= belongs to the only task given."""
    files: dict[str, Path] = {}
    for value in values or []:
        task, sep, path = value.rpartition("=")
        if not sep:
            if len(names) != 1:
                raise UsageError(f"--dataset-file {value} does not say which of the tasks {', '.join(names)} reads "
                                 "it; write it as TASK=FILE")
            task = names[0]
        if task not in names:
            raise UsageError(f"--dataset-file names task '{task}', which is not among --tasks ({', '.join(names)})")
        if task in files:  # the last would win unsaid: the user meant one of them
            raise UsageError(f"--dataset-file gives task '{task}' a second file ({files[task]}, then {path}); a task "
                             "reads one file: give one --dataset-file per task")
        if not path.strip():  # "--dataset-file lambada_openai=:  is not a file"
            raise UsageError(f"--dataset-file {value!r} names no file; write it as [TASK=]FILE")
        file = Path(path)
        if not file.is_file():
            raise UsageError(f"--dataset-file {value}: {path} is not a file")
        if file.suffix.lower() not in FILE_BUILDERS:
            raise UsageError(f"--dataset-file {value}: {file.name} is not one of the readable kinds "
                             f"({', '.join(FILE_BUILDERS)})")
        files[task] = file.resolve()
    return files


def _check_known(manager, names: list[str]) -> None:
    for name in names:
        if name in manager.all_tasks or Path(name).is_file():
            continue
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `lm_eval ls tasks` lists them"
        raise UsageError(f"--tasks: '{name}' is not an lm-eval task, group or tag (nor a task YAML file){hint}")


def _override(manager, name: str, data_file: Path, folder: Path) -> str:
    """The path of a task YAML that includes task `name`'s own and reads `data_file` as the split it evaluates."""
    import yaml

    entry = manager.task_index.get(name)
    if entry is None:  # `_check_known` let it through as a task YAML file
        raise UsageError(f"--dataset-file applies to an lm-eval task name, and '{name}' is a task YAML file: set the "
                         "data there (dataset_path: json, dataset_kwargs: {data_files: {test: FILE}}), or give its "
                         "folder with --include-path and --tasks the task's name")
    if entry.yaml_path is None or "task" not in (entry.cfg or {}) or "group" in entry.cfg:
        raise UsageError(f"--dataset-file applies to a single task, and '{name}' is a group or tag of tasks; name "
                         "one of its tasks, or give a task folder with --include-path")
    config = entry.cfg
    split = config.get("test_split") or config.get("validation_split")
    if split is None:
        raise UsageError(f"lm-eval task '{name}' evaluates no test or validation split, so --dataset-file cannot "
                         "stand in for it; give a task folder with --include-path")
    override = {"include": str(Path(entry.yaml_path).resolve()),
                "dataset_path": FILE_BUILDERS[data_file.suffix.lower()], "dataset_name": None,
                "dataset_kwargs": {"data_files": {split: str(data_file)}}}
    for key in ("training_split", "validation_split", "test_split", "fewshot_split"):
        if config.get(key) is not None and config.get(key) != split:
            override[key] = None  # only the given file exists now
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(override, sort_keys=False), encoding="utf-8")
    return str(path)


def template_fields(config: dict) -> set[str]:
    """The document fields a task's Jinja prompts read (doc_to_text, doc_to_target, doc_to_choice); none when the
    task first rewrites its documents (`process_docs`: its prompts read the rewritten ones, not the file's)."""
    import jinja2
    from jinja2 import meta

    if config.get("process_docs") is not None:
        return set()
    environment = jinja2.Environment()
    fields: set[str] = set()
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        template = config.get(key)
        if isinstance(template, str) and ("{{" in template or "{%" in template):
            try:
                fields |= meta.find_undeclared_variables(environment.parse(template))
            except jinja2.TemplateSyntaxError:
                continue  # lm-eval says what is wrong with its own template when it loads the task
    return fields - set(environment.globals)  # range, dict, ...: Jinja's own names, not the document's


def _columns(data_file: Path, hint: str) -> list[tuple[str, set[str]]]:
    """(where, fields) of each row of a local data file, read as cheaply as its kind allows; a json/jsonl file is
    checked line by line (`nndf.lambada.read_jsonl_records`), so that a line lm-eval could not read is named."""
    from nndf.lambada import read_jsonl_records

    if data_file.stat().st_size == 0:
        raise UsageError(f"dataset file {data_file} is empty; {hint}")
    kind = FILE_BUILDERS[data_file.suffix.lower()]
    if kind == "csv":
        import csv

        with open(data_file, newline="", encoding="utf-8", errors="replace") as file:
            header = next(csv.reader(file), [])
        return [(f"dataset file {data_file} (its header row)", set(header))]
    if kind != "json":
        return []  # parquet: its reader says what is wrong
    if data_file.suffix.lower() == ".json":
        import json

        try:
            whole = json.loads(data_file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            whole = None  # JSON lines in a .json file, as `datasets` reads them too
        if isinstance(whole, list):
            return [(f"dataset file {data_file} item {n}", set(row) if isinstance(row, dict) else set())
                    for n, row in enumerate(whole, start=1)]
        if whole is not None:
            return []  # an object of columns: `datasets` reads it (or says why not)
    return [(f"dataset file {data_file} line {n}", set(row)) for n, row in read_jsonl_records(data_file, hint)]


def check_data_file(manager, name: str, data_file: Path) -> None:
    """The --dataset-file of task `name`, before any model loads: a file with no rows, a line that is not a JSON
    object, or a row without a field the task's prompts read is one sentence naming the file, line and field
    (lm-eval itself would stop with a bare StopIteration or KeyError, after the index and data loading)."""
    config = manager.task_index[name].cfg or {}
    fields = template_fields(config)
    hint = (f"lm-eval task {name}'s prompts read the field(s) {', '.join(sorted(fields))} of each row" if fields
            else f"give one JSON object per row, with the fields lm-eval task {name} reads")
    rows = _columns(data_file, hint)
    for where, present in rows:
        missing = sorted(fields - present)
        if missing:
            raise UsageError(f"{where} has no \"{missing[0]}\" field, which lm-eval task {name}'s prompt reads "
                             f"({', '.join(sorted(fields))})")


def _hub_path(manager, spec: str) -> str | None:
    """The hub data set a task reads (None: local files, or not a single task)."""
    entry = manager.task_index.get(spec)
    config = (entry.cfg or {}) if entry is not None else {}
    path = config.get("dataset_path")
    if not isinstance(path, str) or path in LOCAL_BUILDERS or Path(path).exists():
        return None
    return path


def _member_tasks(manager, spec: str, seen: set[str] | None = None) -> list[str]:
    """The single tasks a group or tag runs, nested groups and tags opened, in its own order (a task: itself)."""
    seen = set() if seen is None else seen
    entry = manager.task_index.get(spec)
    if entry is None or spec in seen:
        return []
    seen.add(spec)
    if entry.cfg is not None and "group" not in entry.cfg:
        return [spec]
    members = sorted(entry.tags) if entry.cfg is None else entry.cfg.get("task", [])
    members = [members] if isinstance(members, str) else members
    return [task for member in members if isinstance(member, str) for task in _member_tasks(manager, member, seen)]


def _offline_error(manager, spec: str, name: str, exc: BaseException) -> HarnessError | None:
    """The one sentence for a task, group or tag whose data set is on the hub that did not answer, with how to give
    local files; for a group or tag, the task of it that failed (the one its error names, else the first reading the
    hub), and to name its tasks (a group takes no --dataset-file itself). None: no hub data set is involved."""
    why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") else "offline?"
    hub = _hub_path(manager, spec)
    if hub is not None:
        return HarnessError(f"lm-eval task {name} reads its data set {hub} from the Hugging Face hub, which cannot be "
                            f"reached ({why}); {DATASET_FILE_HINT}")
    members = _member_tasks(manager, spec)
    hubs = {task: path for task in members if (path := _hub_path(manager, task)) is not None}
    if not hubs:
        return None
    text = " ".join(str(error) for error in _chain(exc))
    task = next((task for task, path in hubs.items() if path in text), next(iter(hubs)))
    kind = "group" if manager.task_index[spec].cfg is not None else "tag"
    shown = ", ".join(members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
    return HarnessError(f"lm-eval {kind} {name} runs task {task}, whose data set {hubs[task]} is on the Hugging "
                        f"Face hub, which cannot be reached ({why}); name its tasks ({shown}) in --tasks and "
                        "give each a local file with --dataset-file TASK=FILE (json/jsonl, csv or parquet), or give "
                        "a task folder with --include-path DIR whose YAML reads local files")


def _chain(exc: BaseException | None):
    """An exception and its causes and contexts, outermost first."""
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _unreachable(exc: BaseException) -> bool:
    """Whether a failure is the hub not answering (offline, no network) rather than a broken task or file."""
    return any(isinstance(error, ConnectionError) or type(error).__name__ in HUB_FAILURES for error in _chain(exc))


def _check_loads(manager, specs: list[str], names: list[str], files: dict[str, Path]) -> dict[str, int | None]:
    """Build each task once (lm-eval loads its data then), so that a missing data set or a sampled generation task
    fails before a model loads; a task that cannot read the --dataset-file given for it says so, rather than
    advising to give one. Returns each generation task's own max_gen_toks (None where it sets none)."""
    from nndf.lm_eval import greedy_settings

    generation: dict[str, int | None] = {}
    for spec, name in zip(specs, names):
        try:
            loaded = manager.load([spec])
        except Exception as exc:  # lm-eval and `datasets` raise many kinds; each is told in one sentence
            offline = _offline_error(manager, spec, name, exc) if _unreachable(exc) else None
            if offline is not None:
                raise offline from exc
            reason = " ".join(str(exc).split()) or type(exc).__name__
            if name in files:
                raise UsageError(f"lm-eval task {name} could not read --dataset-file {files[name]} ({reason[:300]}); "
                                 "check that its rows have the fields the task's prompts read") from exc
            raise HarnessError(f"lm-eval task {name} could not be loaded ({reason[:300]}); check its YAML and data "
                               f"files, or {DATASET_FILE_HINT}") from exc
        for task_name, task in loaded["tasks"].items():  # a group's too: sampling is refused before a model loads
            if task.OUTPUT_TYPE == "generate_until":
                own = greedy_settings(task.config.generation_kwargs or {}, UNSET, task=f"lm-eval task {task_name}")
                generation[task_name] = None if own["max_gen_toks"] == UNSET else own["max_gen_toks"]
    return generation


def prepare_tasks(task_names: str, dataset_files: list[str] | None, include_paths: list[str] | None,
                  folder: Path, cache_dir: str | Path | None = None) -> Tasks:
    """`check_tasks`, then `load_task_data`: the tasks ready for `lm_eval.simple_evaluate`."""
    tasks = check_tasks(task_names, dataset_files, include_paths, folder, cache_dir)
    load_task_data(tasks)
    return tasks


def check_tasks(task_names: str, dataset_files: list[str] | None, include_paths: list[str] | None,
                folder: Path, cache_dir: str | Path | None = None) -> Tasks:
    """The tasks of `--tasks`, local files of `--dataset-file` put in place (YAML written into `folder`, which must
    outlive the evaluation), with no data read: every name and flag is checked, so that `evaluate` says a typo
    before a data set fails (`load_task_data`, after the model flags and this machine). `cache_dir` keeps lm-eval's
    task index between runs (`task_manager`)."""
    names = parse_task_names(task_names)
    for path in include_paths or []:
        if not str(path).strip():  # Path("") is the current folder, which lm-eval then indexed for task files
            raise UsageError("--include-path is empty; it takes a folder of lm-eval task YAML files")
        if not Path(path).is_dir():
            raise UsageError(f"--include-path {path} is not a folder; it takes a folder of lm-eval task YAML files")
    files = _dataset_files(dataset_files, names)
    manager = task_manager(tuple(str(Path(p).resolve()) for p in include_paths or []),
                           None if cache_dir is None else str(Path(cache_dir).resolve()))
    _check_known(manager, names)
    specs = [_override(manager, name, files[name], Path(folder)) if name in files else name for name in names]
    return Tasks(manager, specs, names, files)


def load_task_data(tasks: Tasks) -> None:
    """Each --dataset-file's rows checked, then every task loaded once (lm-eval reads its data then), so that a file
    lm-eval could not read or a data set the hub does not give fails in one sentence before a model loads."""
    for name, data_file in tasks.files.items():
        check_data_file(tasks.manager, name, data_file)
    tasks.generation = _check_loads(tasks.manager, tasks.specs, tasks.names, tasks.files)
