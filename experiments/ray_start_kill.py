"""`reap calibrate --ray` with the local cluster's first worker processes SIGKILLed the moment they
appear (while `ray.init` may still be registering the driver): how many runs end, and how.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m experiments.ray_start_kill [--trials 6]

With prestarted workers (Ray's default, `RAY_enable_worker_prestart=1` in the environment) a
worker killed during registration hung `ray.init` for good (it blocks in `recv` holding the GIL:
only SIGKILL ends it); reap starts its cluster without them. A run still alive `--wait` seconds
after the kill counts as hung and is killed with its processes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import psutil


def trial(model: str, out: str, wait: float) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "reap.cli", "calibrate", model, "--corpus", "en", "--tokens",
           "2000", "--seq-len", "64", "--no-progress", "--ray", "--workers", "1", "--out", out]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, deadline = {}, time.monotonic() + 180
    while p.poll() is None and time.monotonic() < deadline:
        seen.update({q.pid: q for q in psutil.Process(p.pid).children(recursive=True)})
        workers = [q for q in seen.values() if q.is_running()
                   and q.name().startswith("ray::") and "Agent" not in q.name()]
        if workers:
            for q in workers:
                q.kill()
            break
        time.sleep(0.1)
    try:
        return f"exit {p.wait(wait)}"
    except subprocess.TimeoutExpired:
        for q in [*seen.values(), psutil.Process(p.pid)]:
            if q.is_running():
                q.kill()
        return "hung"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--wait", type=float, default=90.0, help="seconds after the kill")
    args = ap.parse_args(argv)
    from reap.synth import synth

    with tempfile.TemporaryDirectory(prefix="reap-ray-kill-") as work:
        model = str(synth("k3-tiny", os.path.join(work, "k3"), seed=0, dtype="float32"))
        ends = [trial(model, os.path.join(work, f"out{i}"), args.wait) for i in range(args.trials)]
    print(f"{ends.count('hung')} of {len(ends)} hung; " + ", ".join(ends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
