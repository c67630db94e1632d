"""Checks of the paths a user names for output, made before any model loads.

A folder where a file should be written, or a file where a folder should be made, would otherwise fail only after
minutes of loading and measuring, deep in the last write, and the run's results would be lost. Missing folders are
not an error: the writes create them (`nndf.workspace.atomic_path`), for every output flag alike.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from nndf.errors import UsageError


def _file_in_the_way(flag: str, value: str, path: Path, into: bool = False) -> None:
    """One sentence when a parent of `path` exists as a file, so no folder can be made there, or when nothing can be
    written in the nearest folder that exists (no permission, a read-only or virtual file system such as /proc):
    tried by creating and removing a temporary file there, as the write will. `into`: `path` is a folder that the
    command writes into, so it is that folder, where it exists, that must take a file."""
    for place in [path, *path.parents] if into else path.parents:
        if place.exists():
            if not place.is_dir():
                raise UsageError(f"{flag} {value} is inside {place}, which is a file")
            try:
                fd, probe = tempfile.mkstemp(prefix=".nndf-write-check.", dir=place)
            except OSError as exc:
                raise UsageError(f"{flag} {value}: nothing can be written in {place} ({exc.strerror})") from None
            os.close(fd)
            os.unlink(probe)
            return


def check_output_folder(flag: str, value: str | None, into: bool = False) -> None:
    """`value` may be a folder or not exist yet (it is created), but not a file, nor inside one. `into`: the command
    always writes into it (-o), so an existing folder must be writable; a working dir need not be (its built
    exports are reused from a read-only one)."""
    if value is None:
        return
    if not str(value).strip():  # Path("") is the current folder: -o "$UNSET" wrote the models among the user's files
        raise UsageError(f"{flag} is empty; give a folder name ('.' for the current folder)")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {value} is a file; it takes a folder (created if missing)")
    _file_in_the_way(flag, value, path, into)


def check_output_file(flag: str, value: str | None, example: str) -> None:
    """`value` may be a file (replaced) or not exist yet, but not a folder, nor inside a file."""
    if value is None:
        return
    if not str(value).strip():  # Path("") is the current folder, which it then called "--json  is a folder"
        raise UsageError(f"{flag} is empty; give a file name such as {example}")
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{flag} {value} is a folder; give a file name such as {example}")
    _file_in_the_way(flag, value, path)


def holds_other_files(folder: Path, marker: str) -> bool:
    """Whether `folder` is a folder with files in it but not `marker`: not one of ours to replace (writing there
    would delete what the user keeps), where a new, empty or marked folder is."""
    return folder.is_dir() and any(folder.iterdir()) and not (folder / marker).is_file()
