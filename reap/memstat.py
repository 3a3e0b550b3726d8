"""What memory this process holds and may still take: RSS now and at its peak (Linux /proc),
the memory available to it (MemAvailable capped by its cgroup), and handing freed heap back to
the OS. The engine plans its budget and calibration its batches from these numbers.
"""

from __future__ import annotations

import ctypes
import functools
import os

from reap.errors import ReapError


def current_rss() -> int:
    """Resident set size of this process now, bytes (VmRSS; 0 where /proc is unavailable)."""
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """Peak resident set size of this process, bytes (VmHWM; 0 where /proc is unavailable)."""
    return _status_bytes("VmHWM")


def _status_bytes(key: str) -> int:
    try:
        return _proc_bytes("/proc/self/status", key) or 0
    except (OSError, IndexError, ValueError):
        return 0


def _proc_bytes(path: str, key: str) -> int | None:
    """The `key: N kB` line of a /proc file, in bytes (None when the file has no such line)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Return freed heap memory to the OS (glibc `malloc_trim`; a no-op elsewhere). Called
    between batches: without it glibc keeps freed activation buffers and RSS drifts above the
    live working set."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def available_memory() -> tuple[int, str]:
    """(bytes of memory this process may still use, where the number comes from):
    MemAvailable, capped by the cgroup (v2 memory.max or v1 limit_in_bytes) minus its usage."""
    avail, source = _meminfo("MemAvailable"), "MemAvailable"
    limit = _cgroup_headroom()
    if limit is not None and limit < avail:
        avail, source = limit, "cgroup limit"
    return avail, source


def _meminfo(key: str) -> int:
    found = _proc_bytes("/proc/meminfo", key)
    if found is None:
        raise ReapError(f"/proc/meminfo has no {key}")
    return found


def _cgroup_headroom() -> int | None:
    """cgroup memory limit minus current usage, or None when unlimited or unknown."""
    for limit_f, usage_f in _cgroup_files():
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            with open(usage_f) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or int(raw) >= 2**60:
            return None
        return max(0, int(raw) - usage + _inactive_file(os.path.dirname(usage_f)))
    return None


def _inactive_file(cgroup_dir: str) -> int:
    """Page cache the cgroup reclaims first (a finished run's): free, as MemAvailable counts it."""
    try:
        with open(os.path.join(cgroup_dir, "memory.stat")) as f:
            stat = dict(line.split()[:2] for line in f if line.strip())
    except (OSError, ValueError):
        return 0
    return int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))


def _cgroup_files() -> list[tuple[str, str]]:
    """Candidate (limit, usage) file pairs for this process's cgroup, v2 then v1."""
    out = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if hier == "0":
            out.append((f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"))
        elif "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            out.append((f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"))
            root = "/sys/fs/cgroup/memory/memory."
            out.append((root + "limit_in_bytes", root + "usage_in_bytes"))
    out.append(("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"))
    return out
