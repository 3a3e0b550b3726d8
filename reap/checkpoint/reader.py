"""Checkpoint reader: index safetensors shards from their headers alone, then fetch tensors by
name with positioned reads (one `pread` per tensor, or per run of adjacent tensors).

    with Checkpoint.open("path/to/model") as ck:     # HF dir, dir with model.safetensors, or file
        w = ck.read("model.layers.3.mlp.gate.weight")
        expert = ck.read_many(names_of_one_expert)      # contiguous: one read
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from reap.checkpoint.spec import (
    DTYPE_SIZES,
    INDEX_NAME,
    SINGLE_NAME,
    TEXT_PREFIX,
    TORCH_DTYPES,
    TensorInfo,
)
from reap.errors import CheckpointError

_FIRST_READ = 1 << 16  # header bytes fetched speculatively with the length prefix
_ALIGN = 4096  # O_DIRECT offset/length/buffer alignment


def file_size(path: str | os.PathLike) -> int:
    """Size of a file in bytes (CheckpointError if it is missing)."""
    try:
        return os.stat(path).st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot stat ({e.strerror})") from None


def _numel(shape: list) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _read_header(path: str) -> tuple[dict, int, int]:
    """Parse one shard's header -> (header dict, data start offset, file size)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open shard ({e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _FIRST_READ, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors header ({size} bytes)")
        (n,) = struct.unpack("<Q", head[:8])
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} beyond file size {size}")
        raw = (
            head[8 : 8 + n]
            if 8 + n <= len(head)
            else head[8:] + os.pread(fd, n - len(head) + 8, len(head))
        )
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid safetensors JSON header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n, size


def _shard_infos(path: str, prefixed: bool | None) -> tuple[list[TensorInfo], bool]:
    """Validated TensorInfos of one shard, names stripped of the text prefix when `prefixed`
    (None: decide from this shard's keys). Returns (infos, prefixed)."""
    header, base, size = _read_header(path)
    header.pop("__metadata__", None)
    if prefixed is None:
        prefixed = any(k.startswith(TEXT_PREFIX) for k in header)
    region, cut, out = size - base, len(TEXT_PREFIX), []
    for key, entry in header.items():
        try:
            dtype, shape, (b, e) = entry["dtype"], entry["shape"], entry["data_offsets"]
            itemsize = DTYPE_SIZES.get(dtype)
            if itemsize is None:
                raise CheckpointError(f"{path}: tensor {key}: unknown dtype {dtype!r}")
            if not 0 <= b <= e <= region:
                raise CheckpointError(
                    f"{path}: tensor {key}: offsets [{b}, {e}] outside the "
                    f"data region of {region} bytes"
                )
            if e - b != _numel(shape) * itemsize or min(shape, default=0) < 0:
                raise CheckpointError(
                    f"{path}: tensor {key}: {e - b} bytes do not hold {dtype} {shape}"
                )
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {key}: malformed header entry") from None
        name = key[cut:] if prefixed and key.startswith(TEXT_PREFIX) else key
        out.append(TensorInfo(name, key, dtype, tuple(shape), path, base + b, base + e))
    _check_overlaps(path, out)
    return out, prefixed


def _check_overlaps(path: str, infos: list[TensorInfo]) -> None:
    spans = sorted((t.start, t.end, t.key) for t in infos)
    for (_, e0, k0), (b1, _, k1) in itertools.pairwise(spans):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {k0} and {k1} overlap")


def _load_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON in {what} ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


def _layout(path: Path) -> tuple[list[str], dict[str, str] | None, dict]:
    """A checkpoint path -> (shard files, index weight_map or None, config dict)."""
    if path.is_file():
        return [str(path)], None, {}
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    config_path = path / "config.json"
    config = _load_json(config_path, "config") if config_path.exists() else {}
    index_path = path / INDEX_NAME
    if index_path.exists():
        weight_map = _load_json(index_path, "index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: index has no weight_map")
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise CheckpointError(f"{index_path}: shard {f} is missing")
        return [str(path / f) for f in files], weight_map, config
    if (path / SINGLE_NAME).is_file():
        return [str(path / SINGLE_NAME)], None, config
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def _index_mismatch(index: str, weight_map: dict, tensors: dict, prefix: str) -> str:
    stored = {t.key: os.path.basename(t.file) for t in tensors.values()}
    for key, shard in weight_map.items():
        if stored.get(key) != shard:
            return f"{index}: index places tensor {key} in {shard}, but that shard lacks it"
    for key, shard in stored.items():
        if key not in weight_map:
            return f"{index}: tensor {key} in {shard} is not listed in the index"
    return f"{index}: duplicate tensor names after removing the {prefix!r} prefix"


