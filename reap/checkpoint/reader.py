"""Checkpoint reader: index safetensors shards from their headers alone, then fetch tensors by
name with positioned reads (one `pread` per tensor, or per run of adjacent tensors).

    with Checkpoint.open("path/to/model") as ck:     # HF dir, dir with model.safetensors, or file
        w = ck.read("model.layers.3.mlp.gate.weight")
        expert = ck.read_many(names_of_one_expert)      # contiguous: one read
        one = ck.read("model.layers.3.mlp.experts.down_proj[5]")  # slice 5 of a fused tensor
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain, repeat
from pathlib import Path

import torch

from reap.checkpoint.header import (
    Shard,
    count_index_entries,
    load_index,
    load_json,
    parse_shard,
    scan_shard,
)
from reap.checkpoint.spec import (
    DTYPE_SIZES,
    INDEX_NAME,
    SINGLE_NAME,
    TEXT_PREFIX,
    TORCH_DTYPES,
    TensorInfo,
    split_view,
    view_name,
)
from reap.errors import CheckpointError

_ALIGN = 4096  # O_DIRECT offset/length/buffer alignment


def file_size(path: str | os.PathLike) -> int:
    """Size of a file in bytes (CheckpointError if it is missing)."""
    try:
        return os.stat(path).st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot stat ({e.strerror})") from None


class TensorTable(Mapping[str, TensorInfo]):
    """name -> TensorInfo over all shards. Names and membership are known from the scan at open;
    a shard's entries are fully parsed and validated the first time one of them is looked up."""

    def __init__(self, shards: list[Shard], where: dict[str, int], prefixed: bool):
        self._shards, self._where, self._prefixed = shards, where, prefixed

    def _key(self, name: str) -> str:
        """The stored key of tensor `name` (KeyError if there is none)."""
        if self._prefixed:
            if name.startswith(TEXT_PREFIX):
                raise KeyError(name)  # names never carry the prefix
            if TEXT_PREFIX + name in self._where:
                return TEXT_PREFIX + name
        if name not in self._where:
            raise KeyError(name)
        return name

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            key = self._key(name)
        except KeyError:
            base, index = split_view(name)
            if index is None:
                raise
            return _slice(parse_shard(self._shards[self._where[self._key(base)]])[base], index)
        return parse_shard(self._shards[self._where[key]])[name]

    def __contains__(self, name: object) -> bool:
        try:
            self._key(name)  # type: ignore[arg-type]
        except (KeyError, AttributeError):
            if not isinstance(name, str) or split_view(name)[1] is None:
                return False
            try:
                self[name]
            except KeyError:
                return False
        return True

    def __iter__(self) -> Iterator[str]:
        cut = len(TEXT_PREFIX)
        return (k[cut:] if k.startswith(TEXT_PREFIX) else k for k in self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shard_of(self, name: str) -> str:
        """The file holding tensor `name`, without parsing its shard."""
        return self._shards[self._where[self._key(name)]].path


def _slice(info: TensorInfo, index: int) -> TensorInfo:
    """The view `X[index]` of stored tensor X [E, ...]: its contiguous byte range, shape [...]."""
    if not info.shape or not 0 <= index < info.shape[0]:
        raise KeyError(view_name(info.name, index))
    row = info.nbytes // info.shape[0]  # bytes per slice along axis 0
    start = info.start + index * row
    return TensorInfo(
        view_name(info.name, index),
        view_name(info.key, index),
        info.dtype,
        info.shape[1:],
        info.file,
        start,
        start + row,
    )


def _index_shards(shards: list[Shard], path: Path) -> tuple[dict[str, int], bool]:
    """stored key -> shard number over all shards, and whether the checkpoint is prefixed;
    CheckpointError on duplicate names."""
    n = sum(len(sh.keys) for sh in shards)
    where = dict(
        zip(
            chain.from_iterable(sh.keys for sh in shards),
            chain.from_iterable(repeat(i, len(sh.keys)) for i, sh in enumerate(shards)),
        )
    )
    prefixed = any(sh.n_prefixed for sh in shards)
    dup = None if len(where) == n else next(k for k in where if _count(shards, k) > 1)
    if dup is None and prefixed:  # a bare key may collide with a prefixed one's name
        bare = (
            k
            for sh in shards
            if sh.n_prefixed < len(sh.keys)
            for k in sh.keys
            if not k.startswith(TEXT_PREFIX)
        )
        dup = next((k for k in bare if TEXT_PREFIX + k in where), None)
    if dup is not None:
        raise CheckpointError(f"{path}: tensor name {dup} is stored twice")
    return where, prefixed


def _count(shards: list[Shard], key: str) -> int:
    return sum(sh.keys.count(key) for sh in shards)


def _layout(path: Path) -> tuple[list[str], Path | None, dict]:
    """A checkpoint path -> (shard files to scan, index path or None, config dict). With an
    index, the files are the directory's `.safetensors` files (checked against the index)."""
    if path.is_file():
        return [str(path)], None, {}
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    config_path = path / "config.json"
    config = load_json(config_path, "config") if config_path.exists() else {}
    index = path / INDEX_NAME
    if index.exists():
        return sorted(str(f) for f in path.glob("*.safetensors")), index, config
    if (path / SINGLE_NAME).is_file():
        return [str(path / SINGLE_NAME)], None, config
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def _scan_indexed(index: Path, files: list[str]) -> list[tuple[Shard, dict | None]]:
    """Scan an HF directory's shards. Fast path: the directory's shards hold exactly as many
    tensors as the index has entries. Otherwise the exact path: parse the index, scan only the
    shards it names, and report the first disagreement."""
    try:
        scans = [scan_shard(f) for f in files]
        if sum(len(sh.keys) for sh, _ in scans) == count_index_entries(index):
            return scans
    except CheckpointError:
        pass  # maybe a stray file the index does not name; the exact path decides
    weight_map = load_index(index)
    named = sorted(set(weight_map.values()))
    for f in named:
        if not (index.parent / f).is_file():
            raise CheckpointError(f"{index}: shard {f} is missing")
    scans = [scan_shard(str(index.parent / f)) for f in named]
    shards = [sh for sh, _ in scans]
    for sh, header in scans:
        if header is not None:
            parse_shard(sh, header)
    if sum(len(sh.keys) for sh in shards) != len(weight_map):
        raise CheckpointError(_index_mismatch(index, shards, weight_map) or f"{index}: mismatch")
    return scans


def _index_mismatch(index: Path, shards: list[Shard], weight_map: dict[str, str]) -> str | None:
    """The first disagreement between an index and the shard headers, or None."""
    stored: dict[str, str] = {}
    for sh in shards:
        file = os.path.basename(sh.path)
        stored.update((t.key, file) for t in parse_shard(sh).values())
    for key, shard in weight_map.items():
        if stored.get(key) != shard:
            return f"{index}: index places tensor {key} in {shard}, but that shard lacks it"
    for key, shard in stored.items():
        if key not in weight_map:
            return f"{index}: tensor {key} in {shard} is not listed in the index"
    return None


class Checkpoint:
    """A lazily indexed safetensors checkpoint (see the package docstring).

    Attributes: path, config (config.json or {}), prefix ("language_model." or ""), files (shard
    paths), tensors (name -> TensorInfo mapping), bytes_read and reads (I/O counters)."""

    def __init__(
        self,
        path: str,
        config: dict,
        shards: list[Shard],
        tensors: TensorTable,
        direct: bool = False,
    ):
        self.path, self.config, self.tensors = path, config, tensors
        self.prefix = TEXT_PREFIX if any(sh.n_prefixed for sh in shards) else ""
        self.files = [sh.path for sh in shards]
        self.direct = direct
        self.bytes_read = 0
        self.reads = 0
        self._shards = shards
        self._fds: dict[tuple[str, bool], int] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, direct: bool = False) -> Checkpoint:
        """Index a checkpoint directory or `.safetensors` file from its headers alone.

        Checks every shard's framing, that tensor names are unique and, for an HF directory,
        that its shards hold as many tensors as the index has entries (otherwise the index is
        parsed and followed exactly); each shard's entries are validated when first used
        (`validate()` checks everything now). direct=True reads tensor bytes with O_DIRECT where the file system
        supports it and silently falls back to buffered reads where it does not."""
        p = Path(path)
        files, index, config = _layout(p)
        if index is None:
            scans = [scan_shard(f) for f in files]
        else:
            scans = _scan_indexed(index, files)
        shards = [sh for sh, _ in scans]
        for sh, header in scans:
            if header is not None:  # json.loads already parsed it: validate now
                parse_shard(sh, header)
        where, prefixed = _index_shards(shards, p)
        return cls(str(p), config, shards, TensorTable(shards, where, prefixed), direct=direct)

    def validate(self) -> None:
        """Fully parse and check every shard header and, for an HF directory, that the index
        maps each tensor to the shard holding it. Raises CheckpointError on the first problem."""
        for sh in self._shards:
            parse_shard(sh)
        index = Path(self.path) / INDEX_NAME
        if Path(self.path).is_dir() and index.exists():
            problem = _index_mismatch(index, self._shards, load_index(index))
            if problem:
                raise CheckpointError(problem)

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
            pass
        base, index = split_view(name)
        if index is not None and base in self.tensors:
            shape = list(self.tensors[base].shape)
            raise CheckpointError(
                f"{self.path}: no tensor {name}: index {index} is out of range for {base} "
                f"of shape {shape}"
            )
        raise CheckpointError(f"{self.path}: no tensor {name}")

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
