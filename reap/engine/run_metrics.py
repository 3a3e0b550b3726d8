"""Run metrics of the streaming engine: throughput per phase, bytes read per token, expert cache
hit rate, achieved read bandwidth, I/O share of wall time and peak RSS.

The engine snapshots its I/O counters at phase boundaries and adds the differences here:

    m = RunMetrics()
    m.add("prefill", T, seconds, before, after)  # before/after: Engine.counters() snapshots
    m.as_dict()  # JSON-ready, derived rates included
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# the counters of a phase that add up as they are (besides tokens, seconds and bytes)
COUNTERS = ("reads", "io_seconds", "wait_seconds", "expert_hits", "expert_misses")


@dataclass
class PhaseMetrics:
    """One phase (prefill or decode): tokens processed and what it cost.

    `bytes` by kind (trunk / experts / embed); `io_seconds` is time inside read calls on any
    thread; `wait_seconds` is time the compute thread spent waiting on reads (ring stalls plus
    on-demand expert and embedding reads)."""

    tokens: int = 0
    seconds: float = 0.0
    bytes: dict[str, int] = field(default_factory=lambda: {"trunk": 0, "experts": 0, "embed": 0})
    reads: int = 0
    io_seconds: float = 0.0
    wait_seconds: float = 0.0
    expert_hits: int = 0
    expert_misses: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def bytes_per_token(self, kind: str | None = None) -> float:
        b = self.total_bytes if kind is None else self.bytes.get(kind, 0)
        return b / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float:
        n = self.expert_hits + self.expert_misses
        return self.expert_hits / n if n else 0.0

    @property
    def read_gbps(self) -> float:
        return self.total_bytes / self.io_seconds / 1e9 if self.io_seconds > 0 else 0.0

    @property
    def io_share(self) -> float:
        return min(1.0, self.wait_seconds / self.seconds) if self.seconds > 0 else 0.0

    def accumulate(self, tokens: int, seconds: float, nbytes: dict, counts: dict) -> None:
        """Add more work: its tokens, seconds, bytes by kind and `COUNTERS` values."""
        self.tokens += tokens
        self.seconds += seconds
        for k, v in nbytes.items():
            self.bytes[k] = self.bytes.get(k, 0) + v
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + counts[name])

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s,
                "bytes_per_token": self.bytes_per_token(),
                "trunk_bytes_per_token": self.bytes_per_token("trunk"),
                "expert_bytes_per_token": self.bytes_per_token("experts"),
                "expert_hit_rate": self.hit_rate, "read_gbps": self.read_gbps,
                "io_share": self.io_share}  # fmt: skip


@dataclass
class RunMetrics:
    """Everything one `generate` / `logits` call measured (cumulative over an engine's life
    in `Engine.metrics`)."""

    prefill: PhaseMetrics = field(default_factory=PhaseMetrics)
    decode: PhaseMetrics = field(default_factory=PhaseMetrics)
    sequences: int = 0
    generated_tokens: int = 0
    expert_failures: int = 0
    peak_rss: int = 0
    open_seconds: float = 0.0
    pinned_read_bytes: int = 0

    def add(self, phase: str, tokens: int, seconds: float, before: dict, after: dict) -> None:
        """Add one stretch of work to `phase`; before/after are `Engine.counters()` snapshots."""
        moved = {k: v - before["bytes"].get(k, 0) for k, v in after["bytes"].items()}
        counts = {name: after[name] - before[name] for name in COUNTERS}
        getattr(self, phase).accumulate(tokens, seconds, moved, counts)

    def merge(self, other: RunMetrics) -> None:
        """Accumulate another run into this one (peak RSS: the maximum)."""
        for phase in ("prefill", "decode"):
            b = getattr(other, phase)
            counts = {name: getattr(b, name) for name in COUNTERS}
            getattr(self, phase).accumulate(b.tokens, b.seconds, b.bytes, counts)
        self.sequences += other.sequences
        self.generated_tokens += other.generated_tokens
        self.expert_failures += other.expert_failures
        self.peak_rss = max(self.peak_rss, other.peak_rss)

    def as_dict(self) -> dict:
        return {**asdict(self), "prefill": self.prefill.as_dict(), "decode": self.decode.as_dict()}

    def describe(self) -> str:
        """A few human-readable lines."""
        p, d = self.prefill, self.decode
        return (
            f"prefill: {p.tokens} tokens in {p.seconds:.3f} s ({p.tokens_per_s:.2f} tok/s)\n"
            f"decode:  {d.tokens} tokens in {d.seconds:.3f} s ({d.tokens_per_s:.2f} tok/s, "
            f"{d.seconds / d.tokens if d.tokens else 0:.3f} s/token)\n"
            f"read per decoded token: trunk {d.bytes_per_token('trunk') / 1e6:.2f} MB, experts "
            f"{d.bytes_per_token('experts') / 1e6:.2f} MB; expert hit rate "
            f"{100 * d.hit_rate:.1f}%; {d.read_gbps:.2f} GB/s while reading; I/O wait "
            f"{100 * d.io_share:.0f}% of decode time\n"
            f"peak RSS {self.peak_rss / 1e9:.3f} GB; expert load failures {self.expert_failures}"
        )
