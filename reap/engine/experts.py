"""The routed-expert cache (`ExpertCache`, which says why LFU with aging).

    names = functools.partial(fam.expert_tensor_names, cfg)  # (layer, expert) -> stored names
    cache = ExpertCache(reader, capacity_bytes, names, fam.expert_matrices)
    cache.preload(keys)                # optional: read them all now if they all fit
    cache.pin(resident_keys(counts, nbytes, slots))  # optional: never evict these
    cache.prefetch(layer, ids)         # optional: start all reads now
    tensors = cache.get(layer, expert)  # short name -> tensor, or None if it failed to load
    cache.release()                     # the layer is done: its experts may be evicted
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from reap.checkpoint import BufferReader
from reap.engine.pages import weight_buffer
from reap.engine.store import _to
from reap.errors import ReapError
from reap.models.base import expert_short_names
from reap.quant.matrix import check_matrices


class ExpertCache:
    """Routed experts read on demand into a slab of fixed-size slots, evicted by LFU with aging.

    Why LFU with aging and not LRU: a decode step visits every MoE layer in order, so the
    experts it touches form a cyclic scan much larger than most caches; LRU evicts each expert
    just before the next token wants it again, while LFU keeps the experts the router keeps
    choosing. Aging (each use weighs 2^(t/half_life) for access counter t) lets the resident set
    follow a change of topic; the engine sets the half-life to one decode token's expert uses
    (MoE layers x top-k): with 4096 uses the first tokens' experts held the cache and it hit
    0.43 of teacher-forced text where LRU hit 0.89 (`reports/streaming-policy.md`).

    Admission: every expert's aged use count is kept (`seen`), resident or not. Once no slot is
    free and the cache cycles (its lowest admitted count is at least one use's weight a
    half-life ago), an expert read in is admitted to the ranked set only if its count before
    this use beats that lowest one; else it is staged: staged experts are evicted first, oldest
    first. Without it a cache smaller than one token's expert uses evicted each expert just
    before its next use and hit nothing (`reports/streaming.md`, 25 % cap). Experts fetched in
    the current layer are never evicted until `release()`: the model may still hold views of them.

    A failed read (corrupt bytes included: with `matrices_of`, each read's quantized matrices
    are checked by their codecs) raises nothing: it is recorded in `failed` and the expert is
    served as None so the engine can finish and report exit code 4."""

    def __init__(self, reader: BufferReader, capacity_bytes: int, names_of,
                 matrices_of: Callable[[dict[str, torch.Tensor]], dict] | None = None,
                 half_life: int = 4096, device: str = "cpu"):  # fmt: skip
        self.reader, self.names_of, self.matrices_of = reader, names_of, matrices_of
        self.device = device
        self.half_life = half_life
        self.slot_bytes = 0
        self.capacity_bytes = capacity_bytes
        self.slab: torch.Tensor | None = None
        self.n_slots = 0
        self.where: dict[tuple[int, int], int] = {}  # key -> slot
        self.tensors: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.score: dict[tuple[int, int], float] = {}  # the admitted residents' counts
        self.seen: dict[tuple[int, int], float] = {}  # every expert's aged use count
        self._staged: dict[tuple[int, int], None] = {}  # residents not admitted, oldest first
        self._heap: list[tuple[float, tuple[int, int]]] = []
        self._free: list[int] = []
        self._in_use: set[tuple[int, int]] = set()
        self.clock = 0
        self.hits = self.misses = 0
        self.failed: list[tuple[int, int, str]] = []
        self.pinned: frozenset[tuple[int, int]] = frozenset()  # read once, never evicted
        self._pending: dict[tuple[int, int], Future] = {}
        self._pool = None

    def _ensure_slab(self, span: int, raw: int) -> None:
        """Size the slab once: capacity counts stored bytes (`raw`, the largest expert's), each
        slot holds the largest expert span (its bytes plus alignment slack, one run per file
        or gap it spans). The slab is touched once so reads never pay for first-touch page
        faults (and the budget is really held)."""
        if self.slab is None:
            self.slot_bytes = span
            self.n_slots = self.capacity_bytes // raw if raw else 0
            if self.n_slots:
                self.slab = weight_buffer(self.n_slots * span)
            self._free = list(range(self.n_slots))[::-1]

    def reserve(self, keys: Iterable[tuple[int, int]]) -> None:
        """Allocate the slab now, its slots sized for the largest of these (layer, expert)
        keys (else for the first expert read). Sizing from one expert would leave every
        larger span (an expert split across two shards, a layer with wider experts) without
        a slot, re-read on every use."""
        span = raw = 0
        for key in keys:
            if not self.stored(key):
                continue  # a layer with fewer experts (pruned per layer)
            infos = [self.reader.info(n) for n in self.names_of(*key)]
            span = max(span, self.reader.span(infos))
            raw = max(raw, sum(t.nbytes for t in infos))
        self._ensure_slab(span, raw)

    def preload(self, keys: Iterable[tuple[int, int]]) -> int:
        """Read every listed (layer, expert) now, in background threads, if the cache holds
        them all (nothing is ever evicted then); else nothing. One that fails to read is left
        for `get` to retry and report. Returns the number read."""
        keys = [k for k in keys if k not in self.tensors and self.stored(k)]
        if not keys or len(keys) + len(self.tensors) > self.n_slots:
            return 0
        return self._read_now(keys)

    def pin(self, keys: Iterable[tuple[int, int]]) -> int:
        """Read these (layer, expert) keys now (as `preload`) into slots never evicted; the
        other experts share the slots left by the usual policy. Returns the number read."""
        self.pinned = frozenset(keys)
        return self._read_now([k for k in self.pinned if k not in self.tensors and self.stored(k)])

    def _read_now(self, keys: list[tuple[int, int]]) -> int:
        started = [(k, self._start(k, background=True)) for k in keys]
        done = 0
        for key, fut in started:
            try:
                fut.result()
            except ReapError:
                if fut.slot is not None:
                    self._free.append(fut.slot)
                continue
            self._install(key, fut, count=False)
            done += 1
        return done

    def stored(self, key: tuple[int, int]) -> bool:
        """Whether the checkpoint holds the expert (a layer pruned per layer has fewer)."""
        return all(n in self.reader.tensors for n in self.names_of(*key))

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Start reading every listed expert that is not resident, in background threads (the
        eviction decisions are made here, in order, so they do not depend on timing)."""
        keys = [(layer, int(e)) for e in experts]
        self._in_use.update(keys)  # none of them may be evicted to make room for another
        for key in keys:
            if key not in self.tensors and key not in self._pending:
                self._pending[key] = self._start(key, background=True)

    def get(self, layer: int, expert: int) -> dict[str, torch.Tensor] | None:
        """The expert's tensors by short name, or None if unreadable."""
        key = (layer, expert)
        self.clock += 1
        self._in_use.add(key)
        if key in self.tensors:
            self.hits += 1
            self._bump(key)
            return self.tensors[key]
        self.misses += 1
        return self._install(key, self._pending.pop(key, None) or self._start(key, False))

    def ready(self, layer: int, expert: int) -> bool:
        """Whether `get` would return at once: resident, or its background read is done."""
        fut = self._pending.get((layer, expert))
        return (layer, expert) in self.tensors or fut is not None and fut.done()

    def count_hits(self, n: int) -> None:
        """n uses of resident experts served without `get` (a compiled token step, only while
        every expert is resident: nothing can be evicted then, so scores no longer matter)."""
        self.clock += n
        self.hits += n

    def _start(self, key: tuple[int, int], background: bool) -> Future:
        """Claim a slot (or a transient buffer) for `key` and read it; a Future of the raw
        tensors with `.slot` and `.names` attached."""
        fut: Future = Future()
        fut.slot, fut.names = None, self.names_of(*key)
        try:
            infos = [self.reader.info(n) for n in fut.names]
            span = self.reader.span(infos)
            self._ensure_slab(span, sum(t.nbytes for t in infos))
            fut.slot = self._claim() if span <= self.slot_bytes else None
        except ReapError as e:
            fut.set_exception(e)
            return fut
        if fut.slot is None:
            buf = torch.empty(span, dtype=torch.uint8)
        else:
            buf = self.slab[fut.slot * self.slot_bytes : (fut.slot + 1) * self.slot_bytes]

        names = fut.names

        def work():
            raw = self.reader.read_into(infos, buf, "experts")
            if self.matrices_of is not None:
                short = dict(zip(expert_short_names(list(names)), (raw[n] for n in names)))
                check_matrices(self.matrices_of(short))
            return raw

        if background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="reap-experts")
            slot = fut.slot
            fut = self._pool.submit(work)
            fut.slot, fut.names = slot, names
            return fut
        try:
            fut.set_result(work())
        except ReapError as e:
            fut.set_exception(e)
        return fut

    def _install(
        self, key: tuple[int, int], fut: Future, count: bool = True
    ) -> dict[str, torch.Tensor] | None:
        try:
            raw = fut.result()
        except ReapError as e:
            if fut.slot is not None:
                self._free.append(fut.slot)
            self.failed.append((key[0], key[1], str(e)))
            return None
        names = fut.names
        short = expert_short_names(list(names))
        out = _to({s: raw[n] for s, n in zip(short, names)}, self.device)
        if fut.slot is not None:
            self.where[key], self.tensors[key] = fut.slot, out
            if count or key in self.pinned:
                self._bump(key)
            else:  # prefetched but never asked for: first in line for eviction
                self._staged[key] = None
        return out

    def _bump(self, key: tuple[int, int]) -> None:
        if self.clock > 64 * self.half_life:  # renormalize before the weights overflow
            self._rescale()
        w, before = 2.0 ** (self.clock / self.half_life), self.seen.get(key, 0.0)
        self.seen[key] = before + w
        if key in self.pinned:  # never a candidate for eviction: kept off the heap
            return
        self._staged.pop(key, None)
        low = self._lowest() if key not in self.score and not self._free else float("-inf")
        if low >= w / 2 and before <= low:  # the cache cycles and this one is no more used
            self._staged[key] = None  # (re)staged as the newest
            return
        self.score[key] = self.seen[key]
        heapq.heappush(self._heap, (self.score[key], key))

    def _lowest(self) -> float:
        """The lowest admitted count (stale heap entries dropped); -inf if none is admitted."""
        while self._heap and self.score.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else float("-inf")

    def _rescale(self) -> None:
        f = 2.0 ** (-self.clock / self.half_life)
        self.score = {k: s * f for k, s in self.score.items() if k in self.tensors}
        self.seen = {k: s * f for k, s in self.seen.items()}
        self.clock = 0
        self._heap = [(s, k) for k, s in self.score.items()]
        heapq.heapify(self._heap)

    def _claim(self) -> int | None:
        """A free slot, evicting the least-valued resident expert not in use; None if all are."""
        if self._free:
            return self._free.pop()
        victim = next((k for k in self._staged if k not in self._in_use), None)
        if victim is not None:
            del self._staged[victim], self.tensors[victim]
            return self.where.pop(victim)
        skipped = []
        slot = None
        while self._heap:
            s, key = heapq.heappop(self._heap)
            if key not in self.tensors or s != self.score.get(key):
                continue  # stale heap entry
            if key in self._in_use:
                skipped.append((s, key))
                continue
            slot = self.where.pop(key)
            del self.tensors[key]
            self.score.pop(key, None)
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        if len(self._heap) > 8 * max(1, len(self.tensors)) + 1024:
            self._heap = [(s, k) for k, s in self.score.items() if k in self.tensors]
            heapq.heapify(self._heap)
        return slot

    def release(self) -> None:
        """The current layer is done: its experts may be evicted again."""
        for key, fut in list(self._pending.items()):
            self._install(key, fut, count=False)
        self._pending.clear()
        self._in_use.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.tensors.clear()
        self.where.clear()
        self.slab = None


