"""Checkpoint reader: index safetensors shards from their headers alone, then fetch tensors by
name with positioned reads (one `pread` per tensor, or per run of adjacent tensors).

    with Checkpoint.open("path/to/model") as ck:     # HF dir, dir with model.safetensors, or file
        w = ck.read("model.layers.3.mlp.gate.weight")
        expert = ck.read_many(names_of_one_expert)      # contiguous: one read
        one = ck.read("model.layers.3.mlp.experts.down_proj[5]")  # slice 5 of a fused tensor

Reads are `RunReader`'s (`files.py`); backends (`RemoteCheckpoint`) make bytes present locally
in `ensure` before they are read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from reap.checkpoint.files import RunReader, adjacent_runs
from reap.checkpoint.header import Shard, load_index, parse_shard
from reap.checkpoint.spec import INDEX_NAME, TEXT_PREFIX, TensorInfo, split_view
from reap.checkpoint.table import TensorTable, index_mismatch, open_table
from reap.errors import CheckpointError


class Checkpoint(RunReader):
    """A lazily indexed safetensors checkpoint (see the package docstring).

    Attributes: path, config (config.json or {}), prefix ("language_model." or ""), files (shard
    paths), tensors (name -> TensorInfo mapping), direct, bytes_read and reads (I/O counters)."""

    def __init__(self, path: str, config: dict, shards: list[Shard], tensors: TensorTable,
                 direct: bool = False):
        super().__init__(direct, fd_limit=256)  # keep the cache small: the oldest is closed
        self.path, self.config, self.tensors = path, config, tensors
        self.prefix = TEXT_PREFIX if any(sh.n_prefixed for sh in shards) else ""
        self.files = [sh.path for sh in shards]
        self._shards = shards

    @classmethod
    def open(cls, path: str | os.PathLike, direct: bool = False) -> Checkpoint:
        """Index a checkpoint directory or `.safetensors` file from its headers alone (checked as
        `table.open_table` says; each shard's entries when first used, all by `validate()`).
        direct=True reads with O_DIRECT where the file system allows, else buffered."""
        config, shards, table = open_table(Path(path))
        return cls(str(Path(path)), config, shards, table, direct=direct)

    def validate(self) -> None:
        """Fully parse and check every shard header (`header.check_entries`) and, for an HF
        directory, the index again. Raises CheckpointError on the first problem."""
        for sh in self._shards:
            parse_shard(sh)
        index = Path(self.path) / INDEX_NAME
        if Path(self.path).is_dir() and index.exists():
            problem = index_mismatch(index, self._shards, load_index(index))
            if problem:
                raise CheckpointError(problem)

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
            raise CheckpointError(f"{self.path}: no tensor {name}: index {index} is out of range "
                                  f"for {base} of shape {list(self.tensors[base].shape)}")
        raise CheckpointError(f"{self.path}: no tensor {name}")

    def read(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """One tensor by name (without prefix), read with a single positioned read."""
        return self.read_many([name], device)[name]

    def read_raw(self, name: str) -> bytes:
        """The stored bytes of one tensor, verbatim."""
        return self.read(name).reshape(-1).view(torch.uint8).numpy().tobytes()

    def read_many(self, names: Iterable[str],
                  device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Several tensors; byte ranges adjacent in one file are fetched with one read.
        Returns name -> tensor in the order asked."""
        infos = [self._info(n) for n in names]
        views: dict[str, torch.Tensor] = {}
        # disk -> page-locked host buffer -> GPU: the copy is one DMA, issued without waiting
        # (the caching host allocator keeps the buffer alive until it is done)
        pin = torch.device(device).type == "cuda"
        for run in adjacent_runs(sorted(set(infos), key=lambda t: (t.file, t.start, t.end))):
            buf = torch.empty(self.span(run), dtype=torch.uint8, pin_memory=pin)  # run's tensors
            views.update(self.read_into(run, buf))
        return {t.name: views[t.name].to(device, non_blocking=pin) for t in infos}

    # ---- provenance ----------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 (hex) over the sorted (name, dtype, shape, byte length) list and the config:
        a cheap identity for provenance records (it does not hash tensor bytes)."""
        h = hashlib.sha256()
        rows = sorted((t.name, t.dtype, list(t.shape), t.nbytes) for t in self.tensors.values())
        h.update(json.dumps(rows, separators=(",", ":")).encode())
        h.update(json.dumps(self.config, sort_keys=True, separators=(",", ":")).encode())
        return h.hexdigest()
