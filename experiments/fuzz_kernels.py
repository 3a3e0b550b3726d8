"""Black-box trials against the compiled-kernel cache (issue 34 parts 2 and 8).

    OMP_NUM_THREADS=1 nice -n 5 python -m experiments.fuzz_kernels [--only cc_] [--work DIR]

Each trial prepares a cache (`$REAP_CACHE/kernels`, or `$XDG_CACHE_HOME/reap/kernels`), often
from a copy of one a clean `reap run` built, sets `CC`, `CFLAGS` or `PATH`, and runs `reap run`
on a tiny synthesized model in a fresh process (`fuzz_common.run_isolated`: hard timeout,
address-space cap). What is tried: libraries replaced by one whose constructor writes a marker
file (with and without a matching sha256 record), truncated, empty or garbage libraries, missing,
wrong, garbled, huge, directory or FIFO records, a FIFO or a symlink as the library, a cache
directory others can write, owned by another user (root only: chowned to nobody), a symlink, a
regular file, a FIFO or /dev/null at the cache path, `CC` missing, failing, writing garbage,
unparsable or blank, junk `CFLAGS`, no compiler on `PATH`, and two processes building one cold
cache at once.

Every trial must exit 0 with the tokens of the reference run (a cache problem never stops a
run nor changes its result). Classes: those of `fuzz_common.classify` (a refused run counts as
internal, other tokens or a missing or repeated warning as silent), plus *foreign-code* (the
marker appeared: a library reap did not build ran) and *data-loss* (a file outside the cache's
own libraries, such as a symlink's target, a regular file or /dev/null at the cache path, was
changed). Writes reports/reliability-kernels.json.

Outside the boundary, by design: a library and its record both written into the private
directory by the user (only they can) are trusted, as any file of theirs that reap runs: a
foreign library recorded there runs its constructor, and a cut one recorded there crashes
dlopen (SIGBUS). So no trial forges a record inside a private directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from experiments.fuzz_common import (
    CLASSES,
    Run,
    classify,
    fuzz_args,
    run_batch,
    run_cases,
    run_isolated,
    write_report,
    write_table,
)

VERDICTS = (*CLASSES, "foreign-code", "data-loss")
OFF = r"^reap: warning: compiled kernels off"
UNUSABLE = r"^reap: warning: kernel cache .* is unusable"
NOBODY = 65534
EVIL = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *m = getenv("REAP_FUZZ_MARKER");
    FILE *f = m ? fopen(m, "w") : NULL;
    if (f) { fputs("foreign code ran\n", f); fclose(f); }
}
"""


@dataclass
class Trial:
    name: str
    prepare: Callable[[Path, Path], None] | None = None  # (trial dir, base dir)
    env: dict = field(default_factory=dict)  # "{t}" in a value: the trial directory
    warn: str | None = None  # a warning every process must print exactly once
    check: Callable[[Path], str] | None = None  # post-condition: "" or what is wrong
    procs: int = 1  # processes started at once on the same cache
    root: bool = False  # needs root (chown)


# --- what the trials prepare -----------------------------------------------------------------

def kernels(t: Path) -> Path:
    return t / "cache" / "kernels"


def primed(t: Path, b: Path) -> None:
    """A copy of the cache a clean run built (modes kept: 0700 directory, private files)."""
    kernels(t).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(b / "primed", kernels(t), copy_function=shutil.copy2)
    kernels(t).chmod(0o700)


def libs(t: Path) -> list[Path]:
    return sorted(kernels(t).glob("*.so"))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(so: Path, data: bytes, record: bool) -> None:
    """`data` at `so`'s name (a new file), and with `record` its sha256 beside it."""
    so.unlink(missing_ok=True)
    so.write_bytes(data)
    so.chmod(0o700)
    if record:
        Path(f"{so}.sha256").write_text(sha(data) + "\n")


