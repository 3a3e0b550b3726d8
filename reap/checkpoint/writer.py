"""Checkpoint writer: stream declared tensors into deterministic safetensors shards, atomically
and resumably.

    w = CheckpointWriter(out, specs, max_shard_bytes=5e9, prefix="language_model.")
    for s in specs:                         # in write order
        if not w.done(s.name):              # a resumed job skips completed shards
            w.write(s.name, tensor_or_bytes)
    w.close(config, extra_files={"tokenizer.json": text})

Every shard's assignment and header are fixed from the specs before any data is written. Files
are written under `<out>.partial/`, renamed to `<out>` by `close()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from reap.checkpoint.header import encode_header
from reap.checkpoint.spec import (
    DTYPE_CODES,
    DTYPE_SIZES,
    INDEX_NAME,
    SINGLE_NAME,
    TensorSpec,
    stored_key,
)
from reap.errors import EXIT_USAGE, ReapError, WriteError
from reap.fileio import atomic_path, claim_out, replace_dir, write_atomic

PLAN_FILE = ".reap-plan"  # identity of the shard plan a partial directory belongs to
INDEX_FORMAT = "reap.checkpoint/1"  # the index's metadata.format: reap wrote this checkpoint


@dataclass
class _Shard:
    file: str  # file name inside the output directory
    names: list[str]  # tensor names in write order
    header: bytes  # 8-byte length + padded JSON
    size: int  # total file size in bytes
    done: bool = False


def _plan_shards(specs: list[TensorSpec], max_shard_bytes: int, prefix: str) -> list[_Shard]:
    """Assign tensors to shards greedily in declared order; compute every header up front."""
    groups: list[list[TensorSpec]] = []
    used = 0
    for s in specs:
        if not groups or (used + s.nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += s.nbytes
    n, shards = len(groups), []
    for i, group in enumerate(groups):
        header = encode_header(((stored_key(s, prefix), s.dtype, s.shape, s.nbytes)
                                for s in group), {"format": "pt"})
        file = SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        size = len(header) + sum(s.nbytes for s in group)
        shards.append(_Shard(file, [s.name for s in group], header, size))
    return shards


def _as_bytes(spec: TensorSpec, data) -> memoryview:
    """A tensor or raw buffer -> its bytes, checked against the declared spec."""
    if isinstance(data, torch.Tensor):
        if DTYPE_CODES.get(data.dtype) != spec.dtype or tuple(data.shape) != spec.shape:
            raise WriteError(f"tensor {spec.name}: got {data.dtype} {tuple(data.shape)}, "
                             f"declared {spec.dtype} {spec.shape}", exit_code=EXIT_USAGE)
        flat = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        return memoryview(flat.numpy())
    view = memoryview(data).cast("B")
    if len(view) != spec.nbytes:
        raise WriteError(f"tensor {spec.name}: got {len(view)} bytes, declared {spec.nbytes}",
                         exit_code=EXIT_USAGE)
    return view


def _check_specs(specs: list[TensorSpec]) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.dtype not in DTYPE_SIZES:
            raise ReapError(f"tensor {s.name}: unknown dtype {s.dtype!r}")
        if s.name in seen:
            raise ReapError(f"tensor {s.name} declared twice")
        seen.add(s.name)


class CheckpointWriter:
    """Write a checkpoint whose tensors (name, dtype, shape, in write order) are declared up front.

    Shards hold at most `max_shard_bytes` of tensor data (a single larger tensor gets its own);
    text tensors are stored as `prefix + name`, vision tensors under their own names. A new
    writer for the same `out_dir` and identical specs resumes: completed shards are kept and
    `done(name)` is True for their tensors. An existing `out_dir` is replaced only when reap made
    it and `overwrite` (`reap.fileio.claim_out`)."""

    def __init__(self, out_dir: str | os.PathLike, specs: list[TensorSpec],
                 max_shard_bytes: int = 5_000_000_000, prefix: str = "", overwrite: bool = False):
        self.out_dir = Path(out_dir)
        self.partial = Path(f"{self.out_dir}.partial")
        self.specs = list(specs)
        self.overwrite = overwrite
        _check_specs(self.specs)
        claim_out(self.out_dir, overwrite, directory=True)
        self.shards = _plan_shards(self.specs, int(max_shard_bytes), prefix)
        self._shard_of = {n: i for i, sh in enumerate(self.shards) for n in sh.names}
        self._next = 0  # index in specs of the next tensor to write
        self._file = None  # the open temporary file of the shard being written
        self._shard_stack = contextlib.ExitStack()  # renames it into place when closed
        try:
            self._prepare_partial()
        except OSError as e:
            raise WriteError(f"{self.partial}: cannot prepare ({e.strerror})") from None

    def _plan_id(self) -> str:
        h = hashlib.sha256()
        for sh in self.shards:
            h.update(sh.file.encode() + b"\0" + sh.header)
        return h.hexdigest()

    def _prepare_partial(self) -> None:
        """Create `<out>.partial/`, or resume it when it belongs to the same plan."""
        plan_path = self.partial / PLAN_FILE
        if self.partial.exists():  # a writer killed before its plan file leaves at most its tmp
            if not plan_path.exists() and set(os.listdir(self.partial)) - {f"{PLAN_FILE}.tmp"}:
                raise WriteError(f"{self.partial}: exists but was not made by this writer; "
                                 "remove it", exit_code=EXIT_USAGE)
            if plan_path.read_text() != self._plan_id():
                shutil.rmtree(self.partial)  # a stale attempt at a different layout
        self.partial.mkdir(parents=True, exist_ok=True)
        if not plan_path.exists():
            write_atomic(plan_path, self._plan_id(), tmp=f"{plan_path}.tmp", fsync=True)
        for sh in self.shards:
            sh.done = self._shard_complete(sh)

    def _shard_complete(self, sh: _Shard) -> bool:
        path = self.partial / sh.file
        if not path.is_file() or path.stat().st_size != sh.size:
            return False
        with open(path, "rb") as f:
            return f.read(len(sh.header)) == sh.header

    def done(self, name: str) -> bool:
        """True when tensor `name` is already on disk (its shard was completed earlier)."""
        try:
            return self.shards[self._shard_of[name]].done
        except KeyError:
            raise ReapError(f"tensor {name} was not declared") from None

    def write(self, name: str, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Append one tensor (a torch tensor of the declared dtype and shape, or its raw bytes
        copied verbatim). Tensors come in declared order; those of completed shards are
        skipped."""
        if self.done(name):
            return
        while self.done(self.specs[self._next].name):
            self._next += 1
        spec = self.specs[self._next]
        if spec.name != name:
            raise ReapError(f"write order: expected tensor {spec.name}, got {name}")
        view = _as_bytes(spec, data)
        shard = self.shards[self._shard_of[name]]
        path = self.partial / shard.file
        tmp = f"{path}.tmp"
        try:
            if self._file is None:  # held open across write() calls
                self._shard_stack.enter_context(atomic_path(path, tmp, fsync=True))
                self._file = self._shard_stack.enter_context(open(tmp, "wb"))  # noqa: SIM115
                self._file.write(shard.header)
            self._file.write(view)
            if name == shard.names[-1]:
                self._shard_stack.close()  # the file is closed, synced and renamed
                self._file = None
                shard.done = True
        except OSError as e:
            raise WriteError(f"{tmp}: cannot write tensor {name} ({e.strerror})") from None
        self._next += 1

    def close(self, config: dict | None = None,
              extra_files: dict[str, bytes | str] | None = None) -> str:
        """Write the index (with metadata total_size), config.json and extra files, then move
        the finished checkpoint to `out_dir`. Returns its path."""
        missing = [s.name for s in self.specs if not self.done(s.name)]
        if missing:
            raise WriteError(f"{self.out_dir}: {len(missing)} declared tensors not written "
                             f"(first: {missing[0]})")
        files = {"config.json": json.dumps(config, indent=2) if config is not None else None}
        files.update(extra_files or {})
        weight_map = {}
        for sh in self.shards:
            weight_map.update((k, sh.file) for k in json.loads(sh.header[8:]) if k[:2] != "__")
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in self.specs), "format": INDEX_FORMAT},
            "weight_map": dict(sorted(weight_map.items())),
        }
        files[INDEX_NAME] = json.dumps(index, indent=2)
        try:
            for fname, content in files.items():
                if content is None:
                    continue
                if os.path.basename(fname) != fname or fname in (SINGLE_NAME, *weight_map.values()):
                    raise WriteError(f"extra file {fname!r}: must be a plain, unused file name",
                                     exit_code=EXIT_USAGE)
                data = content.encode() if isinstance(content, str) else bytes(content)
                path = self.partial / fname  # a resumed job reuses the temporary name
                write_atomic(path, data, tmp=f"{path}.tmp", fsync=True)
            (self.partial / PLAN_FILE).unlink()
            claim_out(self.out_dir, self.overwrite, directory=True)  # still reap's, or gone
            replace_dir(self.partial, self.out_dir)
        except OSError as e:
            raise WriteError(f"{self.out_dir}: cannot finish checkpoint ({e.strerror})") from None
        return str(self.out_dir)
