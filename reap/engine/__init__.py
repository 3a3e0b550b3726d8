"""The streaming inference engine: runs a checkpoint under a RAM budget by keeping part of the
trunk resident, streaming the other layers through a ring buffer and caching routed experts.

    from reap.engine import Engine
    with Engine.open("path/to/model", budget="8GB", context=4096) as engine:
        print(engine.plan.describe())
        gens = engine.generate(["Hello"], max_tokens=32, temperature=0.0)
        print(gens[0].text, engine.metrics.describe())
        for token in engine.stream([1, 2, 3], max_tokens=8): ...
        logits = engine.logits([[1, 2, 3]])        # [[3, V]] next-token logits per position

Modules: `memory` (the plan), `binding` (checkpoint -> trunk units, byte census), `store`
(positioned reads, pinned trunk, streamed-layer ring), `experts` (routed-expert cache), `core`
(Engine: open and the layer-by-layer step; expert matmuls by `reap.quant`), `generate`
(sampling, stop strings, lockstep batches), `run_metrics`, `remote` (checkpoints over HTTP), `cli`
(`reap run`). `reap.serve` builds on this API. Importing this package loads nothing heavy.
"""

from __future__ import annotations

__all__ = ["Engine", "Generation", "Request", "default_model"]


def __getattr__(name: str):
    if name == "Engine":
        from reap.engine.core import Engine

        return Engine
    if name in ("Generation", "Request"):
        from reap.engine import generate

        return getattr(generate, name)
    if name == "default_model":
        from reap.defaults import default_model

        return default_model
    raise AttributeError(f"module 'reap.engine' has no attribute {name!r}")
