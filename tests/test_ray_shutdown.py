"""`reap calibrate --ray` ended mid-run by SIGTERM or Ctrl-C (SIGINT to the driver alone): the
driver exits 5 and no process it started (the local cluster's gcs_server, raylet, agents and
workers) outlives it. A killed worker, success and signals during start-up: test_shutdown."""

import os
import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _start(tmp_path, tokens: int):
    from reap.synth import synth

    model = synth("k3-tiny", tmp_path / "k3", seed=0, dtype="float32")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new local cluster
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "reap.cli", "calibrate", str(model), "--corpus", "en",
           "--tokens", str(tokens), "--seq-len", "64", "--no-progress", "--ray", "--workers", "1",
           "--out", str(tmp_path / "stats")]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _watch_until_workers(p, started: dict) -> None:
    """Record the driver's descendants until the cluster and a task's worker run."""
    deadline = time.monotonic() + 180
    while not any(q.name().startswith("ray::") and "Agent" not in q.name()
                  for q in started.values() if _alive(q)):
        if p.poll() is not None:
            return
        assert time.monotonic() < deadline, "the local cluster did not start"
        started.update({q.pid: q for q in _descendants(p.pid)})
        time.sleep(0.1)
    started.update({q.pid: q for q in _descendants(p.pid)})


def _none_left(started: dict) -> None:
    deadline = time.monotonic() + 60
    while (left := [q for q in started.values() if _alive(q)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [(q.pid, q.name()) for q in left]


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_run_leaves_no_process_it_started(tmp_path, how):
    p, started = _start(tmp_path, 400_000), {}
    try:
        _watch_until_workers(p, started)
        for _ in range(10):  # the run under way, past Ray's own start-up
            started.update({q.pid: q for q in _descendants(p.pid)})
            time.sleep(0.3)
        assert p.poll() is None, "the run ended before the signal: give it more tokens"
        p.send_signal(getattr(signal, how))
        assert p.wait(120) == 5, p.stderr.read()
        _none_left(started)
    finally:
        p.kill()
        for q in started.values():
            if _alive(q):
                q.kill()
