"""The bundled default model of `reap run` / `reap serve` when no MODEL is given.

Until a real default build ships, it is the `k3-tiny` config synthesized (seed 0, float32) into
the user's cache directory on first use (`$REAP_CACHE`, else `$XDG_CACHE_HOME/reap`, else
`~/.cache/reap`). The checkpoint writer renames a finished directory into place, so concurrent
first uses cannot leave a half-written model. (This helper belongs below all stages, next to
`reap.synth`; it lives here until it moves.)
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CONFIG = "k3-tiny"
DEFAULT_SEED = 0


def cache_dir() -> Path:
    """Where reap keeps downloaded or synthesized models."""
    if os.environ.get("REAP_CACHE"):
        return Path(os.environ["REAP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "reap"


def default_model() -> str:
    """Path of the default model, synthesized on first use."""
    from reap.errors import ReapError
    from reap.synth import synth

    out = cache_dir() / "models" / f"{DEFAULT_CONFIG}-seed{DEFAULT_SEED}"
    if (out / "config.json").is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        return synth(DEFAULT_CONFIG, out, seed=DEFAULT_SEED, dtype="float32")
    except ReapError:
        if (out / "config.json").is_file():  # another process finished it first
            return str(out)
        raise
