"""Weight residency for the streaming engine: positioned reads into preallocated buffers, the
pinned trunk and the streamed-layer ring with a background reader (the routed-expert cache is
in `reap.engine.experts`).

    reader = Reader(checkpoint.tensors, direct=False)  # preadv into caller buffers, I/O counters
    trunk = TrunkStore(reader, units, pinned, slots=2, slot_bytes=...)
    weights = trunk.get(i)                           # unit i's tensors; unit i+1.. read meanwhile

Reads go straight into long-lived buffers (ring slots, expert-cache slabs) so steady-state
decoding allocates nothing and the resident set stays inside the memory plan. `TensorInfo`
offsets come from `reap.checkpoint`, the only code that parses the files.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reap.checkpoint import DTYPE_SIZES, TORCH_DTYPES, TensorInfo
from reap.errors import EXIT_FAILURE, ReapError

_ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses


@dataclass
class IOCounters:
    """Bytes and seconds spent reading, by kind ("trunk", "experts", "embed")."""

    bytes: dict[str, int] = field(default_factory=lambda: {"trunk": 0, "experts": 0, "embed": 0})
    reads: int = 0
    seconds: float = 0.0  # time inside read calls (any thread)
    stall: float = 0.0  # time the compute thread waited for the ring

    def snapshot(self) -> dict:
        return {
            "bytes": dict(self.bytes),
            "reads": self.reads,
            "seconds": self.seconds,
            "stall": self.stall,
        }


class Reader:
    """Positioned reads of checkpoint byte ranges into caller-provided uint8 buffers
    (`ensure(file, start, end)`, when given, makes the bytes present first: remote checkpoints).

    Ranges adjacent in one file are coalesced into a single read. With `direct=True` files are
    opened with O_DIRECT (page-cache bypass) where the filesystem allows it; reads then cover
    4096-aligned supersets of each run."""

    def __init__(self, tensors: dict[str, TensorInfo], direct: bool = False, ensure=None):
        self.tensors, self.ensure = tensors, ensure
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.io = IOCounters()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ReapError(f"tensor {name!r} is not in the checkpoint", EXIT_FAILURE) from None

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._open(path)
                self._fds[path] = fd
            return fd

    def _open(self, path: str) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self.direct = False  # filesystem without O_DIRECT (tmpfs): plain reads
        return os.open(path, os.O_RDONLY)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    @staticmethod
    def runs(infos: Sequence[TensorInfo]) -> list[list[TensorInfo]]:
        """Group tensors into runs that are contiguous in one file (in the given order)."""
        out: list[list[TensorInfo]] = []
        for t in infos:
            if out and out[-1][-1].file == t.file and out[-1][-1].end == t.start:
                out[-1].append(t)
            else:
                out.append([t])
        return out

    def span(self, infos: Sequence[TensorInfo]) -> int:
        """Buffer bytes `read_into` needs for these tensors (alignment slack included)."""
        if self.direct:
            return sum(r[-1].end - r[0].start + 2 * _ALIGN for r in self.runs(infos)) + _ALIGN
        return sum(r[-1].end - r[0].start + 128 for r in self.runs(infos)) + 64

    def read_into(
        self, infos: Sequence[TensorInfo], buf: torch.Tensor, kind: str
    ) -> dict[str, torch.Tensor]:
        """Read tensors into `buf` (uint8 [n] with n >= span(infos)) and return name -> view.

        Each run of contiguous tensors is one positioned read; a view whose address is not a
        multiple of its element size is copied (safetensors does not align tensors)."""
        out: dict[str, torch.Tensor] = {}
        align = _ALIGN if self.direct else 64
        pos = (-buf.data_ptr()) % align  # aligned start (O_DIRECT needs 4096)
        for run in self.runs(infos):
            start, end = run[0].start, run[-1].end
            lo = start - start % align  # the buffer keeps the file's alignment mod `align`
            hi = -(-end // _ALIGN) * _ALIGN if self.direct else end
            if pos + hi - lo > buf.numel():
                raise ReapError(
                    f"read buffer too small for {run[0].name} ({hi - lo} bytes)", EXIT_FAILURE
                )
            self._pread(run[0].file, buf[pos : pos + hi - lo], lo, end - lo, kind)
            for t in run:
                out[t.name] = _view(buf, pos + t.start - lo, t)
            pos += -(-(hi - lo) // align) * align
        return out

    def _pread(self, path: str, dst: torch.Tensor, offset: int, need: int, kind: str) -> None:
        if self.ensure is not None:  # remote checkpoints fetch missing bytes first
            self.ensure(path, offset, offset + need)
        fd = self._fd(path)
        mv = memoryview(dst.numpy()).cast("B")
        t0 = time.perf_counter()
        got = 0
        try:
            while got < len(mv):
                n = os.preadv(fd, [mv[got:]], offset + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            raise ReapError(
                f"{path}: read at {offset} failed ({e.strerror})", EXIT_FAILURE
            ) from None
        dt = time.perf_counter() - t0
        if got < need:
            raise ReapError(
                f"{path}: short read at offset {offset} ({got} of {need} bytes; file truncated?)",
                EXIT_FAILURE,
            )
        with self._lock:
            self.io.bytes[kind] = self.io.bytes.get(kind, 0) + need
            self.io.reads += 1
            self.io.seconds += dt

    def read(self, names: Sequence[str], kind: str) -> dict[str, torch.Tensor]:
        """Read tensors into a fresh buffer (for one-off reads)."""
        infos = [self.info(n) for n in names]
        buf = torch.empty(self.span(infos), dtype=torch.uint8)
        return self.read_into(infos, buf, kind)

    def read_rows(self, name: str, rows: Sequence[int], kind: str = "embed") -> torch.Tensor:
        """Rows of a 2-D tensor [R, C], one positioned read per row: [len(rows), C]."""
        t = self.info(name)
        width = t.shape[1] * DTYPE_SIZES[t.dtype]
        infos = []
        for r in rows:
            if not 0 <= r < t.shape[0]:
                raise ReapError(f"row {r} outside {name} with {t.shape[0]} rows")
            infos.append(
                TensorInfo(
                    t.name,
                    t.key,
                    t.dtype,
                    (t.shape[1],),
                    t.file,
                    t.start + r * width,
                    t.start + (r + 1) * width,
                )
            )
        span = self.span(infos[:1]) if infos else 0
        out = torch.empty((len(rows), span), dtype=torch.uint8)
        views = [self.read_into([info], out[i], kind)[t.name] for i, info in enumerate(infos)]
        return (
            torch.stack(views)
            if views
            else torch.empty((0, t.shape[1]), dtype=TORCH_DTYPES[t.dtype])
        )


def _view(buf: torch.Tensor, offset: int, t: TensorInfo) -> torch.Tensor:
    """Tensor `t` viewed inside `buf` at byte `offset` (copied when misaligned)."""
    raw = buf[offset : offset + t.nbytes]
    itemsize = DTYPE_SIZES[t.dtype]
    if (raw.data_ptr() % itemsize) != 0:
        raw = raw.clone()
    return raw.view(TORCH_DTYPES[t.dtype]).reshape(t.shape)


class TrunkStore:
    """Trunk units (decoder layers without routed experts, and the head): pinned ones read once
    and kept; the others stream through a ring of `slots` buffers, the next streamed unit read
    by a background thread while the current one computes.

    Units are consumed in cyclic order 0, 1, ..., n-1, 0, ...; `get(i)` releases the slot of the
    previously fetched streamed unit (its tensors must no longer be used)."""

    def __init__(
        self,
        reader: Reader,
        units: list[list[str]],
        pinned: Sequence[int],
        slots: int = 2,
        slot_bytes: int = 0,
        device: str = "cpu",
    ):
        self.reader, self.units, self.device = reader, units, device
        self.pinned: dict[int, dict[str, torch.Tensor]] = {}
        self.streamed = [i for i in range(len(units)) if i not in set(pinned)]
        for i in pinned:
            self.pinned[i] = _to(reader.read(units[i], "trunk"), device)
        self._infos = [[reader.info(n) for n in names] for names in units]
        need = max((reader.span(self._infos[i]) for i in self.streamed), default=0)
        self.slots = [
            torch.zeros(max(need, slot_bytes), dtype=torch.uint8)  # touched: no page faults later
            for _ in range(slots if self.streamed else 0)
        ]
        self._slot_of: dict[int, int] = {}  # streamed unit -> slot holding (or reading) it
        self._ready: dict[int, threading.Event] = {}
        self._result: dict[int, dict[str, torch.Tensor] | BaseException] = {}
        self._current: int | None = None
        self._pool = None
        if len(self.slots) > 1:
            from concurrent.futures import ThreadPoolExecutor

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
        self.reader.io.stall += time.perf_counter() - t0
        result = self._result.pop(i)
        if isinstance(result, BaseException):
            self._slot_of.pop(i, None)
            raise result
        self._prefetch_after(i, wrap)
        return result

    def _next_streamed(self, i: int) -> int | None:
        later = [j for j in self.streamed if j > i] or self.streamed
        nxt = later[0] if later else None
        return None if nxt is None or nxt == i else nxt

    def _prefetch_after(self, i: int, wrap: bool) -> None:
        nxt = self._next_streamed(i)
        if (
            nxt is not None
            and (wrap or nxt > i)
            and nxt not in self._slot_of
            and self._pool is not None
        ):
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


def _to(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    if device == "cpu":
        return tensors
    return {k: v.to(device, non_blocking=False) for k, v in tensors.items()}
