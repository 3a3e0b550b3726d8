"""Positioned-read primitives shared by every checkpoint reader: cached file descriptors (with
the O_DIRECT fallback), the `preadv` loop, grouping of byte-adjacent tensors into runs, and
viewing a tensor inside a byte buffer.

`Checkpoint` (one fresh buffer per read) and `BufferReader` (reads into long-lived caller
buffers, for the engine) are both built from these, so a read is done one way everywhere.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import torch

from reap.checkpoint.spec import DTYPE_SIZES, TORCH_DTYPES, TensorInfo

ALIGN = 4096  # O_DIRECT alignment of file offsets, lengths and buffer addresses
HAS_DIRECT = hasattr(os, "O_DIRECT")


class FileHandles:
    """Read-only descriptors by (file, direct), opened on first use and kept (safe to share
    between threads). With `limit`, the oldest is closed when a new one would exceed it; leave
    it None where reads run in several threads (a closed descriptor could still be in use)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._fds: dict[tuple[str, bool], int] = {}
        self._lock = threading.Lock()

    def get(self, file: str, direct: bool = False) -> int:
        """The descriptor of `file` (opened with O_DIRECT when `direct`); OSError if it cannot
        be opened (a file system without O_DIRECT refuses it: callers fall back)."""
        with self._lock:
            fd = self._fds.get((file, direct))
            if fd is None:
                if self.limit is not None and len(self._fds) >= self.limit:
                    os.close(self._fds.pop(next(iter(self._fds))))
                flags = os.O_RDONLY | (os.O_DIRECT if direct and HAS_DIRECT else 0)
                fd = self._fds[(file, direct)] = os.open(file, flags)
            return fd

    def close(self) -> None:
        """Close every descriptor (later reads reopen them)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def pread_full(fd: int, buf: torch.Tensor, offset: int) -> int:
    """Fill uint8 `buf` from file `offset` with positioned reads; short only at end of file.
    Returns the bytes read."""
    view, done = memoryview(buf.numpy()).cast("B"), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def aligned(start: int, end: int) -> tuple[int, int]:
    """[start, end) widened to whole ALIGN blocks (what an O_DIRECT read must cover)."""
    return start // ALIGN * ALIGN, -(-end // ALIGN) * ALIGN


def adjacent_runs(infos: Iterable[TensorInfo]) -> list[list[TensorInfo]]:
    """Group tensors, in the given order, into runs of byte-adjacent ranges in one file (each
    run is read with one positioned read)."""
    runs: list[list[TensorInfo]] = []
    for t in infos:
        if runs and runs[-1][-1].file == t.file and runs[-1][-1].end == t.start:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def tensor_view(buf: torch.Tensor, offset: int, info: TensorInfo) -> torch.Tensor:
    """Tensor `info` viewed inside uint8 `buf` at byte `offset`; copied when its address is not
    a multiple of its element size (safetensors does not align tensors)."""
    dtype = TORCH_DTYPES[info.dtype]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    raw = buf[offset : offset + info.nbytes]  # [nbytes] uint8
    if raw.data_ptr() % DTYPE_SIZES[info.dtype]:
        raw = raw.clone()
    return raw.view(dtype).reshape(info.shape)
