"""Build identities and the per-build result cache of `reap eval`.

A cached result is a JSON file `<out>/cache/<kind>-<key>.json`, written atomically (temporary name,
then rename). Its key is the sha256 of everything that determines its numbers: the build's identity
(and the reference's, for agreement), the evaluation arguments, the corpus sha256 or the prompt
set's digest, and the code version of the sources that compute them. A build's identity is its
`Checkpoint.fingerprint()` (tensor names, dtypes, shapes and config) plus the size and mtime of each
weight file and the sha256 of its tokenizer: the fingerprint alone does not hash tensor bytes, so
two random builds of one config would otherwise share cached results.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from reap.fileio import write_atomic
from reap.provenance import sha256_file


def build_identity(path: str) -> dict:
    """What identifies a build's weights (see the module docstring), JSON-ready."""
    from reap.checkpoint import Checkpoint, is_url, open_checkpoint

    if is_url(str(path)):
        return {"fingerprint": open_checkpoint(str(path)).fingerprint(), "url": str(path)}
    with Checkpoint.open(path) as ck:
        fp, files = ck.fingerprint(), sorted({t.file for t in ck.tensors.values()})
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    stats = [(os.path.relpath(f, root), os.stat(f)) for f in files]
    files = [[name, st.st_size, st.st_mtime_ns] for name, st in stats]
    tok = next((root / n for n in ("tokenizer.json", "tiktoken.model") if (root / n).is_file()),
               None)  # Kimi releases ship tiktoken.model instead
    tok_sha = sha256_file(tok) if tok is not None else None
    return {"fingerprint": fp, "files": files, "tokenizer": tok_sha}


def key_of(fields: dict) -> str:
    """The cache key of a result: sha256 of its fields as canonical JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class Cache:
    """JSON results under `<out>/cache/`, by kind and key; counts hits and misses."""

    def __init__(self, out: str | Path):
        self.dir = Path(out) / "cache"
        self.hits = self.misses = 0

    def path(self, kind: str, key: str) -> Path:
        return self.dir / f"{kind}-{key[:32]}.json"

    def get(self, kind: str, key: str) -> dict | None:
        """The cached payload, or None if absent, unreadable or made under another key."""
        try:
            d = json.loads(self.path(kind, key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            d = None
        if not isinstance(d, dict) or d.get("key") != key:
            self.misses += 1
            return None
        self.hits += 1
        return d["payload"]

    def put(self, kind: str, key: str, fields: dict, payload) -> None:
        """Store `payload` (with the fields it was keyed on, for provenance) atomically."""
        data = {"key": key, "fields": fields, "payload": payload}
        write_atomic(self.path(kind, key), json.dumps(data, ensure_ascii=False))