def resident_keys(counts: dict[tuple[int, int], int], nbytes, slots: int) -> list[tuple[int, int]]:
    """The experts to pin: the most routed tokens per stored byte (`nbytes(key)`) first, ties in
    (layer, expert) order, at most `slots`, none that no token was routed to."""
    ranked = sorted((k for k in counts if counts[k] > 0), key=lambda k: (-counts[k] / nbytes(k), k))
    return ranked[: max(0, slots)]


def routed_counts(path: str, layers: list[int], n_experts: int) -> dict[tuple[int, int], int]:
    """(layer, expert) -> tokens routed to it by the statistics at `path` (a file, or a `reap
    calibrate` output directory: its corpora summed); ReapError (exit 2) if they are not of a
    model with these MoE layers and experts."""
    from reap.stats import ExpertStats, expand_paths

    files = expand_paths([path])[0]
    if not files:
        raise ReapError(f"{path}: no statistics files in this directory")
    total = 0
    for f in files:
        s = ExpertStats.load(f)
        if (s.layers, s.n_experts) != (list(layers), n_experts):
            raise ReapError(f"{f}: statistics of another model ({len(s.layers)} MoE layers x "
                            f"{s.n_experts} experts; this one {len(layers)} x {n_experts})")
        total = total + s.count
    return {(lay, e): int(total[i, e]) for i, lay in enumerate(layers) for e in range(n_experts)}
