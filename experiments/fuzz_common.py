"""Shared parts of the black-box fuzz and fault harness (`fuzz_inputs`, `fuzz_kill`, tests/test_fuzz).

The harness only drives the public CLI: each run is `reap.cli.main(argv)`, either in a fresh
`python -m reap.cli` subprocess (`isolate=True`) or in a long-lived *batch driver* process that
imports `reap` once and runs many argv lists in turn (3-4 s of torch import saved per run). The
parent enforces a hard per-run timeout (a run over it is a hang: the driver is killed and restarted
at the next run) and caps the address space of every child with RLIMIT_AS (a MemoryError or a kill
is unbounded memory). Nothing here imports `reap`, so refactors inside it cannot break the harness.

Classes of a run (`classify`): clean (exit 0 on a valid input, or a documented non-zero exit with a
`reap: error:` line and no traceback), internal ("internal error" or a traceback or a crash), hang,
memory, silent (exit 0 where the input was made invalid).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEM_CAP = 4 * 1024**3  # RLIMIT_AS of every child: past it is "unbounded memory"
DOCUMENTED = {0, 1, 2, 3, 4, 5}
CLASSES = ("clean", "internal", "hang", "memory", "silent")


@dataclass
class Run:
    """One CLI invocation: its argv and what the input is (`expect`)."""

    key: str  # unique id, "case/command"
    argv: list[str]
    expect: str = "reject"  # "reject": the input is invalid; "any": exit 0 allowed
    category: str = ""
    command: str = ""
    check: str = ""  # a post-check of fuzz_inputs.verdict
    timeout: float | None = None  # seconds, overriding the batch's


@dataclass
class Result:
    key: str
    rc: int | None  # None: hang (killed at the timeout)
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    verdict: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)

    def line(self) -> str:
        """The one-line output a user would see: the `reap: error:` line or the last stderr line."""
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("reap: error:")]
        return (errors or lines or [""])[-1][:300]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO),
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    env.pop("REAP_DEBUG", None)
    return env


# `python -m MODULE ARGS...` after capping the address space and lowering the priority; done in
# the child itself (not with preexec_fn, which is unsafe when the parent runs threads).
BOOT = ("import os, resource, runpy, sys; cap = int(sys.argv.pop(1)); "
        "cap and resource.setrlimit(resource.RLIMIT_AS, (cap, cap)); os.nice(10); "
        "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def python_m(module: str, args: list[str], mem_cap: int = MEM_CAP) -> list[str]:
    """The argv of `python -m MODULE ARGS` with the address-space cap applied first."""
    return [sys.executable, "-c", BOOT, str(mem_cap), module, *args]


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(10)


def run_isolated(run: Run, timeout: float, mem_cap: int = MEM_CAP, cwd: str | None = None,
                 env: dict[str, str | None] | None = None) -> Result:
    """`python -m reap.cli ARGV` in a fresh process with a timeout and an address-space cap
    (`env`: variables set, or removed where None)."""
    start = time.monotonic()
    full = child_env()
    for k, v in (env or {}).items():
        full.pop(k, None) if v is None else full.__setitem__(k, v)
    proc = subprocess.Popen(python_m("reap.cli", run.argv, mem_cap), cwd=cwd or REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                            errors="replace")
    try:
        out, err = proc.communicate(timeout=timeout)
        return Result(run.key, proc.returncode, out, err, time.monotonic() - start)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return Result(run.key, None, "", "", time.monotonic() - start)


# --- batch driver: one interpreter, many runs ------------------------------------------------

def _driver_main(jobs_path: str, results_path: str) -> None:
    """Child side: run each argv of the jobs file with reap.cli.main, append one JSON line each."""
    from reap.cli import main as reap_main  # the public entry point, imported once

    jobs = json.loads(Path(jobs_path).read_text())
    with open(results_path, "a", buffering=1) as results:
        for job in jobs:
            results.write(json.dumps({"start": job["key"]}) + "\n")
            out, err = io.StringIO(), io.StringIO()
            start = time.monotonic()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = reap_main(job["argv"])
            except SystemExit as e:  # argparse errors
                rc = e.code if isinstance(e.code, int) else 2
            except BaseException as e:  # noqa: BLE001 - a raw escape is what we look for
                import traceback
                err.write("Traceback (escaped reap.cli.main):\n" + traceback.format_exc())
                rc = 1
                if isinstance(e, MemoryError):
                    rc = -9
            results.write(json.dumps({"key": job["key"], "rc": rc, "stdout": out.getvalue()[-4000:],
                                      "stderr": err.getvalue()[-8000:],
                                      "seconds": time.monotonic() - start}) + "\n")
            if "out of memory" in err.getvalue() or rc == -9:
                return  # the heap may be damaged: the parent restarts a fresh driver


def run_batch(runs: list[Run], timeout: float, mem_cap: int = MEM_CAP, log=None,
              on_result=None) -> dict[str, Result]:
    """Run all `runs` in batch drivers, restarting one after a hang or a crash."""
    results: dict[str, Result] = {}
    pending = list(runs)
    with tempfile.TemporaryDirectory(prefix="fuzz-driver-") as tmp:
        round_ = 0
        while pending:
            round_ += 1
            jobs, res = Path(tmp, f"jobs{round_}.json"), Path(tmp, f"res{round_}.jsonl")
            jobs.write_text(json.dumps([asdict(r) for r in pending]))
            res.touch()
            done = _drive(jobs, res, pending, timeout, mem_cap, log, results, on_result)
            pending = pending[done:]
    return results


def _drive(jobs, res, pending, timeout, mem_cap, log, results, on_result) -> int:
    """One driver process over `pending`; returns how many runs it finished (or killed)."""
    cmd = python_m("experiments.fuzz_common", ["--driver", str(jobs), str(res)], mem_cap)
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=log or subprocess.DEVNULL, stderr=log or subprocess.DEVNULL,
                            start_new_session=True)
    done, started, offset, buf = 0, None, 0, ""
    try:
        while True:
            exited = proc.poll() is not None  # before reading: lines written before exit are seen
            with open(res) as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            buf += chunk
            *lines, buf = buf.split("\n")
            for ln in lines:
                msg = json.loads(ln)
                if "start" in msg:
                    started = time.monotonic()
                    continue
                r = Result(msg["key"], msg["rc"], msg["stdout"], msg["stderr"], msg["seconds"])
                _finish(r, pending[done], results, on_result)
                done += 1
                started = None
            if done == len(pending):
                return done
            limit = pending[done].timeout or timeout if done < len(pending) else timeout
            if started is not None and time.monotonic() - started > limit:
                _kill(proc)
                _finish(Result(pending[done].key, None, seconds=limit), pending[done], results,
                        on_result)
                return done + 1
            if exited:
                if started is not None:  # died inside a run: a crash or the kernel's kill
                    sig = -proc.returncode if proc.returncode < 0 else 0
                    _finish(Result(pending[done].key, proc.returncode,
                                   stderr=f"driver died: exit {proc.returncode} (signal {sig})"),
                            pending[done], results, on_result)
                    return done + 1
                if done == 0:
                    raise RuntimeError(f"fuzz driver exited {proc.returncode} before any run")
                return done
            time.sleep(0.05)
    finally:
        _kill(proc)


def _finish(result: Result, run: Run, results: dict, on_result) -> None:
    results[run.key] = result
    if on_result:
        on_result(run, result)


# --- classification --------------------------------------------------------------------------

def classify(run: Run, r: Result) -> str:
    """clean / internal / hang / memory / silent (see the module docstring)."""
    if r.rc is None:
        return "hang"
    err = r.stderr
    if r.rc == -9 or "out of memory" in err or "MemoryError" in err:
        return "memory"
    if r.rc < 0 or r.rc not in DOCUMENTED:
        return "internal"
    if "Traceback (most recent call last)" in err or "Traceback (escaped" in err:
        return "internal"
    if "internal error" in err:
        return "internal"
    if r.rc == 0:
        return "silent" if run.expect == "reject" else "clean"
    if not any(ln.startswith("reap: error:") for ln in err.splitlines()):
        if "usage: reap" in err and r.rc == 2:  # argparse's own refusal: documented exit 2
            return "clean"
        return "internal"
    return "clean"


# --- safetensors files ----------------------------------------------------------------------

def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, header length) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), n


def data_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n)
        return f.read()


def write_file(path: Path, header_bytes: bytes, data: bytes, length: int | None = None) -> None:
    """Write a safetensors-shaped file; `length` overrides the header length field."""
    n = len(header_bytes) if length is None else length
    Path(path).write_bytes(struct.pack("<Q", n) + header_bytes + data)


def encode_header(header: dict) -> bytes:
    """JSON header padded with spaces to a multiple of 8, as safetensors writes it."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_table(rows: list[list[str]], out=sys.stdout) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


