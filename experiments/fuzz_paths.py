"""Black-box sweep of output paths (issue 34 part 1): every command that takes an `--out`, run
against what may already be at that path.

    OMP_NUM_THREADS=1 nice -n 10 python -m experiments.fuzz_paths [--kills 8] [--only plan/]

Obstacles at `--out` (each in its own case directory, beside a bystander file): nothing (the
control), a FIFO, a socket, a character device (a null device made with mknod in the case
directory, never /dev/null; root only), links to a FIFO, to the device and to a foreign file,
a foreign file or JSON, a directory of foreign files, a model reap did not make (a reap model
whose index lost its tag), an empty directory, the command's own earlier output, a foreign
`<out>.partial` or `OUT/.work`, a prune's `<out>.partial` as a prune killed before its first
shard leaves it, and a path under a file. The replacing commands (prune, synth, plan, run, stats
merge) run with and without --overwrite; the filling ones (calibrate, analyze, eval, corpora
build) add files to a directory.

Each run is classified as `fuzz_common.classify` does (clean, internal, hang, memory, silent:
exit 0 where a refusal was due; a valid run refused counts as internal), and as data-loss when
anything that was in its case directory before (a file's bytes, a link's target, a FIFO, socket,
device or directory) is gone or changed after it, except the reap output it was allowed to
replace. Killed-at-start prunes: a prune SIGKILLed right after its `<out>.partial` appears (then
a few milliseconds later) must finish on rerun with the bytes of an uninterrupted prune.
Writes reports/reliability-paths.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from experiments.fuzz_common import (
    CLASSES,
    REPO,
    Run,
    child_env,
    classify,
    count_table,
    fuzz_args,
    python_m,
    run_batch,
    run_cases,
    run_isolated,
    write_report,
    write_table,
)

VERDICTS = (*CLASSES, "data-loss")
SHARD = "--max-shard-size=100000B"
REPLACING = {"prune": True, "synth": True, "plan": False, "run": False, "stats": False}  # dir?
FILLING = ("calibrate", "analyze", "eval", "corpora")
OWN = {"prune": "pruned", "synth": "model", "plan": "plan.json", "run": "run.json",
       "stats": "merged.safetensors", "calibrate": "stats"}  # each command's output in base/


def argv_for(cmd: str, b: Path, out: str) -> list[str]:
    """The argv of `cmd` writing to `out`, reading the base inputs in `b`."""
    stats = [str(b / "stats" / "en.safetensors"), str(b / "stats" / "zh.safetensors")]
    return [str(a) for a in {
        "prune": ["prune", b / "model", "--plan", b / "plan.json", "--no-progress", SHARD],
        "synth": ["synth", "k3-tiny", "--dtype", "float32", "--shard-gb", "0.0002"],
        "plan": ["plan", "--model", b / "model", "--criterion", "random", "--keep", "6"],
        "run": ["run", b / "model", "--prompt-ids", "1,2", "--max-tokens", "1", "--quiet"],
        "stats": ["stats", "merge", *stats],
        "calibrate": ["calibrate", b / "model", "--corpus", "en", "--tokens", "64", "--seq-len",
                      "32", "--no-progress"],
        "analyze": ["analyze", *stats, "--no-plots", "--quiet", "--bootstrap", "0",
                    "--permutations", "0"],
        "eval": ["eval", b / "model", "--reference", b / "model", "--corpus", "en", "--max-docs",
                 "1", "--max-tokens-per-doc", "32", "--gen-tokens", "0", "--bootstrap", "0",
                 "--no-plots", "--quiet"],
        "corpora": ["corpora", "build", "en"],
    }[cmd]] + ["--out", out]


def setup_runs(b: Path, commands: set[str]) -> list[Run]:
    """The CLI runs that build the base inputs and each command's own output (all exit 0)."""
    runs = [Run("setup/synth", argv_for("synth", b, str(b / "model")), "accept")]
    if commands & {"stats", "analyze", "calibrate"}:
        runs.append(Run("setup/calibrate", [*argv_for("calibrate", b, str(b / "stats")),
                                            "--corpus", "en+zh"], "accept"))
    runs.append(Run("setup/plan", argv_for("plan", b, str(b / "plan.json")), "accept"))
    for cmd in ("prune", "run", "stats"):
        if cmd in commands:
            runs.append(Run(f"setup/{cmd}", argv_for(cmd, b, str(b / OWN[cmd])), "accept"))
    return runs


