"""Disk-backed hidden states of all calibration sequences, with per-layer generations for resume.

Calibration runs every sequence through layer L before layer L+1, so the hidden state of every
sequence (for K3: the AttnRes partial sum and block snapshots, plus the MLP input of the current
layer) must be kept between layers. `SpillStore` keeps each named array [S, ...] in its own file
under the work directory and moves only one batch of sequences through RAM at a time (positioned
reads and writes, `os.pread`/`os.pwrite`, so RSS holds the batch and never the file; the page
cache serves re-reads when the state fits in memory). A file is written once per generation and
never modified after `commit`, so a crash mid-layer leaves the last committed layer intact:
`manifest()` / `from_manifest()` restore it.

The model's `State` becomes named arrays with `state_arrays` and is rebuilt with
`state_from_arrays`; the caller skips writing a tensor the model passed through unchanged (the same
object, e.g. an AttnRes block snapshot), so each snapshot is written once.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from reap.errors import WriteError
from reap.models.base import State


def state_arrays(state: State) -> dict[str, torch.Tensor]:
    """A model `State` as named arrays: "hidden" and "blocks.0", "blocks.1", ... (each [B, ...])."""
    return {"hidden": state.hidden, **{f"blocks.{j}": b for j, b in enumerate(state.blocks)}}


def state_from_arrays(arrays: dict[str, torch.Tensor]) -> State:
    """Inverse of `state_arrays` (keys other than hidden/blocks.* are ignored)."""
    n = sum(1 for k in arrays if k.startswith("blocks."))
    return State(arrays["hidden"], [arrays[f"blocks.{j}"] for j in range(n)])


@dataclasses.dataclass
class _Array:
    """One named array [S, *row_shape] stored row-major in `file`."""

    file: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        n = torch.Size(self.row_shape).numel()
        return n * torch.empty((), dtype=self.dtype).element_size()


class SpillStore:
    """Named arrays [S, ...] over S sequences, one file each in `work_dir`.

    Reads come from the committed generation; `write` goes to pending files tagged `gen`
    (e.g. "a12" for after attention of layer 12) which `commit` makes current. Keys not written
    in a generation keep their committed file.
    """

    def __init__(self, work_dir: str, n_seq: int):
        self.work_dir, self.n_seq = work_dir, n_seq
        os.makedirs(work_dir, exist_ok=True)
        self.current: dict[str, _Array] = {}
        self.pending: dict[str, _Array] = {}
        self._fds: dict[str, int] = {}
        self._rows_written: dict[str, int] = {}
        self.bytes_written = 0

    def keys(self) -> list[str]:
        """Names of the committed arrays."""
        return list(self.current)

    def nbytes(self, key: str) -> int:
        """Bytes of one array over all sequences."""
        return self.current[key].row_bytes * self.n_seq

    def read(self, key: str, s0: int, s1: int) -> torch.Tensor:
        """Rows s0..s1-1 of a committed array: [s1 - s0, *row_shape] (a fresh CPU tensor)."""
        a = self.current[key]
        n = (s1 - s0) * a.row_bytes
        buf = bytearray(n)
        got = os.preadv(self._fd(a.file), [buf], s0 * a.row_bytes)
        if got != n:
            raise RuntimeError(f"spill file {a.file} is short: {got} of {n} bytes at row {s0}")
        return torch.frombuffer(buf, dtype=torch.uint8).view(a.dtype).view(s1 - s0, *a.row_shape)

    def write(self, key: str, s0: int, value: torch.Tensor, gen: str) -> None:
        """Store rows s0.. of `value` [B, ...] into the pending generation `gen` of `key`."""
        value = value.detach().to("cpu").contiguous()
        a = self.pending.get(key)
        if a is None:
            safe = key.replace("/", "_")
            a = _Array(os.path.join(self.work_dir, f"{safe}.{gen}.bin"), value.dtype,
                       tuple(value.shape[1:]))
            self.pending[key] = a
            self._rows_written[key] = 0
            fd = self._fd(a.file, create=True)
            os.ftruncate(fd, a.row_bytes * self.n_seq)
        if (value.dtype, tuple(value.shape[1:])) != (a.dtype, a.row_shape):
            raise RuntimeError(f"state {key!r} changed shape or dtype within a layer")
        data = value.view(torch.uint8).numpy()
        try:
            os.pwrite(self._fd(a.file), memoryview(data).cast("B"), s0 * a.row_bytes)
        except OSError as e:
            raise WriteError(f"cannot write hidden-state spill {a.file}: {e.strerror}") from e
        self._rows_written[key] += value.shape[0]
        self.bytes_written += data.nbytes

    def commit(self, durable: bool = False) -> None:
        """Make pending arrays current (all their rows must have been written)."""
        for key, a in self.pending.items():
            if self._rows_written[key] != self.n_seq:
                raise RuntimeError(f"state {key!r} written for {self._rows_written[key]} of "
                                   f"{self.n_seq} sequences")
            if durable:
                os.fsync(self._fd(a.file))
        old = {a.file for a in self.current.values()}
        self.current.update(self.pending)
        self.pending, self._rows_written = {}, {}
        for f in old - {a.file for a in self.current.values()}:
            self._close(f)

    def manifest(self) -> dict:
        """JSON-able description of the committed arrays (for resume)."""
        return {k: {"file": os.path.basename(a.file), "dtype": str(a.dtype).split(".")[-1],
                    "row_shape": list(a.row_shape)} for k, a in self.current.items()}

    @classmethod
    def from_manifest(cls, work_dir: str, n_seq: int, manifest: dict) -> SpillStore:
        """Reopen the committed arrays of an earlier run."""
        store = cls(work_dir, n_seq)
        for k, m in manifest.items():
            a = _Array(os.path.join(work_dir, m["file"]), getattr(torch, m["dtype"]),
                       tuple(m["row_shape"]))
            if not os.path.exists(a.file) or os.path.getsize(a.file) != a.row_bytes * n_seq:
                raise RuntimeError(f"spill file {a.file} is missing or has the wrong size")
            store.current[k] = a
        return store

    def cleanup(self) -> None:
        """Delete every file in the work directory not referenced by the committed generation."""
        keep = {os.path.basename(a.file) for a in self.current.values()}
        for name in os.listdir(self.work_dir):
            if name.endswith(".bin") and name not in keep:
                self._close(os.path.join(self.work_dir, name))
                os.remove(os.path.join(self.work_dir, name))

    def close(self) -> None:
        for f in list(self._fds):
            self._close(f)

    def _fd(self, file: str, create: bool = False) -> int:
        fd = self._fds.get(file)
        if fd is None:
            flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
            try:
                fd = self._fds[file] = os.open(file, flags, 0o644)
            except OSError as e:
                raise WriteError(f"cannot open hidden-state spill {file}: {e.strerror}") from e
        return fd

    def _close(self, file: str) -> None:
        fd = self._fds.pop(file, None)
        if fd is not None:
            os.close(fd)
