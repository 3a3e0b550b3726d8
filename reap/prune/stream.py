"""Copy the mapped tensors of a pruned checkpoint into its writer, hashing every kept expert.

`stream_items` reads one tensor (or one expert's adjacent tensors) at a time, so memory is bounded
by the largest tensor; a fused tensor is assembled slice by slice. Each kept expert's sha256 (over
its stored bytes in the family's `expert_tensor_names` order) is computed on a worker thread while
the next is copied, once its bytes pass the checks `run` makes (exit 4). Tensors of shards a
previous run completed are skipped by the writer; experts are still read (for their hashes).
"""

from __future__ import annotations

import hashlib

import torch

from reap.errors import ExpertLoadError, ReapError
from reap.models.base import expert_short_names
from reap.prune.tensor_map import Item
from reap.quant.matrix import check_matrices


class _Hasher:
    """sha256 of each kept expert on a worker thread, overlapping the copy (hashlib releases the
    GIL); at most one expert waits to be hashed while the next is copied, so memory stays small."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reap-sha256")
        self.pending = None
        self.hashes: dict[tuple[int, int], str] = {}

    def submit(self, key: tuple[int, int], tensors: list[torch.Tensor]) -> None:
        self._collect()
        self.pending = (key, self.pool.submit(tensors_sha256, tensors))

    def _collect(self) -> None:
        if self.pending is not None:
            key, fut = self.pending
            self.hashes[key] = fut.result()
            self.pending = None

    def close(self) -> dict[tuple[int, int], str]:
        self._collect()
        self.pool.shutdown()
        return self.hashes


def tensors_sha256(tensors: list[torch.Tensor]) -> str:
    """The sha256 of the tensors' bytes, one after another (the manifest's per-expert hash)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def stream_items(ck, fam, writer, items: list[Item], progress: bool, new_ids: dict[int, list[int]],
                 merger=None):
    """Copy every item into the writer (an expert the `merge_write.Merger` merges: its merged
    tensors); returns ({(layer, new id): sha256}, resumed count)."""
    from tqdm import tqdm

    hasher, cfg = _Hasher(), fam.Config.from_dict(ck.config)
    resumed = 0
    total = sum(it.spec.nbytes for it in items)
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="prune")
    i = 0
    while i < len(items):
        it = items[i]
        group = [it]
        if it.kind == "expert":
            while i + len(group) < len(items) and items[i + len(group)].expert == it.expert:
                group.append(items[i + len(group)])
        done = [writer.done(g.spec.name) for g in group]
        resumed += sum(done)
        if it.kind == "expert":  # read even when written: the manifest needs its hash
            names = [g.source for g in group]
            if merger is not None and merger.members(*it.expert):
                tensors = merger.tensors(*it.expert)
                for g, t in zip(group, tensors):
                    writer.write(g.spec.name, t)
            else:
                tensors = _copy_expert(ck, writer, group)
            hasher.submit(it.expert, _checked(fam, names, tensors))
        elif not done[0]:
            writer.write(it.spec.name, _fused(ck, it) if it.kind == "fused" else _tensor(ck, it))
        bar.update(sum(g.spec.nbytes for g in group))
        i += len(group)
    bar.close()
    for layer in sorted({it.spec.layer for it in items if it.kind == "fused"}):
        for j, e in enumerate(new_ids[layer]):  # an expert's slices lie in several tensors
            names = fam.expert_tensor_names(cfg, layer, e)
            hasher.submit((layer, j), _checked(fam, names, list(ck.read_many(names).values())))
    return hasher.close(), resumed


def _checked(fam, names: list[str], tensors: list) -> list:
    """One kept expert's `tensors` (stored as `names`) once they pass the checks `run` makes: a
    verbatim copy must not carry corrupt bytes on (exit 4)."""
    try:
        check_matrices(fam.expert_matrices(dict(zip(expert_short_names(names), tensors))))
    except ReapError as e:
        raise ExpertLoadError(f"kept expert of {names[0]}: {e}") from None
    return tensors


def _fused(ck, it: Item) -> torch.Tensor:
    """The fused tensor [n_kept, ...] of the kept slices in new id order, read one at a time."""
    from reap.checkpoint import TORCH_DTYPES, view_name

    out = torch.empty(it.spec.shape, dtype=TORCH_DTYPES[it.spec.dtype])
    for j, e in enumerate(it.rows):
        out[j] = ck.read(view_name(it.source, e))  # [...] slice e of the source [E, ...]
    return out


def _copy_expert(ck, writer, group: list[Item]) -> list[torch.Tensor]:
    """One expert's tensors, read together (adjacent: one read) and written verbatim (the writer
    skips tensors of shards a previous run completed); returns them, in order, for hashing."""
    tensors = ck.read_many([g.source for g in group])
    for g in group:
        writer.write(g.spec.name, tensors[g.source])
    return [tensors[g.source] for g in group]


def _tensor(ck, it: Item) -> torch.Tensor:
    t = ck.read(it.source)
    if it.kind == "router":
        t = t.index_select(it.axis, torch.tensor(it.rows, dtype=torch.long)).contiguous()
    return t
