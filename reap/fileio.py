"""Atomic file writes shared by every stage: nothing already written is lost.

`atomic_path(path)` yields a temporary name beside `path`; when the block ends without error the
file is renamed into place, otherwise the temporary file is removed. Failures become
`WriteError` (exit code 3) naming the file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from reap.errors import WriteError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temp path to write; renamed to `path` (parents created) when the block succeeds."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> str:
    """Write bytes or text to `path` atomically; returns the path."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return os.fspath(path)
