"""`verify`: check a pruned checkpoint against the checkpoint it was pruned from (`reap verify`).

Every tensor is read from both checkpoints and compared byte for byte: each kept expert's tensors
equal the source expert the manifest names (and hash to the manifest's sha256, recomputed from
both copies; a fused expert tensor is checked slice by slice through its views `X[e]`, after its
shape [n_kept, ...]), router tensors equal the source's rows of the kept experts, those of
unused components (UNUSED_COMPONENTS, an MTP layer) are gone, every other tensor is unchanged, no
tensor is missing or extra, config.json is the family's `with_experts` of the source config, each
other file prune wrote has the sha256 the manifest records (old manifests lack them: refused), and
the index maps every tensor to the shard holding it (no missing, renamed, swapped or outside shard).
Reading is one tensor (or one expert) at a time, so memory stays small.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from reap.checkpoint import INDEX_NAME, split_view
from reap.errors import CheckpointError, ReapError
from reap.prune.stream import tensor_bytes, tensors_sha256
from reap.prune.write import MANIFEST, MANIFEST_FORMAT


class VerifyError(ReapError):
    """A pruned checkpoint does not match its source (the message names the tensor)."""


@dataclass
class VerifyResult:
    """What was checked: tensors and bytes compared, output experts verified (`merged` of them
    against a recomputation of their group, the rest bit for bit against their source)."""

    tensors: int
    bytes_compared: int
    experts: int
    merged: int = 0


def verify(*, pruned: str, source: str) -> VerifyResult:
    """Raise VerifyError naming the first mismatch; return the counts when all is well."""
    from reap.checkpoint import Checkpoint
    from reap.models import family

    with Checkpoint.open(pruned) as new, Checkpoint.open(source) as old:
        _check_index(new, pruned)
        man = _manifest(pruned)
        if man["source"]["fingerprint"] != old.fingerprint():
            raise VerifyError(f"{source} is not the checkpoint {pruned} was pruned from "
                              "(fingerprint differs from the manifest's)")
        fam = family(old.config)
        cfg = fam.Config.from_dict(old.config)
        original = {int(la): v["original"] for la, v in man["experts"].items()}
        _check_config(fam, old.config, new.config, original, pruned)
        _check_files(pruned, man)
        expected = _expected(old, fam, original)
        _check_names(new, expected, pruned)
        nbytes = 0
        for name, (kind, src, rows) in expected.items():
            if kind == "fused":
                _check_fused(new, old, name, len(rows[1]))
            elif kind != "expert":
                nbytes += _compare(new, old, name, src, rows)
        merger, merged = _merger(old, fam, man), 0
        for layer, ids in original.items():
            shas = man["experts"][str(layer)]["sha256"]  # indexed, not zipped: none may be skipped
            for j, e in enumerate(ids):
                want = merger.tensors(layer, j) if merger and merger.members(layer, j) else None
                merged += want is not None
                nbytes += _check_expert(new, old, fam, cfg, (layer, j, e), shas[j], want)
    n_stored = sum(1 for n in expected if split_view(n)[1] is None)  # views are not tensors
    return VerifyResult(n_stored, nbytes, sum(len(v) for v in original.values()), merged)


def _check_index(new, pruned: str) -> None:
    """The index prune wrote is there and agrees with the shards: each entry names a shard file
    of the directory (a plain name, no path) whose header holds that tensor, and every stored
    tensor has its entry (`Checkpoint.validate`); every shard header is parsed and checked."""
    if not os.path.isfile(os.path.join(pruned, INDEX_NAME)):
        raise VerifyError(f"{pruned}: {INDEX_NAME} is missing (prune always writes one)")
    try:
        new.validate()
    except CheckpointError as e:
        raise VerifyError(str(e)) from None


def _manifest(pruned: str) -> dict:
    path = os.path.join(pruned, MANIFEST)
    try:
        with open(path) as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        raise VerifyError(f"{path}: cannot read the pruning manifest ({e})") from None
    if man.get("format") != MANIFEST_FORMAT:
        raise VerifyError(f"{path}: not a reap pruning manifest")
    return man


def _check_config(fam, source_cfg: dict, pruned_cfg: dict, original: dict, pruned: str) -> None:
    per_layer = {int(k): len(v) for k, v in original.items()}
    n = per_layer if len(set(per_layer.values())) > 1 else next(iter(per_layer.values()))
    want = fam.with_experts(source_cfg, n)
    if pruned_cfg != want:
        keys = sorted(_diff_keys(want, pruned_cfg))
        raise VerifyError(f"{pruned}/config.json is not the source config with {n} experts "
                          f"(differs at {', '.join(keys[:3])})")


def _check_files(pruned: str, man: dict) -> None:
    """Each file prune wrote beside the tensors (config, tokenizer, templates, plan copy) holds
    the bytes whose sha256 the manifest records; there is no other (dot files aside)."""
    root, digests = Path(pruned), man.get("files")
    if not isinstance(digests, dict):
        raise VerifyError(f"{root / MANIFEST}: records no file digests (an older reap prune): "
                          "its config and tokenizer files cannot be checked; prune again")
    here = {p.name for p in root.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    here -= {MANIFEST, INDEX_NAME, *(n for n in here if n.startswith("."))}
    for name in sorted(set(digests) | here):
        sha = hashlib.sha256((root / name).read_bytes()).hexdigest() if name in here else None
        if sha != digests.get(name):
            why = "missing" if sha is None else "differs from the file prune wrote"
            raise VerifyError(f"{root / name}: {why if name in digests else 'not from prune'}")


def _diff_keys(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _diff_keys(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    elif a != b:
        yield path or "(root)"


def _expected(old, fam, original: dict) -> dict[str, tuple[str, str, list | None]]:
    """Pruned tensor name -> (kind, source name, kept rows for routers)."""
    from reap.prune.tensor_map import fused_tensors, unused_tensors

    cfg = fam.Config.from_dict(old.config)
    dropped = unused_tensors(fam, old.config)
    routers = {}
    for layer, ids in original.items():
        for name, axis in fam.router_tensors(cfg, layer).items():
            routers[name] = (axis, ids)
    fused = fused_tensors(fam, cfg, original)
    out: dict[str, tuple[str, str, list | None]] = {}
    for name in old.tensors:
        if name in dropped:
            continue
        if name in fused:
            out[name] = ("fused", name, (0, original[fused[name]]))
        elif fam.expert_key(name) is None:
            out[name] = ("router", name, routers[name]) if name in routers else ("copy", name, None)
    for layer, ids in original.items():
        for j, e in enumerate(ids):
            names = fam.expert_tensor_names
            for new, src in zip(names(cfg, layer, j), names(cfg, layer, e)):
                out[new] = ("expert", src, None)
    return out


def _check_names(new, expected: dict, pruned: str) -> None:
    missing = [n for n in expected if n not in new.tensors]
    if missing:
        raise VerifyError(f"{pruned}: tensor {missing[0]} is missing")
    extra = [n for n in new.tensors if n not in expected]
    if extra:
        raise VerifyError(f"{pruned}: tensor {extra[0]} is not in the source or the manifest")


def _compare(new, old, name: str, src: str, rows) -> int:
    """Byte compare one trunk or router tensor; returns the bytes compared."""
    a, b = new.tensors[name], old.tensors[src]
    if rows is None:  # stored under the same key too: a vision tensor never takes the prefix
        if (a.key, a.dtype, a.shape) != (b.key, b.dtype, b.shape):
            raise VerifyError(f"tensor {name} is stored as {a.key}, not as the source's {b.key}")
        if new.read_raw(name) != old.read_raw(src):
            raise VerifyError(f"tensor {name} differs from the source")
        return a.nbytes
    axis, ids = rows
    want = old.read(src).index_select(axis, torch.tensor(ids, dtype=torch.long))
    got = new.read(name)
    same = got.dtype == want.dtype and got.shape == want.shape
    if not same or tensor_bytes(got) != tensor_bytes(want):
        raise VerifyError(f"router tensor {name} is not the source's rows of the kept experts")
    return a.nbytes


def _check_fused(new, old, name: str, n_kept: int) -> None:
    """A fused expert tensor keeps its dtype and holds n_kept slices (their bytes are compared
    expert by expert through the views)."""
    a, b = new.tensors[name], old.tensors[name]
    want = (n_kept, *b.shape[1:])
    if a.dtype != b.dtype or tuple(a.shape) != want:
        raise VerifyError(f"fused tensor {name} is {a.dtype} {list(a.shape)}, expected "
                          f"{b.dtype} {list(want)}")


def _merger(old, fam, man: dict):
    """The `Merger` recomputing a merged build's experts from the manifest's groups, or None."""
    if not man.get("merge"):
        return None
    from reap.prune.merge_write import Merger

    try:
        groups = {int(la): [[[int(e), float(w)] for e, w in zip(*ew)] for ew in zip(
            v["sources"], v["weights"])] for la, v in man["experts"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise VerifyError(f"{MANIFEST}: merge groups unreadable ({e})") from None
    return Merger(old, fam, groups, man["merge"].get("align"))


def _check_expert(new, old, fam, cfg, key: tuple[int, int, int], sha: str, merged=None) -> int:
    """Expert j of the pruned layer == expert e of the source (`key` (layer, j, e)), or the
    `merged` tensors recomputed from the source, byte for byte and by hash."""
    layer, j, e = key
    names_new = fam.expert_tensor_names(cfg, layer, j)
    names_old = fam.expert_tensor_names(cfg, layer, e)
    got = new.read_many(names_new)
    want = old.read_many(names_old) if merged is None else dict(zip(names_old, merged))
    n = 0
    for a, b in zip(names_new, names_old):
        ta, tb = got[a], want[b]
        if ta.dtype != tb.dtype or ta.shape != tb.shape or tensor_bytes(ta) != tensor_bytes(tb):
            what = "source expert tensor" if merged is None else "recomputed merge of"
            raise VerifyError(f"tensor {a} differs from {what} {b}")
        n += new.tensors[a].nbytes
    if tensors_sha256([got[a] for a in names_new]) != sha:  # the source's bytes are the same
        raise VerifyError(f"layer {layer} expert {j} (source expert {e}): sha256 differs from "
                          "the manifest")
    return n
