"""SIGINT and SIGTERM under load on `reap serve` and `reap calibrate --ray` ->
reports/reliability-shutdown.json.

    python experiments/fuzz_shutdown.py [--seed 0] [--serve 12] [--ray 10]
        [--out reports/reliability-shutdown.json]

Drives the public CLI only (`python -m reap.cli`, this checkout on PYTHONPATH) on a k3-tiny it
synthesizes into a temporary directory; nothing beyond 127.0.0.1 is contacted.

- serve trials: a load (a long streamed generation; 64 concurrent clients; streaming clients
  that hang up mid-stream; idle kept-alive connections; all of them at once), then SIGINT or
  SIGTERM after a seeded delay.
- ray trials: `calibrate --ray` ended by success, SIGINT, SIGTERM, a signal sent twice, or a
  SIGKILLed worker (retried), the signal landing while the local cluster starts or mid-run.

Each trial is one of: clean (exit 5 after a signal, 0 after success or a retried worker, no
traceback), hang (alive 30 s after its signal: killed), internal (another exit code or a
traceback), leftover (a process it started alive 30 s after it ended), listener (a process it
started listened beyond the loopback). The counts per surface, and every trial, are written.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BOUND = 30.0  # seconds to exit after a signal, and for what it started to go
LONG = {"prompt": "The cat", "max_tokens": 4000, "temperature": 0}  # ~2,300 tokens on k3-tiny
LOADS = ("long", "flood", "hangup", "idle", "mixed")
RAY_ENDS = ("success", "SIGINT", "SIGTERM", "twice", "killed worker")
OUTCOMES = ("clean", "hang", "internal", "leftover", "listener")


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "REAP_DEBUG")}
    return {**e, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


class Watch:
    """A driver's descendants (recorded while it runs) and their listening addresses."""

    def __init__(self, pid: int):
        self.pid, self.seen, self.listening = pid, {}, set()

    def poll(self) -> None:
        with contextlib.suppress(psutil.Error):
            for q in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault((q.pid, q.create_time()), q)
                    self.listening |= {c.laddr.ip for c in q.net_connections("inet")
                                       if c.status == "LISTEN"}

    def alive(self) -> list:
        out = []
        for q in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if q.is_running() and q.status() != psutil.STATUS_ZOMBIE:
                    out.append(q)
        return out

    def started(self, name: str) -> list:
        return [q for q in self.alive() if name in q.name()]


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


def finish(p: subprocess.Popen, watch: Watch, sent: float | None, want: int) -> dict:
    """Wait for the exit, then for its processes; the trial's record and outcome."""
    deadline = (sent or time.monotonic()) + BOUND
    while p.poll() is None and time.monotonic() < deadline:
        watch.poll()
        time.sleep(0.05)
    hung = p.poll() is None
    if hung:
        p.kill()
    rc, err = p.wait(), p.stderr.read()
    took = time.monotonic() - sent if sent else None
    end = time.monotonic() + BOUND
    while (left := watch.alive()) and time.monotonic() < end:
        time.sleep(0.5)
    names = sorted(q.name() for q in left)
    for q in left:
        with contextlib.suppress(psutil.Error):
            q.kill()
    outside = sorted(ip for ip in watch.listening if not loopback(ip))
    outcome = ("hang" if hung else "internal" if rc != want or "Traceback" in err
               else "leftover" if names else "listener" if outside else "clean")
    return {"outcome": outcome, "rc": rc, "seconds_to_exit": took, "left": names,
            "non_loopback": outside, "stderr": err.strip().splitlines()[-1:]}


# --------------------------------------------------------------------------- serve

