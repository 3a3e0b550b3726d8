"""The compiled C kernels of `reap.quant` (source: `mxfp4_kernels.c` beside this file): built on
first use with the system C compiler (`cc -O3 -march=native`, cached under the reap cache
directory), loaded through ctypes (calls release the GIL), and `parallel` to split a call's
rows over torch's intra-op thread count.

    lib = library()               # the loaded kernels, or None (no compiler, REAP_NO_CKERNEL=1)
    parallel(run, rows, 256)      # run(a, b) on row ranges, one thread each
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from reap.errors import WriteError
from reap.fileio import atomic_path

_SOURCE = Path(__file__).with_name("mxfp4_kernels.c")
# no fp contraction: the kernels' roundings are the ones written (fmaf where fused)
_CC = ["cc", "-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]
_LIB: list = []  # [ctypes.CDLL or None] once tried
_KERNEL_THREADS: list[int] = []  # the kernels' thread count while torch runs on one
_LIB_LOCK = threading.Lock()


def library():
    """The compiled kernels, built once per source and machine; None if unavailable."""
    with _LIB_LOCK:
        if not _LIB:
            _LIB.append(None if os.environ.get("REAP_NO_CKERNEL") else build())
        return _LIB[0]


def machine_tag() -> str:
    """What a `-march=native` build depends on: the architecture and the CPU's feature flags
    (a cache directory shared by machines of different CPUs must not hand one's library to
    another, where it could stop on an illegal instruction)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return os.uname().machine + " " + " ".join(sorted(flags.split(":", 1)[-1].split()))


def compile_cached(source, prefix: str, flags: tuple[str, ...] = ()):
    """Compile C `source` (a path, or several compiled into one library; with extra compiler
    `flags`) into the cache as `prefix-<tag>.so`, the tag covering the sources, the headers
    beside them, the flags and the CPU; the loaded library, or None without a compiler or write
    access (the torch paths then do the work)."""
    from reap.cache import cache_dir

    sources = [source] if isinstance(source, Path) else list(source)
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    text = "".join(p.read_text() for p in (*sources, *headers))
    cc = [*_CC, *flags]
    tag = hashlib.sha256((text + " ".join(cc) + machine_tag()).encode()).hexdigest()[:16]
    so = cache_dir() / "kernels" / f"{prefix}-{tag}.so"
    try:
        if not so.is_file():
            with atomic_path(so) as tmp:  # concurrent builds leave one complete file
                cmd = [*cc, "-o", tmp, *map(str, sources), "-lm"]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        return ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError, WriteError):
        return None


def build(flags: tuple[str, ...] = ()):
    """The MXFP4 kernels compiled with extra compiler `flags` (`compile_cached`), their
    signatures declared; None when they cannot be built."""
    lib = compile_cached(_SOURCE, "mxfp4", flags)
    if lib is None:
        return None
    for name in ("reap_decode_u32", "reap_decode_u64"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    lib.reap_mxfp4_linear.restype = None
    lib.reap_mxfp4_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
    lib.reap_mxfp4_split_x.restype = ctypes.c_int
    return lib


def threads() -> int:
    """The threads a kernel call splits its work over: torch's intra-op thread count, or inside
    `torch_serial` the count torch had when it began."""
    return _KERNEL_THREADS[-1] if _KERNEL_THREADS else torch.get_num_threads()


@contextmanager
def torch_serial(on: bool = True):
    """Inside (when `on`): torch's own ops on one thread, the kernels on the threads torch had
    (`threads`). For a step whose weight products all run in the kernels, what is left to
    torch is small ops (norms, rotations, softmax, attention) that a second OpenMP thread slows
    down more than it helps: its barrier waits for a thread the OS may not have scheduled.
    Measured on 1b float32 at 2 threads, one process alternating: prefill of 32 tokens 1.27x,
    64 tokens 1.35x, 512 tokens 1.13x the rate with torch on both threads."""
    n = torch.get_num_threads()
    if not on or n == 1:
        yield
        return
    _KERNEL_THREADS.append(n)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _KERNEL_THREADS.pop()


def parallel(run, total: int, grain: int, align: int = 1) -> None:
    """run(a, b) over [0, total) split into ranges of at least `grain` items, one per kernel
    thread at most (`threads`; cuts at multiples of `align`), each in its own thread (the C
    calls release the GIL)."""
    n = min(threads(), max(1, total // grain))
    cuts = [min(total, total * i // n // align * align) for i in range(n)] + [total]
    if n == 1:
        run(0, total)
        return
    workers = [threading.Thread(target=run, args=(cuts[i], cuts[i + 1])) for i in range(n)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
