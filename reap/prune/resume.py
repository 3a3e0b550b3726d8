"""Which inputs a half-written prune belongs to, so a rerun resumes only the same job.

`prune` writes into `<out>.partial/` (`reap.checkpoint.CheckpointWriter`), which resumes whenever
the shard layout is the same; two plans with the same counts have the same layout but different
bytes. So before the first shard, `record` stores the identity of the inputs (`identity`: the
plan's sha256, the source's fingerprint and file sizes and times, the shard size and the code
version) in the work directory as INPUTS; a rerun `claim`s the work directory only when the
identity is equal (without `overwrite` anything else is refused: the output would mix two
jobs; one killed before its first shard is cleared), and `release` removes the record from the
finished checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from reap.checkpoint.writer import PLAN_FILE  # the writer's own record
from reap.errors import ReapError, WriteError
from reap.fileio import write_atomic

INPUTS = ".reap-prune-inputs"
FORMAT = "reap.prune_inputs/1"
EARLY = {PLAN_FILE, f"{PLAN_FILE}.tmp", f"{INPUTS}.tmp"}  # all a prune writes before its record


def work_dir(out: str | os.PathLike) -> Path:
    """The directory a prune into `out` writes before it is complete (the writer's)."""
    return Path(f"{Path(out)}.partial")


def identity(ck, plan_bytes: bytes, max_shard_bytes: int, code: str) -> dict:
    """What decides the bytes of a pruned checkpoint: the plan file, the source checkpoint
    (fingerprint, and each shard's name, size and modification time, since the fingerprint
    does not hash tensor bytes), the shard size limit and the code version."""
    stats = [(os.path.basename(f), os.stat(f)) for f in ck.files]
    files = [[name, st.st_size, st.st_mtime_ns] for name, st in stats]
    return {
        "format": FORMAT,
        "plan_sha256": hashlib.sha256(plan_bytes).hexdigest(),
        "model": ck.fingerprint(),
        "model_files": files,
        "max_shard_bytes": int(max_shard_bytes),
        "code_version": code,
    }


def claim(out: str | os.PathLike, inputs: dict, overwrite: bool) -> None:
    """Make sure `<out>.partial/`, if there, may be resumed with `inputs`: keep it when it
    records the same inputs, remove it when `overwrite`, else raise ReapError naming the
    inputs that differ. Call only after checking that it holds no input."""
    work = work_dir(out)
    if not os.path.lexists(work):
        return
    if work.is_symlink() or not work.is_dir():
        raise ReapError(f"{work}: in the way of the output and not a directory reap prune made")
    have = _read(work / INPUTS)
    if have == inputs:
        return
    early = have is None and set(os.listdir(work)) <= EARLY  # killed before its first shard
    if have is None and not early and not (work / PLAN_FILE).exists():
        raise ReapError(f"{work}: in the way of the output and not made by reap prune; remove it")
    if overwrite or early:
        try:
            shutil.rmtree(work)
        except OSError as e:
            raise WriteError(f"{work}: cannot remove ({e.strerror})") from None
        return
    if have is None:
        reason = "half-written by a prune whose inputs are not recorded"
    else:
        fields = [k for k in inputs if have.get(k) != inputs[k]]
        reason = f"half-written by a prune of other inputs ({', '.join(fields)} differ)"
    raise ReapError(f"{work}: {reason} (give --overwrite to replace it, or another --out)")


def record(out: str | os.PathLike, inputs: dict) -> None:
    """Store `inputs` in the work directory (the writer created it), before any shard."""
    path = work_dir(out) / INPUTS
    write_atomic(path, json.dumps(inputs, indent=1), tmp=f"{path}.tmp", fsync=True)


def release(path: str | os.PathLike) -> None:
    """Remove the record from a finished checkpoint (it was moved there with the directory)."""
    try:
        (Path(path) / INPUTS).unlink(missing_ok=True)
    except OSError as e:
        raise WriteError(f"{path}/{INPUTS}: cannot remove ({e.strerror})") from None


def _read(path: Path) -> dict | None:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None
