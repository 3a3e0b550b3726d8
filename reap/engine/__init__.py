"""The streaming inference engine: runs a checkpoint under a RAM budget by keeping part of the
trunk resident, streaming the other layers through a ring buffer and caching routed experts.

    from reap.engine import Engine
    with Engine.open("path/to/model", budget="8GB", context=4096) as engine:
        print(engine.plan.describe())
        gens = engine.generate(["Hello"], max_tokens=32, temperature=0.0)
        print(gens[0].text, engine.metrics.describe())
        for token in engine.stream([1, 2, 3], max_tokens=8): ...
        logits = engine.logits([[1, 2, 3]])        # [[3, V]] next-token logits per position

`reap.serve` builds on this API. Importing this package loads nothing heavy.
"""

from __future__ import annotations

import importlib

# public name -> the module defining it, imported on first use
_LAZY = {"Engine": "reap.engine.core", "Generation": "reap.engine.generate",
         "Request": "reap.engine.generate", "default_model": "reap.defaults"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'reap.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
