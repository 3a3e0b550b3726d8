"""Provenance shared by every artifact: which code made it.

`code_version(parts)` is `reap <version> src <digest>`, the digest a sha256 over the source files
that determine the artifact (an edit there, committed or not, changes it; unrelated modules do
not). Each stage names its parts once, beside the artifact it writes.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from reap import __version__

_ROOT = Path(__file__).resolve().parent


@functools.cache
def code_version(parts: tuple[str, ...] = (".",)) -> str:
    """Version plus a digest of the sources under `parts` (paths relative to the package)."""
    h = hashlib.sha256()
    for part in parts:
        path = _ROOT / part
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            if f.exists():
                h.update(f.relative_to(_ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return f"reap {__version__} src {h.hexdigest()[:16]}"


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 hex digest of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