class Checkpoint:
    """A lazily indexed safetensors checkpoint (see the module docstring).

    Attributes: path, config (config.json or {}), prefix ("language_model." or ""),
    tensors (name -> TensorInfo), bytes_read and reads (I/O counters of the tensor reads)."""

    def __init__(
        self,
        path: str,
        config: dict,
        prefix: str,
        tensors: dict[str, TensorInfo],
        direct: bool = False,
    ):
        self.path, self.config, self.prefix, self.tensors = path, config, prefix, tensors
        self.direct = direct
        self.bytes_read = 0
        self.reads = 0
        self._fds: dict[tuple[str, bool], int] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, direct: bool = False) -> Checkpoint:
        """Index a checkpoint directory or `.safetensors` file from its headers alone.

        direct=True reads tensor bytes with O_DIRECT (bypassing the page cache) where the file
        system supports it, and silently falls back to buffered reads where it does not."""
        p = Path(path)
        files, weight_map, config = _layout(p)
        prefixed = None
        if weight_map is not None:
            prefixed = any(k.startswith(TEXT_PREFIX) for k in weight_map)
        tensors: dict[str, TensorInfo] = {}
        count = 0
        for f in files:
            infos, prefixed = _shard_infos(f, prefixed)
            count += len(infos)
            tensors.update((t.name, t) for t in infos)
        prefix = TEXT_PREFIX if prefixed else ""
        if len(tensors) != count or (weight_map is not None and len(weight_map) != count):
            raise CheckpointError(
                _index_mismatch(str(p / INDEX_NAME), weight_map or {}, tensors, prefix)
            )
        if weight_map is not None:
            for t in tensors.values():
                if weight_map.get(t.key) != os.path.basename(t.file):
                    raise CheckpointError(
                        _index_mismatch(str(p / INDEX_NAME), weight_map, tensors, prefix)
                    )
        return cls(str(p), config, prefix, tensors, direct=direct)

    # ---- file descriptors ----------------------------------------------------------------------

    def _fd(self, file: str, direct: bool) -> int:
        fd = self._fds.get((file, direct))
        if fd is None:
            if len(self._fds) >= 256:  # keep the cache small: drop the oldest
                os.close(self._fds.pop(next(iter(self._fds))))
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
            try:
                fd = os.open(file, flags)
            except OSError as e:
                if direct:
                    raise
                raise CheckpointError(f"{file}: cannot open shard ({e.strerror})") from None
            self._fds[(file, direct)] = fd
        return fd

    def close(self) -> None:
        """Close every cached file descriptor (reads reopen them on demand)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading -------------------------------------------------------------------------------

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name}") from None

    def _pread(self, fd: int, buf: torch.Tensor, offset: int) -> int:
        """Fill uint8 buf from offset (short only at end of file); returns the bytes read."""
        view, done = memoryview(buf.numpy()), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        self.reads += 1
        self.bytes_read += done
        return done

    def _read_span(self, file: str, start: int, end: int, what: str) -> tuple[torch.Tensor, int]:
        """Bytes [start, end) of file -> (uint8 buffer, offset of `start` in it)."""
        if end == start:
            return torch.empty(0, dtype=torch.uint8), 0
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                return self._read_span_direct(file, start, end)
            except OSError:
                self.direct = False  # file system without O_DIRECT: buffered from now on
        buf = torch.empty(end - start, dtype=torch.uint8)
        try:
            got = self._pread(self._fd(file, False), buf, start)
        except OSError as e:
            raise CheckpointError(f"{file}: cannot read {what} ({e.strerror})") from None
        if got < end - start:
            raise CheckpointError(f"{file}: truncated while reading {what}")
        return buf, 0

    def _read_span_direct(self, file: str, start: int, end: int) -> tuple[torch.Tensor, int]:
        lo, hi = start // _ALIGN * _ALIGN, -(-end // _ALIGN) * _ALIGN
        raw = torch.empty(hi - lo + _ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % _ALIGN  # O_DIRECT needs an aligned buffer
        buf = raw[skip : skip + hi - lo]
        got = self._pread(self._fd(file, True), buf, lo)
        if got < end - lo:
            raise OSError("short O_DIRECT read")
        return buf, start - lo

    @staticmethod
    def _view(buf: torch.Tensor, offset: int, info: TensorInfo) -> torch.Tensor:
        dtype = TORCH_DTYPES[info.dtype]
        chunk = buf[offset : offset + info.nbytes]  # [nbytes] uint8
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        if offset % DTYPE_SIZES[info.dtype]:
            chunk = chunk.clone()  # an unaligned element type cannot be viewed in place
        return chunk.view(dtype).reshape(info.shape)

    def read(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """One tensor by name (without prefix), read with a single positioned read."""
        info = self._info(name)
        buf, off = self._read_span(info.file, info.start, info.end, f"tensor {info.key}")
        return self._view(buf, off, info).to(device)

    def read_raw(self, name: str) -> bytes:
        """The stored bytes of one tensor, verbatim."""
        info = self._info(name)
        buf, off = self._read_span(info.file, info.start, info.end, f"tensor {info.key}")
        return buf[off : off + info.nbytes].numpy().tobytes()

    def read_many(
        self, names: Iterable[str], device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Several tensors; byte ranges adjacent in one file are fetched with one read.
        Returns name -> tensor in the order asked."""
        infos = [self._info(n) for n in names]
        out: dict[str, torch.Tensor] = {}
        for run in _adjacent_runs(infos):
            first, last = run[0], run[-1]
            what = f"tensors {first.key}..{last.key}" if len(run) > 1 else f"tensor {first.key}"
            buf, off = self._read_span(first.file, first.start, last.end, what)
            for t in run:
                out[t.name] = self._view(buf, off + t.start - first.start, t).to(device)
        return {t.name: out[t.name] for t in infos}

    # ---- provenance ----------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 (hex) over the sorted (name, dtype, shape, byte length) list and the config:
        a cheap identity for provenance records (it does not hash tensor bytes)."""
        h = hashlib.sha256()
        rows = sorted((t.name, t.dtype, list(t.shape), t.nbytes) for t in self.tensors.values())
        h.update(json.dumps(rows, separators=(",", ":")).encode())
        h.update(json.dumps(self.config, sort_keys=True, separators=(",", ":")).encode())
        return h.hexdigest()


def _adjacent_runs(infos: list[TensorInfo]) -> list[list[TensorInfo]]:
    """Group tensors into runs of byte-adjacent ranges within one file (each read once)."""
    ordered = sorted(set(infos), key=lambda t: (t.file, t.start, t.end))
    runs: list[list[TensorInfo]] = []
    for t in ordered:
        last = runs[-1][-1] if runs else None
        if last is not None and last.file == t.file and last.end == t.start:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs
