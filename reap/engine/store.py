"""Trunk residency for the streaming engine: the pinned trunk units and the streamed-layer ring
with a background reader (the routed-expert cache is in `reap.engine.experts`).

    trunk = TrunkStore(reader, units, pinned, slots=2, slot_bytes=...)
    weights = trunk.get(i)                           # unit i's tensors; unit i+1.. read meanwhile

Reads go straight into long-lived ring slots so steady-state decoding allocates nothing and the
resident set stays inside the memory plan.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from reap.checkpoint import BufferReader
from reap.engine.pages import weight_buffer
from reap.errors import EXIT_FAILURE, ReapError

IO_KINDS = ("trunk", "experts", "embed")  # the engine's byte counters, reported even when zero


class TrunkStore:
    """Trunk units (decoder layers without routed experts, and the head): pinned ones read once
    and kept; the others stream through a ring of `slots` buffers, the next streamed unit read
    by a background thread while the current one computes.

    Units are consumed in cyclic order 0, 1, ..., n-1, 0, ...; `get(i)` releases the slot of the
    previously fetched streamed unit (its tensors must no longer be used). `stall`: seconds the
    compute thread waited for the ring."""

    def __init__(self, reader: BufferReader, units: list[list[str]], pinned: Sequence[int],
                 slots: int = 2, slot_bytes: int = 0, device: str = "cpu",
                 check: Callable[[dict[str, torch.Tensor]], None] | None = None):  # fmt: skip
        self.reader, self.units, self.device = reader, units, device
        self.check = check or (lambda tensors: None)  # e.g. Binding.guard.check_all
        self.stall = 0.0
        self.pinned: dict[int, dict[str, torch.Tensor]] = {}
        self.streamed = [i for i in range(len(units)) if i not in set(pinned)]
        for i in pinned:
            infos = [reader.info(n) for n in units[i]]
            if str(device) == "cpu":  # read straight into huge pages
                raw = reader.read_into(infos, weight_buffer(reader.span(infos), False), "trunk")
            else:
                raw = reader.read(units[i], "trunk")
            self.pinned[i] = _to(raw, device)
            self.check(self.pinned[i])
        self._infos = [[reader.info(n) for n in names] for names in units]
        need = max((reader.span(self._infos[i]) for i in self.streamed), default=0)
        self.slots = [
            _slot(max(need, slot_bytes), device) for _ in range(slots if self.streamed else 0)
        ]
        self._slot_of: dict[int, int] = {}  # streamed unit -> slot holding (or reading) it
        self._ready: dict[int, threading.Event] = {}
        self._result: dict[int, dict[str, torch.Tensor] | BaseException] = {}
        self._current: int | None = None
        self._pool = None
        if len(self.slots) > 1:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="reap-ring")

    def get(self, i: int, wrap: bool = True) -> dict[str, torch.Tensor]:
        """Unit i's tensors by name (pinned: resident; streamed: from its ring slot). The next
        streamed unit starts reading in the background; with wrap=False not if that means
        wrapping around to the first units (no further pass follows)."""
        if i in self.pinned:
            return self.pinned[i]
        if self._current is not None and self._current != i:
            self._slot_of.pop(self._current, None)  # release the previous unit's slot
        self._current = i
        if i not in self._slot_of:
            self._start(i)
        t0 = time.perf_counter()
        self._ready[i].wait()
        self.stall += time.perf_counter() - t0
        result = self._result.pop(i)
        if isinstance(result, BaseException):
            self._slot_of.pop(i, None)
            raise result
        self._prefetch_after(i, wrap)
        return result

    def _next_streamed(self, i: int) -> int | None:
        nxt = ([j for j in self.streamed if j > i] or self.streamed or [None])[0]
        return None if nxt == i else nxt

    def _prefetch_after(self, i: int, wrap: bool) -> None:
        nxt = self._next_streamed(i)
        if nxt is None or nxt in self._slot_of or self._pool is None:
            return
        if wrap or nxt > i:
            self._start(nxt)

    def _start(self, i: int) -> None:
        used = set(self._slot_of.values())
        free = [s for s in range(len(self.slots)) if s not in used]
        if not free:
            raise ReapError("streamed-layer ring has no free slot", EXIT_FAILURE)
        self._slot_of[i] = free[0]
        self._ready[i] = threading.Event()
        if self._pool is not None and i != self._current:
            self._pool.submit(self._load, i, free[0])
        else:
            self._load(i, free[0])

    def _load(self, i: int, slot: int) -> None:
        try:
            tensors = self.reader.read_into(self._infos[i], self.slots[slot], "trunk")
            self.check(tensors)  # once per guarded tensor: later passes return at once
            self._result[i] = _to(tensors, self.device)
        except Exception as e:  # noqa: BLE001  (re-raised in the compute thread by get())
            self._result[i] = e
        self._ready[i].set()

    def drain(self) -> None:
        """Wait for any read in flight (before closing or measuring)."""
        for ev in list(self._ready.values()):
            ev.wait()

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.slots, self.pinned = [], {}


def embedding_table(reader: BufferReader, name: str, pin: bool,
                    trunk: TrunkStore) -> torch.Tensor | None:  # fmt: skip
    """The embedding table when it is resident: part of a pinned unit (a table tied to the
    head) or, when the plan pins it (`pin`), read now onto huge pages; None: each step reads
    the rows of its tokens."""
    for unit in trunk.pinned.values():
        if name in unit:
            return unit[name]
    if not pin:
        return None
    info = reader.info(name)
    return reader.read_into([info], weight_buffer(reader.span([info]), False), "embed")[name]


def _slot(nbytes: int, device: str) -> torch.Tensor:
    """A ring slot, touched (no page faults later): page-locked for a GPU, so each copy is one
    DMA; on huge pages for the CPU (`reap.engine.pages`)."""
    if str(device).startswith("cuda"):
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return weight_buffer(nbytes)


def _to(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    if device == "cpu":
        return tensors
    return {k: v.to(device, non_blocking=False) for k, v in tensors.items()}
