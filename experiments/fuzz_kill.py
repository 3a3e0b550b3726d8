"""kill -9 at seeded random points of `calibrate`, `prune` and `corpora build`, then resume.

    OMP_NUM_THREADS=1 nice -n 10 python -m experiments.fuzz_kill --seed 0 --kills 6

For each job, two uninterrupted runs give the reference bytes (a file that differs between them,
e.g. a timing record, is listed and left out of the comparison); every run writes the same path,
so files that record their own path compare equal. Each trial starts the same `python -m reap.cli`
command and SIGKILLs its process group at a random moment after its first write (sometimes twice),
checks that no file visible at a final output path differs from the reference (no half-written
result), reruns the same command to completion and compares every file byte for byte. Verdicts:
clean (identical), silent (exit 0 with different bytes, or a half-written file visible),
no-resume (the rerun refuses or fails), internal, hang. `prune->B` kills a prune of plan A and
reruns into the same --out with plan B: it must refuse cleanly or produce exactly plan B's build.
`corpora build` runs offline from the code-py .deb files in /var/cache/apt/archives (skipped,
with the reason, where they are absent). Writes reports/reliability-kill.json.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.fuzz_common import REPO, Result, Run, child_env, classify, python_m, run_isolated

TIMEOUT = 300.0


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(python_m("reap.cli", argv), cwd=REPO, env=child_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _first_write(out: Path, proc: subprocess.Popen) -> tuple[float, float]:
    """(seconds to the first new entry next to `out`, total seconds) of a run being watched."""
    start, first = time.monotonic(), None
    before = set(os.listdir(out.parent))
    while proc.poll() is None:
        if first is None and set(os.listdir(out.parent)) - before:
            first = time.monotonic() - start
        time.sleep(0.01)
    total = time.monotonic() - start
    return (first if first is not None else 0.0), total


class Job:
    """One command whose output directory `out` is compared; `prepare` resets its inputs."""

    def __init__(self, name: str, argv, prepare=None, early: float | None = None,
                 committed=None):
        self.name, self._argv, self._prepare = name, argv, prepare
        self.early = early  # kill from this fraction of the run on (work before the first write)
        # committed(out): the output is final (a rerun refuses to redo it, rightly)
        self.committed = committed or (lambda out: False)

    def argv(self, out: Path, variant: str = "") -> list[str]:
        return [str(a) for a in self._argv(out, variant)]

    def prepare(self, trial_dir: Path) -> None:
        if self._prepare:
            self._prepare(trial_dir)


def reference(job: Job, root: Path, variant: str = "") -> dict:
    """Two uninterrupted runs: bytes, the files that differ between them, and timings."""
    trees, times = [], []
    for _ in range(2):
        out = _slot(job, root)
        proc = _start(job.argv(out, variant))
        first, total = _first_write(out, proc)
        if proc.returncode != 0:
            raise RuntimeError(f"reference run of {job.name} failed: exit {proc.returncode}")
        trees.append(_tree(out))
        times.append((first, total))
    unstable = sorted(k for k in set(trees[0]) | set(trees[1]) if trees[0].get(k) != trees[1].get(k))
    return {"tree": trees[0], "unstable": unstable, "first_write": min(t[0] for t in times),
            "seconds": max(t[1] for t in times)}


def _slot(job: Job, root: Path) -> Path:
    """A fresh root/slot with the job's inputs; every run writes the same path slot/out, so that
    files recording their own path compare equal."""
    slot = root / "slot"
    shutil.rmtree(slot, ignore_errors=True)
    slot.mkdir()
    job.prepare(slot)
    return slot / "out"


def _visible_partial(out: Path, ref: dict) -> list[str]:
    """Files present at the final output path after a kill that differ from the reference."""
    if not out.is_dir():
        return []
    return [k for k, v in _tree(out).items()
            if k not in ref["unstable"] and k in ref["tree"] and ref["tree"][k] != v]


def _kill_once(job: Job, out: Path, rng: random.Random, window: tuple[float, float],
               from_start: bool = False) -> dict:
    """Start the job and SIGKILL it `uniform(*window)` seconds after its first write (after its
    start with `job.early`), so that load on the machine does not push every kill into the
    interpreter's start-up; `from_start`: after its start (a resumed run's files already exist).
    Returns when, whether it had already ended, and the seconds from the origin to the kill."""
    before = set(os.listdir(out.parent))
    proc = _start(job.argv(out, ""))
    start = time.monotonic()
    if job.early is None and not from_start:
        while proc.poll() is None and not set(os.listdir(out.parent)) - before:
            time.sleep(0.01)
    origin = time.monotonic()
    deadline = origin + rng.uniform(*window)
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    worked = time.monotonic() - origin
    finished = proc.poll() is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return {"at_s": round(time.monotonic() - start, 2), "finished_before_kill": finished,
            "work_s": worked}


def _first_kill(job: Job, ref: dict, root: Path, rng: random.Random) -> tuple[Path, dict]:
    """A kill that lands before the end of the work (or the commit of an atomic output): the
    window shrinks to the work time seen when a run got there first (the reference may have been
    timed on a busier machine)."""
    if job.early is None:
        window = (0.0, max(0.05, ref["seconds"] - ref["first_write"]))
    else:
        window = (job.early * ref["seconds"], ref["seconds"])
    for _ in range(4):
        out = _slot(job, root)
        kill = _kill_once(job, out, rng, window)
        if not kill["finished_before_kill"] and not job.committed(out):
            break  # the kill landed mid-work (not after the end, nor after the commit)
        window = (min(window[0], 0.5 * kill["work_s"]), 0.9 * kill["work_s"])
    return out, kill


def trial(job: Job, ref: dict, root: Path, rng: random.Random, resume_variant: str = "",
          resume_ref: dict | None = None) -> dict:
    """Kill, check what is visible, resume (with `resume_variant`), compare with the reference."""
    out, kill = _first_kill(job, ref, root, rng)
    kills = [kill]
    if rng.random() < 0.3:  # a second kill during the resumed run
        window = (0.0, ref["first_write"] + kill["work_s"])
        kills.append(_kill_once(job, out, rng, window, from_start=True))
    for k in kills:
        k["work_s"] = round(k["work_s"], 2)
    partial = _visible_partial(out, ref)
    target = resume_ref or ref
    run = Run(f"{job.name}{resume_variant}", job.argv(out, resume_variant), "any")
    rec = {"job": job.name + (f"->{resume_variant}" if resume_variant else ""), "kills": kills,
           "visible_partial": partial}
    done = kills[-1]["finished_before_kill"] or job.committed(out)
    if done and not resume_variant:
        # the run had committed its output before the kill: a rerun would refuse to replace it
        result = Result(run.key, 0, stderr="(output committed before the kill: compared as is)")
    else:
        result = run_isolated(run, TIMEOUT)
    rec.update(rc=result.rc, line=result.line())
    v = classify(run, result)
    if result.rc != 0 and v == "clean" and not resume_variant:
        v = "no-resume"  # the same command after a kill must finish the work, not refuse it
    if result.rc == 0:
        got = _tree(out)
        diff = sorted(k for k in set(got) | set(target["tree"])
                      if k not in target["unstable"] and got.get(k) != target["tree"].get(k))
        rec["differs"] = diff
        v = "silent" if diff else v
    if partial:
        v = "silent"
    rec["verdict"] = v
    return rec


def jobs(root: Path, seed: int) -> tuple[list[Job], dict, list[str]]:
    """The jobs over a k3-small (6 layers) model, its plans A and B; and skipped jobs with why."""
    model, stats = root / "model", root / "stats"
    plans = {"": root / "planA.json", "B": root / "planB.json"}
    setup = [
        ["synth", "k3-small", "--layers", "6", "--out", model, "--seed", seed, "--shard-gb", "0.03"],
        ["calibrate", model, "--corpus", "en", "--tokens", "512", "--seq-len", "128", "--out", stats,
         "--no-progress"],
        ["plan", stats / "en.safetensors", "--model", model, "--keep", "16", "--out", plans[""]],
        ["plan", stats / "en.safetensors", "--model", model, "--keep", "24", "--criterion",
         "frequency", "--out", plans["B"]],
    ]
    for argv in setup:
        r = run_isolated(Run("setup", [str(a) for a in argv]), TIMEOUT)
        if r.rc != 0:
            raise RuntimeError(f"setup {argv[0]} failed: {r.line()}")
    out = [
        Job("calibrate", lambda o, v: ["calibrate", model, "--corpus", "en+code", "--tokens", "2048",
                                       "--seq-len", "128", "--out", o, "--no-progress"],
            committed=lambda o: (o / "all.safetensors").is_file()  # and no work left to resume
            and not (o / ".work" / "progress.json").exists()),
        Job("prune", lambda o, v: ["prune", model, "--plan", plans[v], "--out", o,
                                   "--max-shard-size", "20MB", "--no-progress"],
            committed=lambda o: o.is_dir()),  # renamed into place when complete
    ]
    skipped = []
    debs = [p for pkg in ("libpython3.11-stdlib", "libpython3.11-minimal")
            for p in glob.glob(f"/var/cache/apt/archives/{pkg}_*.deb")]
    if len(debs) == 2:
        def prepare(d: Path) -> None:
            (d / "cache" / "debs").mkdir(parents=True)
            for p in debs:
                shutil.copy(p, d / "cache" / "debs")
        out.append(Job("corpora-build", lambda o, v: ["corpora", "build", "code-py", "--cache",
                                                      o.parent / "cache", "--out", o],
                       prepare=prepare, early=0.3))  # unpacking into the cache comes first
    else:
        skipped.append("corpora build: the code-py .deb files are not in /var/cache/apt/archives "
                       "and apt-get download needs the network")
    return out, plans, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=6, help="trials per job")
    ap.add_argument("--swaps", type=int, default=4, help="plan-A-killed, plan-B-resumed trials")
    ap.add_argument("--max-seconds", type=float, default=1800, help="stop starting trials after")
    ap.add_argument("--out", default=str(REPO / "reports" / "reliability-kill.json"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    start = time.monotonic()
    records = []
    with tempfile.TemporaryDirectory(prefix="reap-kill-") as tmp:
        root = Path(tmp)
        job_list, _, skipped = jobs(root, args.seed)
        refs = {}
        for job in job_list:
            refs[job.name] = reference(job, root)
            print(f"{job.name}: reference {refs[job.name]['seconds']:.1f} s, first write at "
                  f"{refs[job.name]['first_write']:.1f} s, unstable files {refs[job.name]['unstable']}",
                  flush=True)
        prune = next(j for j in job_list if j.name == "prune")
        ref_b = reference(prune, root, "B")
        plan = [(job, i, "") for i in range(args.kills) for job in job_list]
        plan += [(prune, i, "B") for i in range(args.swaps)]
        for job, i, variant in plan:
            if time.monotonic() - start > args.max_seconds:
                skipped.append(f"time limit: {job.name}{variant} trial {i} and later not run")
                break
            rec = trial(job, refs[job.name], root, rng, variant, ref_b if variant else None)
            records.append(rec)
            print(f"{rec['verdict']:8} {rec['job']:22} kills {rec['kills']} rc={rec['rc']} "
                  f"{rec['line'][:120]}", flush=True)
        unstable = {j: refs[j]["unstable"] for j in refs}
    summary = {}
    for rec in records:
        s = summary.setdefault(rec["job"], {"tried": 0})
        s["tried"] += 1
        s[rec["verdict"]] = s.get(rec["verdict"], 0) + 1
    report = {"seed": args.seed, "command": f"OMP_NUM_THREADS=1 python -m experiments.fuzz_kill "
              f"--seed {args.seed} --kills {args.kills} --swaps {args.swaps}",
              "seconds": round(time.monotonic() - start, 1), "summary": summary,
              "unstable_files_excluded": unstable, "skipped": skipped, "trials": records}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    for s in skipped:
        print("skipped:", s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
