"""`reap calibrate --ray` stopped by SIGTERM or Ctrl-C (SIGINT to the driver alone): the driver exits with the documented code and no
process it started (the local cluster's gcs_server, raylet, agents and workers) outlives it."""

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


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_driver_and_the_local_cluster_it_started(tmp_path, sig):
    from reap.synth import synth

    model = synth("k3-tiny", tmp_path / "k3", seed=0, dtype="float32")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new local cluster
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "reap.cli", "calibrate", str(model), "--corpus", "en",
           "--tokens", "400000", "--seq-len", "64", "--no-progress", "--ray", "--workers", "1",
           "--out", str(tmp_path / "stats")]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    started = {}
    try:
        deadline = time.monotonic() + 180
        while not any("raylet" in q.name() for q in started.values() if _alive(q)):
            assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < deadline, "the local cluster did not start"
            started.update({q.pid: q for q in _descendants(p.pid)})
            time.sleep(0.2)
        for _ in range(10):  # the workers start after the cluster
            started.update({q.pid: q for q in _descendants(p.pid)})
            time.sleep(0.3)
        assert p.poll() is None, "the run ended before the signal: give it more tokens"
        p.send_signal(getattr(signal, sig))
        assert p.wait(120) == 5, p.stderr.read()
        deadline = time.monotonic() + 60
        while (left := [q for q in started.values() if _alive(q)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, [(q.pid, q.name()) for q in left]
    finally:
        p.kill()
        for q in started.values():
            if _alive(q):
                q.kill()
