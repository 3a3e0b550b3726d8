"""Reads of a checkpoint's tensors into long-lived caller buffers: the streaming engine's layer
on `Checkpoint` (ring slots, expert-cache slabs), so steady-state decoding allocates nothing.

    reader = BufferReader(checkpoint, direct=False, kinds=("trunk", "experts"))
    views = reader.read_into(infos, buf, "experts")  # name -> tensor viewing buf

Reads go through descriptors of the reader's own (never closed while reads run in other
threads); remote checkpoints fetch missing bytes first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from reap.checkpoint.files import RunReader
from reap.checkpoint.reader import Checkpoint
from reap.checkpoint.spec import TORCH_DTYPES, TensorInfo
from reap.errors import EXIT_FAILURE, ReapError


@dataclass
class IOCounters:
    """Bytes asked for by kind (named by the caller), positioned reads, seconds inside them."""

    bytes: dict[str, int] = field(default_factory=dict)
    reads: int = 0
    seconds: float = 0.0


class BufferReader(RunReader):
    """Positioned reads of `checkpoint`'s tensors into caller-provided uint8 buffers (see the
    module docstring); `kinds` are the byte counters that start at zero."""

    read_failure_code = EXIT_FAILURE

    def __init__(self, checkpoint: Checkpoint, direct: bool = False, kinds: Iterable[str] = ()):
        super().__init__(direct)
        self.checkpoint, self.tensors = checkpoint, checkpoint.tensors
        self.io = IOCounters(dict.fromkeys(kinds, 0))
        self._lock = threading.Lock()

    def ensure(self, file: str, start: int, end: int) -> None:
        self.checkpoint.ensure(file, start, end)

    def _count(self, kind: str, need: int, got: int, seconds: float) -> None:
        with self._lock:
            self.io.bytes[kind] = self.io.bytes.get(kind, 0) + need
            self.io.reads += 1
            self.io.seconds += seconds

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ReapError(f"tensor {name!r} is not in the checkpoint", EXIT_FAILURE) from None

    def read(self, names: Sequence[str], kind: str) -> dict[str, torch.Tensor]:
        """Read tensors into a fresh buffer (for one-off reads)."""
        infos = [self.info(n) for n in names]
        return self.read_into(infos, torch.empty(self.span(infos), dtype=torch.uint8), kind)

    def read_rows(self, name: str, rows: Sequence[int], kind: str = "embed") -> torch.Tensor:
        """Rows of a 2-D tensor [R, C], one positioned read per row: [len(rows), C]."""
        t = self.info(name)
        width = t.nbytes // t.shape[0] if t.shape[0] else 0  # bytes per row
        infos = []
        for r in rows:
            if not 0 <= r < t.shape[0]:
                raise ReapError(f"row {r} outside {name} with {t.shape[0]} rows")
            start = t.start + r * width
            infos.append(t._replace(shape=(t.shape[1],), start=start, end=start + width))
        out = torch.empty((len(rows), t.shape[1]), dtype=TORCH_DTYPES[t.dtype])
        if not infos:
            return out
        if not self.direct:  # straight into the result (a decode step reads one row)
            raw = out.view(torch.uint8).reshape(len(rows), width)
            for i, info in enumerate(infos):
                self._read([info], [raw[i]], info.start, width, kind)
            return out
        buf = torch.empty((len(rows), self.span(infos[:1])), dtype=torch.uint8)
        views = [self.read_into([info], buf[i], kind)[t.name] for i, info in enumerate(infos)]
        return torch.stack(views, out=out)  # [len(rows), C]