# --- obstacles: what is at --out before the run ----------------------------------------------

def _fifo(out: Path, b: Path, cmd: str) -> None:
    os.mkfifo(out)


def _socket(out: Path, b: Path, cmd: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(out))
    s.close()


def _device(out: Path, b: Path, cmd: str) -> None:
    os.mknod(out, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a null device in the case dir


def _link(make):
    def link(out: Path, b: Path, cmd: str) -> None:
        target = out.with_name("link-target")
        make(target, b, cmd)
        os.symlink(target, out)
    return link


def _file(out: Path, b: Path, cmd: str) -> None:
    out.write_text("my thesis\n")


def _json(out: Path, b: Path, cmd: str) -> None:
    out.write_text('{"format": "mine", "text": "my thesis"}\n')


def _dir(out: Path, b: Path, cmd: str) -> None:
    out.mkdir()
    (out / "thesis.txt").write_text("my thesis\n")


def _foreign_model(out: Path, b: Path, cmd: str) -> None:
    shutil.copytree(b / "model", out)
    index = out / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    d["metadata"].pop("format", None)  # as any other tool writes an index
    index.write_text(json.dumps(d))


def _empty_dir(out: Path, b: Path, cmd: str) -> None:
    out.mkdir()


def _own(out: Path, b: Path, cmd: str) -> None:
    src = b / OWN[cmd]
    (shutil.copytree if src.is_dir() else shutil.copy)(src, out)


def _foreign_work(out: Path, b: Path, cmd: str) -> None:
    (out / ".work").mkdir(parents=True)
    (out / ".work" / "notes.txt").write_text("mine\n")


def _foreign_partial(out: Path, b: Path, cmd: str) -> None:
    _dir(out.with_name(out.name + ".partial"), b, cmd)


def _early_partial(names):
    def early(out: Path, b: Path, cmd: str) -> None:
        work = out.with_name(out.name + ".partial")
        work.mkdir()
        for name in names:
            (work / name).write_text("0" * 64)
    return early


def _under_file(out: Path, b: Path, cmd: str) -> None:
    out.parent.joinpath("afile").write_text("my thesis\n")


OBSTACLES = {  # name -> (make, commands it applies to)
    "absent": (None, "all"),
    "fifo": (_fifo, "all"),
    "socket": (_socket, "all"),
    "device": (_device, "all"),
    "link_to_fifo": (_link(_fifo), "all"),
    "link_to_device": (_link(_device), "all"),
    "link_to_file": (_link(_file), "all"),
    "foreign_file": (_file, "all"),
    "foreign_json": (_json, "all"),
    "foreign_dir": (_dir, "no corpora"),
    "foreign_model": (_foreign_model, "dirs"),
    "empty_dir": (_empty_dir, "no corpora"),
    "own": (_own, "own"),
    "foreign_work": (_foreign_work, ("calibrate",)),
    "foreign_partial": (_foreign_partial, ("prune", "synth")),
    "early_partial_empty": (_early_partial([]), ("prune",)),
    "early_partial_plan_tmp": (_early_partial([".reap-plan.tmp"]), ("prune",)),
    "early_partial_plan": (_early_partial([".reap-plan"]), ("prune",)),
    "under_file": (_under_file, "all"),
}


def applies(obstacle: str, cmd: str) -> bool:
    where = OBSTACLES[obstacle][1]
    if where == "all":
        return cmd != "corpora" or obstacle != "absent"  # corpora build would download
    if where == "no corpora":
        return cmd != "corpora"
    if where == "dirs":
        return REPLACING.get(cmd, True)
    if where == "own":
        return cmd in OWN
    return cmd in where


def expected(cmd: str, obstacle: str, overwrite: bool) -> str:
    """"accept" (exit 0 due) or "reject" (a documented refusal due)."""
    if obstacle == "absent" or obstacle.startswith("early_partial"):
        return "accept"
    if cmd in FILLING:
        # a filling command adds its own files beside foreign ones; the data-loss check holds it
        return "accept" if obstacle in ("foreign_dir", "foreign_model", "empty_dir") else "reject"
    ours = obstacle == "own" or (obstacle == "empty_dir" and REPLACING[cmd])
    return "accept" if ours and overwrite else "reject"


def snapshot(d: Path) -> dict[str, str]:
    """Every entry under `d`, not following links: kind and content (bytes' sha256, link target,
    device number)."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    what = "file " + hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = "link " + os.readlink(p)
            elif stat.S_ISCHR(st.st_mode):
                what = f"device {st.st_rdev}"
            else:
                what = stat.filemode(st.st_mode)[0]  # d, p (FIFO), s (socket)
            out[os.path.relpath(p, d)] = what
    return out


def case_runs(b: Path, work: Path, only: list[str] | None) -> list[tuple[Run, Path, dict, str]]:
    """(run, case directory, its snapshot, the out path it may replace or '') for every case."""
    cases = []
    for cmd in (*REPLACING, *FILLING):
        for obstacle, (make, _) in OBSTACLES.items():
            for overwrite in ((False, True) if cmd in REPLACING else (False,)):
                key = f"{cmd}/{obstacle}" + ("/overwrite" if overwrite else "")
                if not applies(obstacle, cmd) or (only and not any(key.startswith(o) for o in only)):
                    continue
                d = work / key.replace("/", "_")
                d.mkdir(parents=True)
                (d / "bystander.txt").write_text("not reap's\n")
                out = d / "out"
                try:
                    if make:
                        make(out, b, cmd)
                except PermissionError:  # mknod needs root
                    shutil.rmtree(d)
                    continue
                if obstacle == "under_file":
                    out = d / "afile" / "out"
                argv = argv_for(cmd, b, str(out)) + (["--overwrite"] if overwrite else [])
                exp = expected(cmd, obstacle, overwrite)
                run = Run(key, argv, exp, category=obstacle, command=cmd)
                ours = obstacle in ("own", "empty_dir") or obstacle.startswith("early")
                cases.append((run, d, snapshot(d), "out" if ours and exp == "accept" else ""))
    return cases


def lost(before: dict, after: dict, replaceable: str) -> list[str]:
    """Entries of `before` gone or changed in `after`, but those under `replaceable`."""
    mine = (replaceable, replaceable + ".partial") if replaceable else ()
    return [p for p, what in before.items() if after.get(p) != what
            and not any(p == m or p.startswith(m + os.sep) for m in mine)]


def verdict(run: Run, result, lost_paths: list[str]) -> tuple[str, str]:
    v = classify(run, result)
    if lost_paths:
        return "data-loss", f"gone or changed: {lost_paths[:5]}"
    if run.expect == "accept" and result.rc != 0 and v == "clean":
        return "internal", "valid output refused"
    return v, ""


# --- killed-at-start prunes ------------------------------------------------------------------

def _build(d: Path) -> dict[str, str]:
    """A prune's files but its manifest (which records the command's arguments)."""
    return {k: v for k, v in snapshot(d).items() if k != "reap_manifest.json"}


def kill_trial(b: Path, d: Path, delay: float, timeout: float) -> dict:
    """SIGKILL a prune `delay` s after its `<out>.partial` appears, rerun it, compare."""
    out, work = d / "out", d / "out.partial"
    argv = argv_for("prune", b, str(out))
    proc = subprocess.Popen(python_m("reap.cli", argv), cwd=REPO, env=child_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    end = time.monotonic() + timeout
    while not work.exists() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.0005)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    left = sorted(os.listdir(work)) if work.is_dir() else ("finished" if out.exists() else "none")
    # a prune that ended before the kill leaves a finished build: the rerun is refused (exit 2,
    # no --overwrite) and the build must still equal an uninterrupted one
    expect = "reject" if left == "finished" else "accept"
    run = Run(f"prune/killed_at_start/{delay * 1000:g}ms", argv, expect, "killed_at_start",
              "prune")
    result = run_isolated(run, timeout)
    v, note = verdict(run, result, [])
    if v == "clean" and _build(out) != _build(b / "pruned"):
        v, note = "silent", "resumed bytes differ from an uninterrupted prune"
    return {"run": run, "result": result, "verdict": v, "note": note,
            "left": left if isinstance(left, str) else left[:8]}


# --- driver ----------------------------------------------------------------------------------

def execute(work: Path, timeout: float = 60.0, kills: int = 8, only: list[str] | None = None,
            log=None, progress=None) -> list[dict]:
    """Build the base inputs, run every case (those whose key starts with one of `only`) and
    `kills` killed-at-start prunes; returns one record per run."""
    b = work / "base"
    commands = {k.split("/")[0] for k in only} if only else {*REPLACING, *FILLING}
    commands |= {"prune"} if kills else set()
    setup = run_batch(setup_runs(b, commands), timeout=300, log=log)
    failed = {k: r.stderr[-400:] for k, r in setup.items() if r.rc != 0}
    if failed:
        raise RuntimeError(f"setup failed: {failed}")
    cases = case_runs(b, work / "cases", only)
    by_key = {run.key: (d, snap, mine) for run, d, snap, mine in cases}
    records = []

    def record(run: Run, result, v: str, note: str, **extra) -> None:
        line = result.line() if result.rc is not None else f"(no exit within {timeout:.0f} s)"
        rec = {"key": run.key, "command": run.command, "obstacle": run.category,
               "expect": run.expect, "rc": result.rc, "verdict": v, "note": note,
               "line": line.replace(str(work), "$WORK"), "seconds": round(result.seconds, 2),
               "argv": [a.replace(str(work), "$WORK") for a in run.argv], **extra}
        records.append(rec)
        if progress:
            progress(rec)

    def on_result(run: Run, result) -> None:
        d, before, mine = by_key[run.key]
        record(run, result, *verdict(run, result, lost(before, snapshot(d), mine)))

    run_batch([c[0] for c in cases], timeout, log=log, on_result=on_result)
    delays = (0.0, 0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
    for i in range(kills):
        d = work / "kills" / str(i)
        d.mkdir(parents=True)
        t = kill_trial(b, d, delays[i % len(delays)], timeout)
        record(t["run"], t["result"], t["verdict"], t["note"] or f"killed with {t['left']}",
               left=t["left"])
    return records


def main(argv: list[str] | None = None) -> int:
    ap = fuzz_args(__doc__, "paths", "plan/fifo", 60.0)
    ap.add_argument("--kills", type=int, default=8, help="killed-at-start prune trials")
    args = ap.parse_args(argv)
    records, seconds = run_cases(args, "paths", lambda work, progress: execute(
        work, args.timeout, args.kills, args.only, log=sys.stderr, progress=progress))
    for by in ("command", "obstacle"):
        print()
        write_table(count_table(records, by, VERDICTS))
    write_report(args, {"runs": len(records), "seconds": seconds, "timeout_s": args.timeout,
                        "root": os.geteuid() == 0,
                        "command": "OMP_NUM_THREADS=1 python -m experiments.fuzz_paths --kills "
                                   f"{args.kills}",
                        "by_command": count_table(records, "command", VERDICTS),
                        "by_obstacle": count_table(records, "obstacle", VERDICTS),
                        "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