def markdown_table(rows: list[list]) -> str:
    """The rows of `count_table` as a markdown table."""
    lines = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def count_table(records: list[dict], by: str, classes=CLASSES) -> list[list[str]]:
    """Rows `by | tried | <each class>` over result records, and a total row."""
    groups: dict[str, dict[str, int]] = {}
    for rec in records:
        g = groups.setdefault(rec[by], dict.fromkeys(classes, 0))
        g[rec["verdict"]] += 1
    rows = [[by, "tried", *classes]]
    for name in sorted(groups):
        g = groups[name]
        rows.append([name, sum(g.values()), *(g[c] for c in classes)])
    total = {c: sum(g[c] for g in groups.values()) for c in classes}
    rows.append(["total", sum(total.values()), *(total[c] for c in classes)])
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--driver"]:
    _driver_main(sys.argv[2], sys.argv[3])


def fuzz_args(doc: str, surface: str, example: str, timeout: float) -> argparse.ArgumentParser:
    """The options of every fuzz script: --only, --timeout, --out (its report), --work."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--only", action="append", help=f"case name prefix, e.g. {example}")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per run (over: hang)")
    ap.add_argument("--out", default=str(REPO / "reports" / f"reliability-{surface}.json"))
    ap.add_argument("--work", help="keep the cases here (default: a temporary directory)")
    return ap


def run_cases(args, surface: str, execute, width: int = 9) -> tuple[list[dict], float]:
    """(records, seconds) of `execute(work, progress)` in --work or a temporary directory
    (removed after), each record printed as it comes."""
    work = Path(args.work or tempfile.mkdtemp(prefix=f"reap-fuzz-{surface}-"))
    start = time.time()

    def progress(rec):
        print(f"{rec['verdict']:{width}} rc={rec['rc']!s:4} {rec['key']}: {rec['line'][:120]}"
              + (f" [{rec['note']}]" if rec["note"] else ""), flush=True)

    try:
        return execute(work, progress), round(time.time() - start, 1)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def write_report(args, report: dict) -> None:
    """The full run's JSON report at --out (a run narrowed by --only writes none)."""
    if not args.only:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
