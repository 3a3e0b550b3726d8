"""Positioned reads of tensor bytes, done one way for every reader: cached file descriptors,
the `preadv` loop, grouping of byte-adjacent tensors into runs, O_DIRECT with its fallback, and
viewing a tensor inside a byte buffer. `RunReader` puts them together; `Checkpoint` (a fresh
buffer per call) and `BufferReader` (long-lived caller buffers, for the engine) are RunReaders.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterable, Sequence

import torch

from reap.checkpoint.spec import DTYPE_SIZES, TORCH_DTYPES, TensorInfo
from reap.errors import CheckpointError

ALIGN = 4096  # O_DIRECT alignment of file offsets, lengths and buffer addresses
HAS_DIRECT = hasattr(os, "O_DIRECT")
_BUFFERED_ALIGN = 64  # where buffered reads place each tensor inside a buffer (a cache line)
_IOV_MAX = 512  # buffers per preadv call (Linux allows 1024)


def open_regular(path: str | os.PathLike, what: str) -> tuple[int, int]:
    """(read-only descriptor, size) of the regular file at `path`; CheckpointError naming it
    otherwise: a FIFO or device would block or never end (opened non-blocking to find out)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open {what} ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: {what} is not a regular file")
    return fd, st.st_size


def read_regular(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The whole regular file at `path`, refused (CheckpointError) beyond `limit` bytes."""
    fd, size = open_regular(path, what)
    try:
        if size > limit:
            raise CheckpointError(f"{path}: {what} of {size} bytes exceeds the limit of "
                                  f"{limit} bytes")
        return os.pread(fd, size, 0)  # what fstat saw: bounded even if the file grows
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    finally:
        os.close(fd)


def pread_full(fd: int, bufs: Sequence[torch.Tensor], offset: int) -> int:
    """Fill uint8 buffers `bufs`, in order, from one byte range starting at file `offset` with
    positioned reads; short only at end of file. Returns the bytes read."""
    views = [memoryview(b.numpy()).cast("B") for b in bufs]
    done, i = 0, 0
    while i < len(views):
        n = os.preadv(fd, views[i : i + _IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return done


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


def _padded(nbytes: int) -> int:
    return -(-nbytes // _BUFFERED_ALIGN) * _BUFFERED_ALIGN


class RunReader:
    """Reads tensors into a uint8 buffer, one positioned read per run of byte-adjacent ones,
    through cached descriptors: with `direct`, O_DIRECT reads of 4096-aligned supersets into
    aligned places where the file system allows it, else (from then on) buffered reads.

    The base of `Checkpoint` and `BufferReader`. Hooks: `ensure(file, start, end)` makes bytes
    present before they are read (remote backends); `_count` records each read."""

    read_failure_code: int | None = None  # exit code of a failed read (None: CheckpointError's)

    def __init__(self, direct: bool = False, fd_limit: int | None = None):
        self.direct = direct and HAS_DIRECT
        self.reads = 0
        self.bytes_read = 0  # bytes transferred, alignment included
        # descriptors by (file, direct); with fd_limit the oldest is closed to make room, so
        # leave it None where reads run in several threads (one could still be in use)
        self._fds: dict[tuple[str, bool], int] = {}
        self._fd_limit = fd_limit
        self._fd_lock = threading.Lock()

    def ensure(self, file: str, start: int, end: int) -> None:
        """Make bytes [start, end) of `file` present before they are read (a no-op locally)."""

    def _count(self, kind: str, need: int, got: int, seconds: float) -> None:
        self.reads += 1
        self.bytes_read += got

    def close(self) -> None:
        """Close every cached file descriptor (reads reopen them on demand)."""
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def span(self, infos: Sequence[TensorInfo]) -> int:
        """Buffer bytes `read_into` needs for these tensors (alignment slack included)."""
        if not self.direct:
            return sum(_padded(t.nbytes) for t in infos) + _BUFFERED_ALIGN
        return sum(r[-1].end - r[0].start + 2 * ALIGN for r in adjacent_runs(infos)) + ALIGN

    def read_into(self, infos: Sequence[TensorInfo], buf: torch.Tensor,
                  kind: str = "") -> dict[str, torch.Tensor]:
        """Read tensors into `buf` (uint8 [n] with n >= span(infos)); name -> view of `buf`.
        Buffered, every tensor starts on a cache line of `buf` (one read per run scatters it:
        safetensors packs tensors at any offset, and a matrix-vector product streams an
        unaligned row more slowly); with O_DIRECT the buffer keeps the file's alignment mod
        4096. `kind` names the bytes for `_count`."""
        out: dict[str, torch.Tensor] = {}
        place = self._place_direct if self.direct else self._place_buffered
        pos = -buf.data_ptr() % (ALIGN if self.direct else _BUFFERED_ALIGN)
        for run in adjacent_runs(infos):
            pos = place(run, buf, pos, kind, out)
        return out

    def _place_buffered(self, run, buf: torch.Tensor, pos: int, kind: str, out: dict) -> int:
        """Read one run into `buf` from `pos` on, each tensor at the next cache line; returns
        the position after it."""
        places = []
        for t in run:
            places.append(pos)
            pos += _padded(t.nbytes)
        self._check_room(run, pos, buf)
        views = [buf[p : p + t.nbytes] for p, t in zip(places, run) if t.nbytes]
        if views:
            self._read(run, views, run[0].start, run[-1].end - run[0].start, kind)
        for p, t in zip(places, run):
            out[t.name] = tensor_view(buf, p, t)
        return pos

    def _place_direct(self, run, buf: torch.Tensor, pos: int, kind: str, out: dict) -> int:
        """Read one run with O_DIRECT: whole 4096-byte blocks into a 4096-aligned place of
        `buf` (the buffered fallback reads the same blocks there)."""
        start, end = run[0].start, run[-1].end
        lo, hi = start - start % ALIGN, -(-end // ALIGN) * ALIGN
        self._check_room(run, pos + hi - lo, buf)
        if end > start:
            self._read(run, [buf[pos : pos + hi - lo]], lo, end - lo, kind)
        for t in run:
            out[t.name] = tensor_view(buf, pos + t.start - lo, t)
        return pos + hi - lo

    def _check_room(self, run, end: int, buf: torch.Tensor) -> None:
        if end > buf.numel():
            raise CheckpointError(f"read buffer too small for {run[0].name} ({end} bytes needed, "
                                  f"{buf.numel()} given)", self.read_failure_code)

    def _read(self, run: list[TensorInfo], dst: list[torch.Tensor], offset: int, need: int,
              kind: str) -> None:
        file = run[0].file
        what = f"tensors {run[0].key}..{run[-1].key}" if len(run) > 1 else f"tensor {run[0].key}"
        self.ensure(file, offset, offset + need)
        fd, direct = self._fd(file), self.direct
        t0 = time.perf_counter()
        try:
            got = pread_full(fd, dst, offset)
        except OSError as e:
            if direct:  # O_DIRECT refused at read time: buffered from now on
                self.direct = False
                return self._read(run, dst, offset, need, kind)
            raise CheckpointError(f"{file}: cannot read {what} ({e.strerror})",
                                  self.read_failure_code) from None
        if got < need:
            raise CheckpointError(f"{file}: truncated while reading {what} (short read at offset "
                                  f"{offset}: {got} of {need} bytes)", self.read_failure_code)
        self._count(kind, need, got, time.perf_counter() - t0)

    def _fd(self, file: str) -> int:
        direct = self.direct
        with self._fd_lock:
            fd = self._fds.get((file, direct))
            if fd is not None:
                return fd
            if self._fd_limit is not None and len(self._fds) >= self._fd_limit:
                os.close(self._fds.pop(next(iter(self._fds))))
            try:
                # non-blocking: a FIFO put in place of a shard fails the read instead of hanging
                flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_DIRECT if direct else 0)
                fd = os.open(file, flags)
            except OSError as e:
                if not direct:
                    raise CheckpointError(f"{file}: cannot open shard ({e.strerror})",
                                          self.read_failure_code) from None
            else:
                self._fds[(file, direct)] = fd
                return fd
        self.direct = False  # file system without O_DIRECT (tmpfs): buffered reads
        return self._fd(file)
