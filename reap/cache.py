"""Where reap keeps what it can rebuild: synthesized models, HTTP caches, compiled kernels.
It imports nothing of reap, so every layer (the checkpoint reader, the kernels) may ask it."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$REAP_CACHE`, else `$XDG_CACHE_HOME/reap`, else `~/.cache/reap`."""
    if os.environ.get("REAP_CACHE"):
        return Path(os.environ["REAP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "reap"
