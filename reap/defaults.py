"""The default model every command uses when none is given: the bundled k3-mini
(`reap/models/k3mini/`, see its MODEL_CARD.md), else, in a checkout before it was trained, a
random `k3-tiny` synthesized into the cache on first use (renamed into place when finished, so
concurrent first uses cannot leave a half-written model).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reap.cache import cache_dir

BUNDLED = Path(__file__).resolve().parent / "models" / "k3mini"
FALLBACK_CONFIG = "k3-tiny"
FALLBACK_SEED = 0


def default_model(log: Callable[[str], None] | None = None) -> str:
    """Path of the default model: the bundled k3-mini, else a k3-tiny synthesized on first use."""
    if (BUNDLED / "config.json").is_file():
        return str(BUNDLED)
    from reap.errors import ReapError
    from reap.synth import synth

    out = cache_dir() / "models" / f"{FALLBACK_CONFIG}-seed{FALLBACK_SEED}"
    if (out / "config.json").is_file():
        return str(out)
    if log is not None:
        log(f"reap: no trained default model in this checkout; synthesizing a random "
            f"{FALLBACK_CONFIG} into {out} (results on random weights are for trying the "
            "pipeline only)")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        return synth(FALLBACK_CONFIG, out, seed=FALLBACK_SEED, dtype="float32")
    except ReapError:
        if (out / "config.json").is_file():  # another process finished it first
            return str(out)
        raise