def post(port: int, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def drain(s: socket.socket, limit: int | None = None) -> None:
    """Read what the server sends (`limit` bytes, then hang up)."""
    got = 0
    with contextlib.suppress(OSError):
        while (more := s.recv(4096)) and (limit is None or (got := got + len(more)) < limit):
            pass
    if limit is not None:
        s.close()


def load(kind: str, port: int, rng: random.Random) -> list:
    socks, threads = [], []

    def client(body: dict, limit: int | None) -> None:
        with contextlib.suppress(OSError):
            s = post(port, body)
            socks.append(s)
            drain(s, limit)

    plan = {"long": [(LONG | {"stream": True}, None)],
            "flood": [(LONG | {"max_tokens": 64}, None)] * 64,
            "hangup": [(LONG | {"stream": True}, rng.randint(300, 3000))] * 8,
            "idle": []}
    plan["mixed"] = plan["long"] + plan["flood"][:32] + plan["hangup"]
    for body, limit in plan[kind]:
        threads.append(threading.Thread(target=client, args=(body, limit), daemon=True))
        threads[-1].start()
    for _ in range(4 if kind in ("idle", "mixed") else 0):
        with contextlib.suppress(OSError):
            socks.append(socket.create_connection(("127.0.0.1", port)))
    return socks


def serve_trial(model: str, kind: str, sig: str, rng: random.Random) -> dict:
    cmd = [sys.executable, "-m", "reap.cli", "serve", model, "--port", "0", "--context", "4096",
           "--threads", "1"]
    p = subprocess.Popen(cmd, env=env(), stderr=subprocess.PIPE, text=True)
    watch, line = Watch(p.pid), ""
    while not line.startswith("reap serve:") and (line := p.stderr.readline()):
        pass
    if not line:
        return {"outcome": "internal", "rc": p.wait(), "stderr": p.stderr.read()[-300:]}
    socks = load(kind, int(line.split(" at ")[1].split("/v1")[0].rsplit(":", 1)[1]), rng)
    time.sleep(rng.uniform(0.5, 3.0))
    watch.poll()
    p.send_signal(getattr(signal, sig))
    try:
        return finish(p, watch, time.monotonic(), 5)
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------- calibrate --ray

def ray_trial(model: str, spec: str, out: str, end: str, rng: random.Random) -> dict:
    cmd = [sys.executable, "-m", "reap.cli", "calibrate", model, "--corpus", spec, "--tokens",
           "320", "--seq-len", "32", "--batch", "3", "--no-progress", "--budget", "1500000000",
           "--ray", "--workers", "2", "--out", out]
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    watch, sent, deadline = Watch(p.pid), None, time.monotonic() + 300
    when = rng.choice(["raylet", "shard_task"])  # while the cluster starts, or mid-run
    delay = rng.uniform(0, 1.0)
    while p.poll() is None and sent is None and time.monotonic() < deadline:
        watch.poll()
        if end == "killed worker" and (workers := watch.started("shard_task")):
            workers[0].kill()
            sent = time.monotonic()
        elif end not in ("success", "killed worker") and watch.started(when):
            time.sleep(delay)
            for sig in ["SIGINT", "SIGINT"] if end == "twice" else [end]:
                p.send_signal(getattr(signal, sig))
                time.sleep(0.3)
            sent = time.monotonic()
        time.sleep(0.05)
    want = 0 if end in ("success", "killed worker") else 5
    rec = finish(p, watch, sent if want else None, want)
    return {**rec, "signal_at": None if want == 0 else f"{when} + {delay:.2f} s"}


def corpora(root: Path) -> str:
    """Two small local jsonl corpora; their mixture spec."""
    root.mkdir()
    for kind, text in (("prose", "lorem ipsum dolor sit amet {i} " * 8),
                       ("code", "def f{i}(x):\n    return x * {i}\n")):
        lines = [json.dumps({"id": f"{kind}-{i}", "text": text.format(i=i)}) for i in range(400)]
        (root / f"{kind}.jsonl").write_text("\n".join(lines) + "\n")
    return f"{root / 'prose.jsonl'}+{root / 'code.jsonl'}"


def run(seed: int, n_serve: int, n_ray: int) -> dict:
    from reap.synth import synth

    rng, trials = random.Random(seed), []
    with tempfile.TemporaryDirectory(prefix="fuzz-shutdown-") as tmp:
        model = str(synth("k3-tiny", Path(tmp) / "k3-tiny", seed=0, dtype="float32"))
        spec = corpora(Path(tmp) / "corpora")
        for i in range(n_serve):
            kind, sig = LOADS[i % len(LOADS)], rng.choice(["SIGINT", "SIGTERM"])
            trials.append({"surface": "serve", "load": kind, "signal": sig,
                           **serve_trial(model, kind, sig, rng)})
            print(json.dumps(trials[-1]), flush=True)
        for i in range(n_ray):
            end = RAY_ENDS[i % len(RAY_ENDS)]
            trials.append({"surface": "ray", "end": end,
                           **ray_trial(model, spec, f"{tmp}/run{i}", end, rng)})
            print(json.dumps(trials[-1]), flush=True)
    counts = {s: dict(Counter(t["outcome"] for t in trials if t["surface"] == s))
              for s in ("serve", "ray")}
    return {"counts": {s: {o: c.get(o, 0) for o in OUTCOMES} for s, c in counts.items()},
            "trials": trials}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve", type=int, default=12, help="serve trials (default 12)")
    p.add_argument("--ray", type=int, default=10, help="calibrate --ray trials (default 10)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    command = "python experiments/fuzz_shutdown.py " + " ".join(argv or sys.argv[1:])
    result = {"command": command, "bound_seconds": BOUND,
              **run(args.seed, args.serve, args.ray)}
    print(json.dumps(result["counts"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
