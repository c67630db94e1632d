"""Where artifacts live and how they are written.

Every file the harness produces (results JSON, ONNX graphs, engines, timing caches) is written to a temporary
file in the same folder and renamed into place, so that an interrupted run never leaves a half-written file
under the final name. Artifacts carry a metadata JSON beside them that says what built them; `artifact_name`
hashes every setting that shaped an artifact into its name, so that changing a setting never reuses a stale file.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

from nndf.page_cache import drop_folder_from_page_cache


def _umask() -> int:
    """The process's umask (read by setting it, the only way, and setting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def name_the_place(exc: OSError, tmp: Path) -> None:
    """Give a write's OSError the temporary path it was writing when the library that failed named none (a full disk
    under a file object's `write`, as ONNX's save and `Path.write_text` meet it), so that its sentence can say where
    (`nndf.errors.storage_sentence`: the folder of that path that is left once it is removed)."""
    if exc.filename is None:
        exc.filename = str(tmp)


@contextlib.contextmanager
def atomic_path(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `final_path`; rename it into place only if the body finishes.

    The body writes to the yielded path by any means (a library's `save`, `open`, ...). On an exception the
    temporary file is removed and nothing appears under the final name.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if tmp.is_file():  # mkstemp makes it private (0600); the artifact gets the permissions of any new file
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, final)
    except OSError as exc:
        name_the_place(exc, tmp)
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(final_path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `final_path` atomically and return the path."""
    with atomic_path(final_path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(final_path)


def atomic_write_json(final_path: str | os.PathLike, data: object) -> Path:
    """Write `data` as indented JSON atomically."""
    return atomic_write_text(final_path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def settings_hash(settings: Mapping[str, object], length: int = 12) -> str:
    """A short stable hash of a flat mapping of settings (keys sorted, values by their repr)."""
    canonical = json.dumps({k: settings[k] for k in sorted(settings)}, sort_keys=True, default=repr)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:length]


def artifact_name(stem: str, settings: Mapping[str, object], suffix: str) -> str:
    """`stem-<hash of settings><suffix>`: the name changes whenever any setting that shaped the artifact does."""
    return f"{stem}-{settings_hash(settings)}{suffix}"


def metadata_path(artifact: str | os.PathLike) -> Path:
    """The metadata JSON that sits beside an artifact."""
    p = Path(artifact)
    return p.with_name(p.name + ".meta.json")


def read_metadata(artifact: str | os.PathLike) -> dict | None:
    """The artifact's metadata, or None when it is missing or unreadable (either way: rebuild)."""
    try:
        return json.loads(metadata_path(artifact).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_artifact(artifact: str | os.PathLike, build: Callable[[Path], None], metadata: Mapping[str, object]) -> Path:
    """Build an artifact through `build(tmp_path)` and publish it with its metadata, both atomically.

    The metadata is written after the artifact, so an artifact without matching metadata is never trusted.
    """
    with atomic_path(artifact) as tmp:
        build(tmp)
        meta = dict(metadata, size=tmp.stat().st_size)
    atomic_write_json(metadata_path(artifact), meta)
    return Path(artifact)


@contextlib.contextmanager
def atomic_dir(final_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside `final_dir`; it replaces `final_dir` only if the body finishes.

    For artifacts made of several files that name each other (an ONNX graph and its external weights): they are
    written under their final file names inside the temporary folder, and the folder is renamed as a whole.
    """
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        try:
            yield tmp
        except OSError as exc:
            name_the_place(exc, tmp)
            raise
        # mkdtemp makes it private (0700), which would hide exports and Triton models from other users (a shared
        # working dir, a server running as another user): it gets the permissions of any new folder
        os.chmod(tmp, 0o777 & ~_umask())
        _replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename the folder `tmp` to `final`, moving an old `final` aside first and removing it after.

    Why not remove `final`, then rename: two processes that write the same folder at once (two `triton -o` or
    `export -o` runs on one output) would remove each other's folder while it is being renamed in, or rename onto
    a folder that the other has just renamed in, and one of them failed with "Directory not empty" or a
    FileNotFoundError. Each rename here is atomic, and a rename that meets a folder moves it aside and tries again,
    so every writer succeeds and the last one's folder stays, whole. The aside folder has a temporary folder's name,
    which `sweep_leftovers` removes should the process be killed before it does."""
    while True:
        try:
            os.replace(tmp, final)  # onto nothing, or an empty folder
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            os.replace(final, aside)  # onto the empty folder just made
        except FileNotFoundError:  # another writer moved it aside first
            aside.rmdir()
            continue
        shutil.rmtree(aside)


LOCK_QUIET_WAIT_S = 1.0  # how long `artifact_lock` waits before it says that it waits


def _can_lock(lock_file: Path) -> bool:
    """Whether the lock file can be made (or opened) for writing: False in a read-only or another user's folder."""
    try:
        open(lock_file, "a").close()
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        return False
    return True


@contextlib.contextmanager
def artifact_lock(artifact: str | os.PathLike, waiting: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `artifact` (a file or folder, built or not) while checking and building it.

    Why: processes that share a working dir (two runs, a benchmark's engine workers, the test suite's workers) can
    want the same artifact at once. Without a lock both build it, and the second replaces the folder the first is
    already reading; with it the second waits, then finds the artifact built and reuses it. The lock is an advisory
    `flock` on a hidden `.NAME.lock` file beside the artifact, which the holder removes before it lets go (a
    process that locked the removed file sees that and locks the new one), so nothing is left in the working dir
    unless a process is killed outright. Where `flock` does not exist (Windows) no lock is taken. `waiting(message)`
    is told once when another process has held the lock for a second (a process that only checks an artifact holds
    it for milliseconds: no message for that).
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    path = Path(artifact)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_file = path.parent / f".{path.name}.lock"
    if not _can_lock(lock_file):
        # a folder this process cannot write (a shared, read-only copy of built exports): nothing can be built in it,
        # and what is built there was published whole (renamed in, its metadata last), so reusing it needs no lock;
        # a build that is needed fails on its first write, said as any read-only disk is (nndf.errors)
        yield
        return
    deadline, told = time.monotonic() + LOCK_QUIET_WAIT_S, False
    while True:
        handle = open(lock_file, "a")
        try:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() < deadline or told:
                        time.sleep(0.05)
                        continue
                if waiting is not None:
                    waiting(f"waiting for another process that is building {path} ...")
                told = True
            try:
                current = os.stat(lock_file).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(handle.fileno()).st_ino:
                break  # locked the file that is in place
        except BaseException:
            handle.close()
            raise
        handle.close()  # the previous holder removed it after we opened it: lock the new one
    try:
        sweep_leftovers(path)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock_file.unlink()
        handle.close()  # closing releases the lock


@contextlib.contextmanager
def locked_atomic_dir(final_dir: str | os.PathLike, waiting: Callable[[str], None] | None = None) -> Iterator[Path]:
    """`atomic_dir(final_dir)` under `artifact_lock(final_dir)`, for a folder written on request rather than built
    as a cached artifact (a Triton model folder, a standalone export). Why the lock: it lets the write remove the
    `.NAME.<random>.tmp` that a write killed outright left beside the folder, which nothing else removes and which,
    in a Triton repository, stops the server's start (a sub-folder that is no model); a write of the same folder by
    another process waits instead of racing this one."""
    with artifact_lock(final_dir, waiting), atomic_dir(final_dir) as tmp:
        yield tmp


def sweep_leftovers(artifact: Path) -> None:
    """Remove the temporary files and folders that a killed build of `artifact` left beside it.

    Why: `atomic_path` and `atomic_dir` remove their `.NAME.<random>.tmp` on any exception, but a process killed
    outright (SIGKILL, the OOM killer, a power cut) runs no cleanup, and the half-built copy would stay in the
    working dir forever. Call only while holding `artifact_lock(artifact)`: every build of the artifact and of its
    metadata runs under that lock, so no live process can own one of them. Only `tempfile`'s own names of the
    artifact and of its metadata file match (`.NAME.` or `.NAME.meta.json.`, eight random characters, `.tmp`), never
    another artifact whose name starts with NAME."""
    pattern = re.compile(rf"\.{re.escape(artifact.name)}(\.meta\.json)?\.[a-z0-9_]{{8}}\.tmp")
    for leftover in artifact.parent.glob(f".{glob.escape(artifact.name)}.*.tmp"):
        if not pattern.fullmatch(leftover.name):
            continue
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def discard_artifact(artifact: str | os.PathLike, reason: str, say: Callable[[str], None]) -> None:
    """Remove an artifact that passed its metadata checks but proved unusable (its runtime could not load it), so
    that the next request builds it anew: said as any rebuild is ("rebuilding X: REASON"). Under its lock, as a
    build: a process that checks it meanwhile finds it gone and waits for the rebuild rather than reading it."""
    artifact = Path(artifact)
    with artifact_lock(artifact, say):
        say(f"rebuilding {artifact}: {reason}")
        _remove(artifact)


def remove_artifact(artifact: str | os.PathLike, waiting: Callable[[str], None] | None = None) -> None:
    """Remove an artifact (a file or folder, with its metadata) that is no longer wanted, under its lock: a process
    that writes it meanwhile (`write_artifact`, `locked_atomic_dir`) finishes first, and what a killed write left
    beside it goes too (`sweep_leftovers`)."""
    artifact = Path(artifact)
    with artifact_lock(artifact, waiting):
        _remove(artifact)


def _remove(artifact: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        metadata_path(artifact).unlink()  # first: metadata never vouches for a half-removed folder
    if artifact.is_dir() and not artifact.is_symlink():
        shutil.rmtree(artifact)
    elif artifact.exists() or artifact.is_symlink():
        artifact.unlink()


def folder_sizes(folder: Path) -> dict[str, int]:
    """{file name: size} of a folder's files: recorded at build time, compared before reuse (truncation check)."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def as_json(value: object) -> object:
    """`value` as it reads back from a metadata file (tuples become lists, paths strings): what comparisons see."""
    return json.loads(json.dumps(value, default=str))


def first_mismatch(meta: Mapping[str, object], expected: Mapping[str, object]) -> str | None:
    """The first key of `expected` whose value the recorded metadata does not have, or None when all agree."""
    for key, value in expected.items():
        if as_json(meta.get(key)) != as_json(value):
            return key
    return None


def _recorded_reason(artifact: Path, exists: bool, expected: Mapping[str, object],
                     describe: Callable[[str, object], str] | None) -> tuple[dict | None, str | None]:
    """The artifact's metadata and why it cannot be reused on its settings alone (None when they agree)."""
    if not exists:
        return None, "it does not exist yet"
    meta = read_metadata(artifact)
    if meta is None:
        return None, "its metadata file is missing or unreadable"
    key = first_mismatch(meta, expected)
    if key is not None:
        return meta, describe(key, meta.get(key)) if describe else f"it was built with a different {key}"
    return meta, None


def stale_reason(artifact_dir: Path, expected: Mapping[str, object]) -> str | None:
    """Why the folder artifact cannot be reused for `expected` metadata, or None when it can.

    The metadata must agree on every key of `expected`, and every recorded file must exist with its recorded size.
    """
    meta, reason = _recorded_reason(artifact_dir, artifact_dir.is_dir(), expected, None)
    if reason is not None:
        return reason
    recorded = meta.get("files") or {}
    if not recorded:
        return "its metadata lists no files"
    actual = folder_sizes(artifact_dir)
    for name, size in recorded.items():
        if actual.get(name) != size:
            return f"{name} is missing or truncated"
    return None


def file_stale_reason(artifact: str | os.PathLike, expected: Mapping[str, object],
                      describe: Callable[[str, object], str] | None = None) -> str | None:
    """Why a file written by `write_artifact` cannot be reused for `expected` metadata, or None when it can.

    As `stale_reason` for folders: the metadata must agree on every key of `expected` (`describe(key, recorded)`
    words a disagreement, default "it was built with a different KEY") and the file must have its recorded size.
    """
    artifact = Path(artifact)
    meta, reason = _recorded_reason(artifact, artifact.is_file(), expected, describe)
    if reason is not None:
        return reason
    if meta.get("size") != artifact.stat().st_size:
        return "its file is truncated or was changed after it was built"
    return None


def build_dir_artifact(artifact_dir: str | os.PathLike, build: Callable[[Path], None],
                       metadata: Mapping[str, object]) -> Path:
    """Build a folder artifact through `build(tmp_folder)`; publish it, then its metadata (with file sizes). Its files
    go to disk and leave the page cache before they are published (`nndf.page_cache`: a session maps them then as
    it maps them in every later run)."""
    artifact_dir = Path(artifact_dir)
    meta_file = metadata_path(artifact_dir)
    if meta_file.exists():
        meta_file.unlink()  # an old metadata file must never vouch for a new folder
    with atomic_dir(artifact_dir) as tmp:
        build(tmp)
        files = folder_sizes(tmp)
        drop_folder_from_page_cache(tmp)
    atomic_write_json(meta_file, dict(metadata, files=files))
    return artifact_dir
