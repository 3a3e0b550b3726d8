"""The columns of an evaluation (`Build`: label, checkpoint, cache identity) and their engines.

`make_builds` labels the command line's builds uniquely; `Engines` opens the reference once and
each build in turn under one memory budget, recording routed experts that failed to load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reap.eval.cache import build_identity, key_of


@dataclass(eq=False)  # two columns may be the same checkpoint
class Build:
    """A column of the comparison: `label` (unique), checkpoint `path`, `identity` (cache)."""

    label: str
    path: str
    identity: dict

    @property
    def key(self) -> str:
        return key_of(self.identity)


def parse_build(arg: str) -> tuple[str | None, str]:
    """`LABEL=PATH` or `PATH` (a label holds no `/`, and PATH is then taken as given)."""
    label, sep, path = arg.partition("=")
    if sep and label and "/" not in label and not Path(arg).exists():
        return label, path
    return None, arg


def make_builds(args: list[str]) -> list[Build]:
    """Builds with unique labels (directory names, `#2` appended to a repeated one)."""
    out: list[Build] = []
    for arg in args:
        label, path = parse_build(arg)
        base = label or Path(path.rstrip("/")).name or path
        label, n = base, 1
        while any(b.label == label for b in out):
            n += 1
            label = f"{base}#{n}"
        out.append(Build(label, path, build_identity(path)))
    return out


class Engines:
    """Opens the reference once and each build in turn under one memory budget (`--budget`,
    else 80 % of the available memory; a `--preset` applies to each engine as is): the reference
    gets half of it above the process baseline, a build what the reference's plan leaves."""

    def __init__(self, reference: Build, opts: dict):
        self.reference, self.opts = reference, opts
        self.ref = None
        self.total: int | None = None
        self.failures: dict[str, list] = {}

    def _open(self, path: str, budget: int | None):
        from reap.engine import Engine

        o = self.opts
        return Engine.open(path, budget=budget, preset=o["preset"], context=o["context"],
                           device=o["device"], dtype=o["dtype"], batch=o["plan_batch"],
                           max_generation=o["context"])  # the plan does not depend on it

    def reference_engine(self):
        """The reference's engine, opened on first use."""
        from reap.memstat import available_memory, current_rss
        from reap.units import parse_bytes

        if self.ref is None:
            base = current_rss()
            if self.opts["preset"] is None:
                b = self.opts["budget"]
                if b is None:
                    self.total = base + int(0.8 * available_memory()[0])
                else:
                    self.total = parse_bytes(b) if isinstance(b, str) else int(b)
            half = None if self.total is None else base + (self.total - base) // 2
            self.ref = self._open(self.reference.path, half)
        return self.ref

    def build_engine(self, build: Build):
        """A build's engine, opened next to the reference's (close it when done)."""
        ref = self.reference_engine()
        left = None if self.total is None else self.total - (ref.plan.total - ref.plan.baseline)
        return self._open(build.path, left)

    def check(self, engine, label: str) -> None:
        """Record routed experts that failed to load (the results are then untrustworthy)."""
        if engine.expert_failures:
            self.failures[label] = [list(f) for f in engine.expert_failures]

    def close(self) -> None:
        if self.ref is not None:
            self.ref.close()
            self.ref = None
