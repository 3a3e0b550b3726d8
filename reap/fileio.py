"""Atomic file writes shared by every stage: nothing already written is lost. Every rename into
place in reap is here.

`atomic_path(path)` yields a temporary name beside `path`; when the block ends without error the
file is renamed into place, otherwise the temporary file is removed. Failures become
`WriteError` (exit code 3) naming the file. `replace_dir` moves a finished directory into place;
`overlap` tells whether an output path is, holds or lies inside an input (never to be replaced).
`check_out_dir` / `check_out_file` vet an `--out` before any work: a path unusable as given (a
file where a directory is needed, a directory where a file is) is bad input (exit 2), a
directory that cannot be created is a write failure (exit 3).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

from reap.errors import ReapError, WriteError


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, tmp: str | None = None, fsync: bool = False
) -> Iterator[str]:
    """A temp path to write (`tmp`, default `<path>.tmp.<pid>`); renamed to `path` (parents
    created) when the block succeeds, after its data reached the disk if `fsync`."""
    path = os.fspath(path)
    tmp = tmp or f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        yield tmp
        if fsync:  # the data reaches the disk before the name does
            fd = os.open(tmp, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_atomic(
    path: str | os.PathLike, data: bytes | str, tmp: str | None = None, fsync: bool = False
) -> str:
    """Write bytes or text to `path` atomically (see `atomic_path`); returns the path."""
    with atomic_path(path, tmp, fsync) as tmp_path, open(tmp_path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return os.fspath(path)


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename directory `src` to `dst`; an existing `dst` is moved aside first and removed once
    `src` is in place. Raises OSError."""
    old = None
    if os.path.exists(dst):
        old = f"{os.fspath(dst)}.old-{os.getpid()}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old)


def overlap(path: str | os.PathLike, sources) -> tuple[str, str] | None:
    """How `path` meets the first of `sources` it is, contains or lies inside, compared as real
    paths (symlinks resolved, also for a path that does not exist yet): (relation, source) with
    relation "is", "contains" or "is inside"; None when it meets none. An output that meets a
    source must never be written, replaced or removed."""
    out = os.path.realpath(path)
    for src in sources:
        real = os.path.realpath(src)
        if out == real:
            return "is", os.fspath(src)
        if real.startswith(out.rstrip(os.sep) + os.sep):
            return "contains", os.fspath(src)
        if out.startswith(real.rstrip(os.sep) + os.sep):
            return "is inside", os.fspath(src)
    return None


def _blocking_file(path: str) -> str | None:
    """The first existing ancestor of `path` that is not a directory, or None."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent if parent and not os.path.isdir(parent) else None


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> str:
    """Vet (and create) an output directory; returns the path. ReapError (exit 2) when it is a
    file or lies under one, WriteError (exit 3) when it cannot be created."""
    path = os.fspath(path)
    blocker = _blocking_file(path)
    if blocker is not None:
        raise ReapError(f"{flag} {path}: {blocker} is a file, not a directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ReapError(f"{flag} {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise WriteError(f"{flag} {path}: cannot create the directory: {e.strerror or e}") from e
    return path


def check_out_file(path: str | os.PathLike, flag: str = "--out") -> str:
    """Vet an output file path before the work that produces it; returns the path. ReapError
    (exit 2) when it is a directory or lies under a file; writing itself reports WriteError."""
    path = os.fspath(path)
    blocker = _blocking_file(path)
    if blocker is not None:
        raise ReapError(f"{flag} {path}: {blocker} is a file, not a directory")
    if os.path.isdir(path):
        raise ReapError(f"{flag} {path}: is a directory, a file name is needed")
    return path
