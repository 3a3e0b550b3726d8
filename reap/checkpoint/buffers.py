"""Reads of a checkpoint's tensors into long-lived caller buffers: the streaming engine's layer
on `Checkpoint` (ring slots, expert-cache slabs), so steady-state decoding allocates nothing.

    reader = BufferReader(checkpoint, direct=False, kinds=("trunk", "experts"))
    need = reader.span(infos)                        # buffer bytes, alignment slack included
    views = reader.read_into(infos, buf, "experts")  # name -> tensor viewing buf
    reader.io.bytes["experts"], reader.io.reads, reader.io.seconds

Runs of byte-adjacent tensors are one positioned read each; `direct=True` opens files with
O_DIRECT (page-cache bypass) where the file system allows it, else falls back to buffered
reads. Remote checkpoints fetch missing bytes first (`Checkpoint.ensure`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from reap.checkpoint.files import (
    ALIGN,
    HAS_DIRECT,
    FileHandles,
    adjacent_runs,
    aligned,
    pread_full,
    tensor_view,
)
from reap.checkpoint.reader import Checkpoint
from reap.checkpoint.spec import DTYPE_SIZES, TORCH_DTYPES, TensorInfo
from reap.errors import EXIT_FAILURE, ReapError

_BUFFERED_ALIGN = 64  # where buffered runs start inside a buffer (cache-line aligned)


@dataclass
class IOCounters:
    """Bytes read by kind (as named by the caller), positioned reads, seconds inside them (any
    thread)."""

    bytes: dict[str, int] = field(default_factory=dict)
    reads: int = 0
    seconds: float = 0.0


class BufferReader:
    """Positioned reads of a checkpoint's tensors into caller-provided uint8 buffers (see the
    module docstring). `kinds` are the byte counters that start at zero."""

    def __init__(self, checkpoint: Checkpoint, direct: bool = False, kinds: Iterable[str] = ()):
        self.checkpoint, self.tensors = checkpoint, checkpoint.tensors
        self.direct = direct and HAS_DIRECT
        self.io = IOCounters(dict.fromkeys(kinds, 0))
        self._handles = FileHandles()  # never evicted: reads run in several threads
        self._lock = threading.Lock()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ReapError(f"tensor {name!r} is not in the checkpoint", EXIT_FAILURE) from None

    def _fd(self, path: str) -> int:
        if self.direct:
            try:
                return self._handles.get(path, direct=True)
            except OSError:
                self.direct = False  # file system without O_DIRECT (tmpfs): plain reads
        return self._handles.get(path)

    def close(self) -> None:
        self._handles.close()

    def span(self, infos: Sequence[TensorInfo]) -> int:
        """Buffer bytes `read_into` needs for these tensors (alignment slack included)."""
        runs = adjacent_runs(infos)
        if self.direct:
            return sum(r[-1].end - r[0].start + 2 * ALIGN for r in runs) + ALIGN
        return sum(r[-1].end - r[0].start + 2 * _BUFFERED_ALIGN for r in runs) + _BUFFERED_ALIGN

    def read_into(
        self, infos: Sequence[TensorInfo], buf: torch.Tensor, kind: str
    ) -> dict[str, torch.Tensor]:
        """Read tensors into `buf` (uint8 [n] with n >= span(infos)) and return name -> view.

        Each run of contiguous tensors (in the given order) is one positioned read; a view whose
        address is not a multiple of its element size is copied."""
        out: dict[str, torch.Tensor] = {}
        align = ALIGN if self.direct else _BUFFERED_ALIGN
        pos = (-buf.data_ptr()) % align  # aligned start (O_DIRECT needs 4096)
        for run in adjacent_runs(infos):
            start, end = run[0].start, run[-1].end
            lo = start - start % align  # the buffer keeps the file's alignment mod `align`
            hi = aligned(start, end)[1] if self.direct else end
            if pos + hi - lo > buf.numel():
                raise ReapError(
                    f"read buffer too small for {run[0].name} ({hi - lo} bytes)", EXIT_FAILURE
                )
            self._pread(run[0].file, buf[pos : pos + hi - lo], lo, end - lo, kind)
            for t in run:
                out[t.name] = tensor_view(buf, pos + t.start - lo, t)
            pos += -(-(hi - lo) // align) * align
        return out

    def _pread(self, path: str, dst: torch.Tensor, offset: int, need: int, kind: str) -> None:
        self.checkpoint.ensure(path, offset, offset + need)
        fd = self._fd(path)
        t0 = time.perf_counter()
        try:
            got = pread_full(fd, dst, offset)
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
            start = t.start + r * width
            infos.append(t._replace(shape=(t.shape[1],), start=start, end=start + width))
        span = self.span(infos[:1]) if infos else 0
        out = torch.empty((len(rows), span), dtype=torch.uint8)  # [len(rows), span]
        views = [self.read_into([info], out[i], kind)[t.name] for i, info in enumerate(infos)]
        if not views:
            return torch.empty((0, t.shape[1]), dtype=TORCH_DTYPES[t.dtype])
        return torch.stack(views)  # [len(rows), C]
