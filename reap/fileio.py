"""Atomic file writes shared by every stage: nothing already written is lost. Every rename into
place in reap is here, and `claim_out` is the one rule for an `--out` that replaces what is there:
reap replaces only what it made, and only with `--overwrite`. Write failures are `WriteError`
(exit 3) naming the file; a path unusable as given is bad input (exit 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Iterator

from reap.errors import ReapError, WriteError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, tmp: str | None = None,
                fsync: bool = False) -> Iterator[str]:
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
        if os.path.lexists(path) and _kind(path) != "file":  # a rename would replace a device
            raise ReapError(f"{path}: is a {_kind(path)}; reap replaces only regular files")
        os.replace(tmp, path)
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_atomic(path: str | os.PathLike, data: bytes | str, tmp: str | None = None,
                 fsync: bool = False) -> str:
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


def _not_under_a_file(path: str, flag: str) -> str:
    """`path`, unless an existing ancestor is not a directory (ReapError)."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise ReapError(f"{flag} {path}: {parent} is a file, not a directory")
    return path


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> str:
    """Vet (and create) an output directory; returns the path. ReapError (exit 2) when it is a
    file or lies under one, WriteError (exit 3) when it cannot be created."""
    path = _not_under_a_file(os.fspath(path), flag)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ReapError(f"{flag} {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise WriteError(f"{flag} {path}: cannot create the directory: {e.strerror or e}") from e
    return path


OVERWRITE_HELP = "replace an existing output that reap made (anything else is refused)"
_TAGGED = ("model.safetensors.index.json", "reap_manifest.json")  # a reap checkpoint's tags
_MAX_TAG = 64 << 20  # a tagged JSON is far smaller
MD_TAG = "<!-- reap.report -->\n"  # first line of the markdown reap writes beside a print-out
PNG_TAG = {"Software": "reap.report"}  # a text chunk of the PNGs it writes (matplotlib metadata)


def _kind(path: str) -> str:
    mode = os.lstat(path).st_mode
    kinds = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISREG, "file"),
             (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"))
    return next((name for test, name in kinds if test(mode)), "device")


def made_by_reap(path: str | os.PathLike) -> bool:
    """Whether `path` carries the tag of a reap artifact: a regular JSON file whose "format" (or
    "metadata.format", an index's) starts with "reap.", a safetensors file whose header metadata
    does (statistics), markdown or a PNG carrying `MD_TAG` or `PNG_TAG`, or a directory holding
    such an index or a prune manifest."""
    path = os.fspath(path)
    try:
        if _kind(path) == "directory":
            return any(made_by_reap(os.path.join(path, name)) for name in _TAGGED)
        if _kind(path) != "file":  # opening a FIFO would block
            return False
        with open(path, "rb") as f:
            first = f.read(1)
            text = f.read(_MAX_TAG if first == b"{" else 4096)
        if (first + text).startswith(MD_TAG.encode()) or b"Software\0reap.report" in text:
            return True
        if first != b"{":  # not JSON: a safetensors file, whatever its name
            from safetensors import safe_open

            with safe_open(path, framework="np") as f:
                d = json.loads((f.metadata() or {})["reap"])
        else:
            d = json.loads(b"{" + text)
        tag = d.get("format", (d.get("metadata") or {}).get("format"))
    except Exception:  # noqa: BLE001 - unreadable or foreign (safetensors' own errors included)
        return False
    return isinstance(tag, str) and tag.startswith("reap.")


def claim_out(path: str | os.PathLike, overwrite: bool, flag: str = "--out",
              directory: bool = False) -> bool:
    """The one rule for an output that replaces what is at `path`: nothing there is fine; what
    reap made (`made_by_reap`, or an empty directory) is replaced only with `overwrite`; anything
    else (another file or directory, a link, FIFO, socket or device) is ReapError (exit 2)
    naming the path, `overwrite` or not. Returns whether something will be replaced."""
    path, want = _not_under_a_file(os.fspath(path), flag), "directory" if directory else "file"
    if not os.path.lexists(path):
        return False
    if _kind(path) != want:
        raise ReapError(f"{flag} {path}: is a {_kind(path)}, not a {want}; choose another")
    if not (made_by_reap(path) or (directory and not os.listdir(path))):
        raise ReapError(f"{flag} {path}: exists and was not made by reap, which never replaces "
                        f"it (--overwrite or not); choose another {flag}")
    if not overwrite:
        raise ReapError(f"{flag} {path}: already exists (give --overwrite to replace it, or "
                        f"another {flag})")
    return True
