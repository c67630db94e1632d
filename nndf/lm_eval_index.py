"""lm-eval's task index for `evaluate`: lm-eval's TaskManager over its own task files and a user's folders, built
once per process and kept pickled in the working dir (indexing lm-eval's 15000 task files takes 12 s here)."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import pickle
import time
from pathlib import Path

from nndf.progress import say, ticking
from nndf.workspace import artifact_lock, artifact_name, file_stale_reason, write_artifact


# The folders lm-eval's index skips (lm_eval.tasks._index._IGNORE_DIRS).
_SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def _task_files_digest(roots: list[Path]) -> str:
    """A digest of every task YAML's path, size and modification time under `roots`: what the index is built from,
    so a cached index whose digest differs is stale (0.4 s for lm-eval's 14000 files here, against 12 s to index)."""
    digest = hashlib.sha256()
    for root in roots:
        digest.update(f"{root}\n".encode())
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if d not in _SKIPPED_DIRS)
            for name in sorted(f for f in files if f.endswith(".yaml")):
                stat = os.stat(os.path.join(folder, name))
                digest.update(f"{os.path.relpath(os.path.join(folder, name), root)}\0{stat.st_size}\0"
                              f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _read_index(path: Path, metadata: dict):
    """The TaskManager pickled at `path`, when its metadata matches and it loads; else None (then it is rebuilt)."""
    from lm_eval.tasks import TaskManager

    if file_stale_reason(path, metadata) is not None:
        return None
    try:
        with open(path, "rb") as file:
            manager = pickle.load(file)
    except Exception:  # an index pickled by another lm-eval or Python: rebuilt, as any stale artifact
        return None
    return manager if isinstance(manager, TaskManager) else None


def defaults_root() -> Path:
    """The folder of lm-eval's own task files."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _with_included(defaults, include_paths: tuple[str, ...]):
    """`defaults` (lm-eval's own tasks) with the tasks of `include_paths`, each folder's overriding the ones before,
    as lm-eval's TaskManager merges its folders: only those folders are indexed here (a user's few files), so an
    edited task file costs milliseconds, not the 12 s of lm-eval's 15000. The fields set are those TaskManager's
    own __init__ sets from its index (lm-eval is pinned: `pyproject.toml`)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    included = TaskManager(include_path=list(include_paths), include_defaults=False, metadata=defaults.metadata)
    merged = copy.copy(defaults)
    merged.include_path = list(include_paths)
    merged._index = {**defaults.task_index, **included.task_index}
    kinds: dict = {}
    for name, entry in merged._index.items():
        kinds.setdefault(entry.kind, []).append(name)
    merged._all_tasks = sorted(merged._index)
    merged._all_subtasks = sorted(kinds.get(Kind.TASK, []) + kinds.get(Kind.PY_TASK, []))
    merged._all_groups = sorted(kinds.get(Kind.GROUP, []))
    merged._all_tags = sorted(kinds.get(Kind.TAG, []))
    return merged


@functools.lru_cache(maxsize=4)
def task_manager(include_paths: tuple[str, ...] = (), cache_dir: str | None = None):
    """lm-eval's TaskManager over its own tasks and `include_paths`.

    Indexing lm-eval's 15000 task files takes 12 s on the 2-core development machine, so a process builds that
    index once, says so, and with `cache_dir` (the working dir, as the exports) keeps it there pickled for the next
    run: reused while lm-eval's version and every one of its task files' size and time are those it was built from
    (about 1.4 s to check and load). The folders of `include_paths` are indexed afresh each time (`_with_included`),
    so that editing one's own tasks never re-indexes lm-eval's. The pickle is read only from the working dir the
    user names, as the rest of their artifacts."""
    if include_paths:
        return _with_included(task_manager((), cache_dir), include_paths)
    import lm_eval
    from lm_eval.tasks import TaskManager

    path = metadata = None
    if cache_dir is not None:
        named = {"lm_eval": lm_eval.__version__}
        path = Path(cache_dir) / artifact_name("lm-eval-task-index", named, ".pickle")  # rewritten when stale
        metadata = dict(named, task_files=_task_files_digest([defaults_root()]))
    with contextlib.ExitStack() as stack:
        try:
            if path is not None:
                stack.enter_context(artifact_lock(path, say))
        except OSError as exc:  # a working dir that cannot be written: this run goes on without keeping the index
            say(f"cannot keep lm-eval's task index in {cache_dir} ({exc.strerror or exc})")
            path = None
        manager = _read_index(path, metadata) if path is not None else None
        if manager is not None:
            return manager
        say("indexing lm-eval's task files ...")
        started = time.perf_counter()
        with ticking("indexing lm-eval's task files"):
            manager = TaskManager()
        say(f"indexed {len(manager.all_tasks)} tasks, groups and tags in {time.perf_counter() - started:.1f} s")
        if path is not None:
            try:
                write_artifact(path, lambda tmp: tmp.write_bytes(pickle.dumps(manager)), metadata)
            except OSError as exc:
                say(f"cannot keep lm-eval's task index in {cache_dir} ({exc.strerror or exc})")
    return manager