def each_lib(edit: Callable[[Path, Path], None], then: Callable | None = None):
    """Prepare: a primed cache, `edit(so, base)` on each library, then `then(t, base)`."""
    def prepare(t: Path, b: Path) -> None:
        primed(t, b)
        for so in libs(t):
            edit(so, b)
        if then:
            then(t, b)
    return prepare


def evil(record: bool):
    return lambda so, b: put(so, (b / "evil.so").read_bytes(), record)


def truncated(so: Path, b: Path) -> None:
    put(so, so.read_bytes()[: so.stat().st_size // 2], record=False)


def record_bytes(data: bytes):
    return lambda so, b: Path(f"{so}.sha256").write_bytes(data)


def replace_by(make: Callable[[Path], None], suffix: str = ""):
    """Prepare edit: the library (or its record) replaced by what `make(path)` creates."""
    def edit(so: Path, b: Path) -> None:
        p = Path(f"{so}{suffix}")
        p.unlink()
        make(p)
    return edit


def link_to(target_of: Callable[[Path, Path], Path], record: bool):
    """The library a symlink to a copy outside the cache (evil or genuine), recorded or not."""
    def edit(so: Path, b: Path) -> None:
        target = target_of(so, b)
        outside = so.parents[2] / "elsewhere" / so.name
        outside.parent.mkdir(exist_ok=True)
        shutil.copyfile(target, outside)
        if record:
            Path(f"{so}.sha256").write_text(sha(outside.read_bytes()) + "\n")
        so.unlink()
        os.symlink(outside, so)
    return edit


def chmod_dir(mode: int):
    return lambda t, b: kernels(t).chmod(mode)


def chown(which: str):
    def then(t: Path, b: Path) -> None:
        paths = [kernels(t)] if which == "dir" else [p for so in libs(t)
                                                    for p in (so, Path(f"{so}.sha256"))]
        for p in paths:
            os.chown(p, NOBODY, NOBODY)
    return then


def chmod_files(mode: int, suffix: str = ""):
    return lambda so, b: Path(f"{so}{suffix}").chmod(mode)


def kernels_is(make: Callable[[Path], None]):
    """Something that is not a directory of ours at the kernels path."""
    def prepare(t: Path, b: Path) -> None:
        kernels(t).parent.mkdir(parents=True)
        make(kernels(t))
    return prepare


def cache_root_file(t: Path, b: Path) -> None:
    (t / "cache").write_text("my notes\n")


def kernels_symlink(t: Path, b: Path) -> None:
    """`kernels` a symlink to a private directory elsewhere holding recorded foreign code."""
    elsewhere = t / "elsewhere" / "kernels"
    shutil.copytree(b / "primed", elsewhere)
    elsewhere.chmod(0o700)
    for so in elsewhere.glob("*.so"):
        put(so, (b / "evil.so").read_bytes(), True)
    kernels(t).parent.mkdir(parents=True)
    os.symlink(elsewhere, kernels(t))


def xdg_shared(t: Path, b: Path) -> None:
    """`$XDG_CACHE_HOME/reap/kernels` (no REAP_CACHE) world-writable, recorded foreign code."""
    d = t / "xdg" / "reap" / "kernels"
    d.parent.mkdir(parents=True)
    shutil.copytree(b / "primed", d)
    for so in d.glob("*.so"):
        put(so, (b / "evil.so").read_bytes(), True)
    d.chmod(0o777)


def script(body: str):
    """Prepare: an executable `t/bin/cc` running `body` (sh)."""
    def prepare(t: Path, b: Path) -> None:
        (t / "bin").mkdir()
        cc = t / "bin" / "cc"
        cc.write_text("#!/bin/sh\n" + body + "\n")
        cc.chmod(0o755)
    return prepare


GARBAGE_CC = ('out=; while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done; '
              'head -c 4096 /dev/urandom > "$out"')


# --- post-conditions -------------------------------------------------------------------------

def consistent(t: Path) -> str:
    """Every library has a record equal to its sha256, in a 0700 directory."""
    d = kernels(t)
    if not d.is_dir() or stat.S_IMODE(d.stat().st_mode) != 0o700:
        return f"kernels directory missing or not 0700: {d}"
    bad = [so.name for so in libs(t) if not Path(f"{so}.sha256").is_file()
           or Path(f"{so}.sha256").read_text().strip() != sha(so.read_bytes())]
    return f"libraries without a matching record: {bad}" if bad or not libs(t) else ""


def unchanged_since_prime(t: Path) -> str:
    """The control: the primed cache is used as it is (nothing rebuilt)."""
    b = t.parents[1] / "base" / "primed"
    changed = [p.name for p in b.iterdir() if (kernels(t) / p.name).read_bytes() != p.read_bytes()]
    return f"a valid cache was rebuilt: {changed}" if changed else ""


def dev_null_intact(t: Path) -> str:
    """'' while /dev/null is still the device (a cache path there must never replace it)."""
    return "" if stat.S_ISCHR(os.stat("/dev/null").st_mode) else "/dev/null IS NO LONGER A DEVICE"


def _fifo(p: Path) -> None:
    os.mkfifo(p)


TRIALS = [
    Trial("control", primed, check=unchanged_since_prime),
    Trial("cold", None, check=consistent),
    Trial("replaced_so", each_lib(evil(False))),
    Trial("truncated_so", each_lib(truncated)),
    Trial("empty_so_recorded", each_lib(lambda so, b: put(so, b"", True))),
    Trial("garbage_so_recorded", each_lib(lambda so, b: put(so, os.urandom(4096), True))),
    Trial("record_missing", each_lib(lambda so, b: Path(f"{so}.sha256").unlink()),
          check=consistent),
    Trial("record_wrong", each_lib(record_bytes(b"0" * 64 + b"\n")), check=consistent),
    Trial("record_garbled", each_lib(record_bytes(bytes(range(256)) * 4)), check=consistent),
    Trial("record_huge", each_lib(record_bytes(b"a" * 2**20)), check=consistent),
    Trial("record_empty", each_lib(record_bytes(b"")), check=consistent),
    Trial("record_directory", each_lib(replace_by(Path.mkdir, ".sha256"))),
    Trial("record_fifo", each_lib(replace_by(_fifo, ".sha256"))),
    Trial("so_fifo", each_lib(replace_by(_fifo))),
    Trial("so_directory", each_lib(replace_by(Path.mkdir))),
    Trial("so_symlink_to_copy", each_lib(link_to(lambda so, b: so, record=True))),
    Trial("so_symlink_to_evil", each_lib(link_to(lambda so, b: b / "evil.so", record=True))),
    Trial("so_writable_by_others", each_lib(lambda so, b: (evil(True)(so, b), so.chmod(0o777)))),
    Trial("record_writable_by_others",
          each_lib(lambda so, b: (evil(True)(so, b), chmod_files(0o666, ".sha256")(so, b)))),
    *(Trial(f"dir_mode_{mode:o}", each_lib(evil(True), chmod_dir(mode)), warn=UNUSABLE)
      for mode in (0o777, 0o770, 0o707, 0o1777)),
    Trial("dir_mode_755", each_lib(lambda so, b: None, chmod_dir(0o755)),
          check=unchanged_since_prime),
    Trial("dir_owned_by_nobody", each_lib(evil(True), chown("dir")), warn=UNUSABLE, root=True),
    Trial("files_owned_by_nobody", each_lib(evil(True), chown("files")), root=True),
    Trial("kernels_symlink", kernels_symlink, warn=UNUSABLE),
    Trial("kernels_regular_file", kernels_is(lambda p: p.write_text("my notes\n")),
          warn=UNUSABLE),
    Trial("kernels_fifo", kernels_is(_fifo), warn=UNUSABLE),
    Trial("cache_root_regular_file", cache_root_file, warn=UNUSABLE),
    Trial("cache_root_dev_null", None, {"REAP_CACHE": "/dev/null"}, warn=UNUSABLE),
    Trial("xdg_world_writable", xdg_shared, {"REAP_CACHE": None, "XDG_CACHE_HOME": "{t}/xdg"},
          warn=UNUSABLE),
    Trial("cc_missing", None, {"CC": "/nonexistent/cc"}, warn=OFF),
    Trial("cc_fails", script("echo 'cc: internal compiler error' >&2; exit 1"),
          {"CC": "{t}/bin/cc"}, warn=OFF),
    Trial("cc_writes_garbage", script(GARBAGE_CC), {"CC": "{t}/bin/cc"}, warn=OFF),
    Trial("cc_is_a_directory", None, {"CC": "/tmp"}, warn=OFF),
    Trial("cc_unbalanced_quote", None, {"CC": "'cc -O2"}, warn=OFF),
    Trial("cc_blank", None, {"CC": "   "}, check=consistent),  # as unset: cc
    Trial("cc_with_arguments", None, {"CC": "cc -DFROM_CC=1"}, check=consistent),
    Trial("cflags_unknown_flag", None, {"CFLAGS": "--no-such-flag-xyz"}, warn=OFF),
    Trial("cflags_missing_include", None, {"CFLAGS": "-include /nonexistent/x.h"}, warn=OFF),
    Trial("cflags_unbalanced_quote", None, {"CFLAGS": '-DX="1'}, warn=OFF),
    Trial("cflags_defines", None, {"CFLAGS": "-DFROM_CFLAGS=1 -O2"}, check=consistent),
    Trial("no_compiler_on_path", None, {"CC": None, "PATH": "{t}/emptybin"}, warn=OFF),
    Trial("no_ckernel", None, {"REAP_NO_CKERNEL": "1"}),
    *(Trial(f"two_builders_{i}", None, check=consistent, procs=2) for i in range(3)),
]


# --- running ---------------------------------------------------------------------------------

def run_argv(model: Path) -> list[str]:
    return ["run", str(model), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--json", "--quiet",
            "--threads", "1"]


def ids_of(stdout: str) -> list[int] | None:
    try:
        return json.loads(stdout)["generations"][0]["ids"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def snapshot(t: Path) -> dict[str, str]:
    """Everything in the trial directory but the cache's own libraries and records: kind and
    bytes (not following links), so that a changed user file, link target or FIFO shows."""
    out = {}
    for root, dirs, files in os.walk(t):
        for name in dirs + files:
            p = Path(root, name)
            rel = str(p.relative_to(t))
            if rel.startswith(("cache/kernels/", "xdg/reap/kernels/")) or rel == "marker":
                continue
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out[rel] = "file " + sha(p.read_bytes())
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = "link " + os.readlink(p)
            else:
                out[rel] = stat.filemode(st.st_mode)[0]
    return out


def setup(b: Path, log) -> list[int]:
    """The model, the evil library, a primed cache; returns the reference tokens."""
    b.mkdir(parents=True)
    made = run_batch([Run("setup/synth", ["synth", "k3-tiny", "--seed", "0", "--dtype", "float32",
                                          "--out", str(b / "model")], "accept")], 300, log=log)
    if made["setup/synth"].rc != 0:
        raise RuntimeError(made["setup/synth"].stderr[-500:])
    (b / "evil.c").write_text(EVIL)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", b / "evil.so", b / "evil.c"], check=True)
    ref = run_isolated(Run("setup/run", run_argv(b / "model"), "accept"), 300,
                       env={"REAP_CACHE": str(b / "cache")})
    ids = ids_of(ref.stdout)
    if ref.rc != 0 or not ids or ref.stderr.strip():
        raise RuntimeError(f"reference run failed: {ref.rc} {ref.stderr[-500:]}")
    shutil.copytree(b / "cache" / "kernels", b / "primed", copy_function=shutil.copy2)
    return ids


def execute(work: Path, timeout: float = 120.0, only: list[str] | None = None, log=None,
            progress=None) -> list[dict]:
    """Set up, run every trial (those whose name starts with one of `only`); one record per
    process started."""
    b = work / "base"
    ref = setup(b, log)
    records = []
    for trial in TRIALS:
        if only and not any(trial.name.startswith(o) for o in only):
            continue
        if trial.root and os.geteuid() != 0:
            continue
        records += run_trial(trial, work / "trials" / trial.name, b, ref, timeout, work)
        for rec in records[-trial.procs:]:
            if progress:
                progress(rec)
    return records


def run_trial(trial: Trial, t: Path, b: Path, ref: list[int], timeout: float,
              work: Path) -> list[dict]:
    t.mkdir(parents=True)
    (t / "emptybin").mkdir()
    if trial.prepare:
        trial.prepare(t, b)
    env = {"REAP_CACHE": str(t / "cache"), "REAP_FUZZ_MARKER": str(t / "marker"), "CC": None,
           "CFLAGS": None, "REAP_NO_CKERNEL": None}
    env.update({k: v.replace("{t}", str(t)) if v else v for k, v in trial.env.items()})
    before = snapshot(t)
    run = Run(f"kernels/{trial.name}", run_argv(b / "model"), "accept", "kernels", "run")
    with ThreadPoolExecutor(trial.procs) as pool:
        results = list(pool.map(lambda _: run_isolated(run, timeout, env=env), range(trial.procs)))
    recs = []
    for i, result in enumerate(results):
        v, note = verdict(trial, t, run, result, ref, before)
        line = result.line() if result.rc is not None else f"(no exit within {timeout:.0f} s)"
        recs.append({"key": run.key + (f"#{i}" if trial.procs > 1 else ""), "trial": trial.name,
                     "rc": result.rc, "verdict": v, "note": note,
                     "line": line.replace(str(work), "$WORK"),
                     "warnings": [w.replace(str(work), "$WORK") for w in result.stderr.splitlines()
                                  if w.startswith("reap: warning:")][:4],
                     "seconds": round(result.seconds, 2),
                     "env": {k: v.replace(str(work), "$WORK") if v else v
                             for k, v in env.items() if k in trial.env}})
    return recs


def verdict(trial: Trial, t: Path, run: Run, result, ref: list[int], before: dict) -> tuple[str, str]:
    if (t / "marker").exists():
        return "foreign-code", "a library reap did not build ran its constructor"
    lost = [p for p, what in before.items() if snapshot(t).get(p) != what]
    note = trial.check(t) if trial.check and result.rc == 0 else ""
    if lost or dev_null_intact(t):
        return "data-loss", dev_null_intact(t) or f"changed or gone: {lost[:5]}"
    v = classify(run, result)
    if v != "clean":
        return v, ""
    if result.rc != 0:
        return "internal", "the run was refused: a cache problem must not stop it"
    if ids_of(result.stdout) != ref:
        return "silent", f"tokens {ids_of(result.stdout)} differ from the reference {ref}"
    if trial.warn:
        n = len(re.findall(trial.warn, result.stderr, re.MULTILINE))
        if n != 1:
            return "silent", f"warning {trial.warn!r} said {n} times"
    if note:
        return "internal", note
    return "clean", ""


def count_rows(records: list[dict]) -> list[list]:
    counts = dict.fromkeys(VERDICTS, 0)
    for rec in records:
        counts[rec["verdict"]] += 1
    return [["surface", "tried", *VERDICTS], ["kernel cache", len(records), *counts.values()]]


def main(argv: list[str] | None = None) -> int:
    args = fuzz_args(__doc__, "kernels", "cc_", 120.0).parse_args(argv)
    if shutil.which("cc") is None:
        print("fuzz_kernels: needs a C compiler (cc) for the reference cache", file=sys.stderr)
        return 2
    records, seconds = run_cases(args, "kernels", lambda work, progress: execute(
        work, args.timeout, args.only, log=sys.stderr, progress=progress), width=12)
    print()
    write_table(count_rows(records))
    write_report(args, {"runs": len(records), "seconds": seconds, "timeout_s": args.timeout,
                        "root": os.geteuid() == 0,
                        "command": "OMP_NUM_THREADS=1 nice -n 5 python -m experiments.fuzz_kernels",
                        "counts": count_rows(records), "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
