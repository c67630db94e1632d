"""lm-eval's task index (`nndf.lm_eval_index`): built once, kept pickled in the working dir, rebuilt when a task
file changes, with a user's --include-path folders indexed on top of it each time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval (the eval and test extras) is absent")
from lm_eval.tasks import TaskManager  # noqa: E402


class _SmallDefaults(TaskManager):
    """lm-eval's TaskManager with a small folder (`defaults`, set by the test) standing in for lm-eval's own 15000
    task files, so that the cache test can index them several times (module level: the cache pickles it)."""

    defaults: Path | None = None

    def __init__(self, include_path=None, include_defaults=True, **kwargs):
        paths = [self.defaults] * include_defaults + list(include_path or [])
        super().__init__(include_path=paths or None, include_defaults=False, **kwargs)


def test_the_task_index_is_kept_in_the_working_dir_and_rebuilt_when_a_task_file_changes(tmp_path, monkeypatch,
                                                                                        capsys):
    """Indexing lm-eval's task files takes 12 s: a run keeps that index in its working dir, the next run loads it
    (no "indexing" line), and a changed task file of lm-eval's or a damaged index builds it again. An --include-path
    folder is indexed on top of the kept index every time, so the user's own edits never re-index lm-eval's, and
    the result is the index lm-eval builds over both."""
    import lm_eval.tasks

    import nndf.lm_eval_index
    from nndf.lm_eval_index import task_manager

    defaults, mine, work = tmp_path / "defaults", tmp_path / "mine", tmp_path / "work"
    for folder in (defaults, mine):
        folder.mkdir()
    monkeypatch.setattr(_SmallDefaults, "defaults", defaults)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", _SmallDefaults)
    monkeypatch.setattr(nndf.lm_eval_index, "defaults_root", lambda: defaults)
    task = lambda folder, name, **extra: (folder / f"{name}.yaml").write_text(
        json.dumps(dict({"task": name, "dataset_path": "json"}, **extra)))
    task(defaults, "first")
    task(mine, "own")

    def index(*include):
        task_manager.cache_clear()  # as a new process: only the working dir remembers
        manager = task_manager(tuple(str(f) for f in include), str(work))
        return manager, "indexing lm-eval's task files" in capsys.readouterr().err

    manager, indexed = index()
    assert indexed and manager.all_tasks == ["first"]
    [cached] = work.glob("lm-eval-task-index-*.pickle")
    manager, indexed = index()
    assert not indexed and manager.all_tasks == ["first"] and isinstance(manager, _SmallDefaults)

    manager, indexed = index(mine)
    assert not indexed and manager.all_tasks == ["first", "own"]
    task(mine, "first", dataset_path="csv")  # an included task of the same name overrides lm-eval's, as in lm-eval
    task(mine, "group_of_mine", group="group_of_mine", task=["own"])
    manager, indexed = index(mine)
    reference = _SmallDefaults(include_path=[mine])  # lm-eval's own index over both folders
    assert not indexed and manager.all_tasks == ["first", "group_of_mine", "own"]
    for listed in ("all_tasks", "all_subtasks", "all_groups", "all_tags"):
        assert getattr(manager, listed) == getattr(reference, listed), listed
    assert {k: e.yaml_path for k, e in manager.task_index.items()} == \
        {k: e.yaml_path for k, e in reference.task_index.items()}
    assert manager.task_index["first"].yaml_path.parent == mine
    assert index()[0].all_tasks == ["first"]  # the kept index is lm-eval's alone

    task(defaults, "second")  # lm-eval's own files changed (another version, an edit): indexed again
    manager, indexed = index()
    assert indexed and manager.all_tasks == ["first", "second"]
    assert not index()[1]
    assert list(work.glob("lm-eval-task-index-*.pickle")) == [cached]  # rewritten, not one more file
    cached.write_bytes(cached.read_bytes()[:100])  # damaged: its size no longer matches its metadata
    manager, indexed = index()
    assert indexed and manager.all_tasks == ["first", "second"]
    assert not list(work.glob(".*.tmp")) and not list(work.glob(".*.lock"))

    blocked = tmp_path / "a-file"  # a working dir that cannot be made: the index is built, and not kept
    blocked.write_text("")
    task_manager.cache_clear()
    assert task_manager((str(mine),), str(blocked / "work")).all_tasks == ["first", "group_of_mine", "own", "second"]
    assert f"cannot keep lm-eval's task index in {blocked / 'work'}" in capsys.readouterr().err
