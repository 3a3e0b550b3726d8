"""One loader and one thread pool for the compiled C kernels of `reap.quant`.

`library(name)` builds a library on first use with `$CC` (default `cc`) `-O3 -march=native` then
`$CFLAGS`, and loads it through ctypes (calls release the GIL). The cache is a trust boundary: a
private directory, builds renamed into place, a sha256 recorded beside each library; a library
is loaded only when it is ours, others cannot write it and its bytes match the record, else it
is built again. Without a compiler the torch paths run and stderr says once what that costs.

    lib = library("dense")        # the loaded library, or None (no compiler, REAP_NO_CKERNEL=1)
    parallel(run, rows, 256)      # run(a, b) on row ranges, over the step library's pool
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from reap.cache import cache_dir
from reap.errors import ReapError
from reap.fileio import atomic_path

_HERE = Path(__file__).parent
# no fp contraction: the kernels' roundings are the ones written (fmaf where fused)
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
_LIBRARIES = {  # name: sources, extra flags, C signatures "name=result:arguments" (`_CTYPES`)
    "mxfp4": ("mxfp4_kernels.c", "", ("reap_decode_u32=v:ppppq reap_decode_u64=v:ppppq "
              "reap_mxfp4_linear=v:pppppqqqqq reap_mxfp4_split_x=i:")),
    "dense": ("dense_kernels.c", "", ("reap_bf16_linear=v:pppqqqqq reap_f32_linear=v:pppqqqqq "
              "reap_bf16_gate_up=v:ppppqqqqqq reap_f32_gate_up=v:ppppqqqqqq")),
    "step": ("step_pool.c step_kernels.c prefill_kernels.c", "-pthread", ("reap_simd=i: "
             "reap_arg_layout=s: reap_pool_size=i:i reap_pool_spin=v:i reap_parallel=v:ppqq "
             "reap_attn_step=v:pp reap_moe_step=v:p reap_token_step=v:pp reap_linear=v:pppqqqq "
             "reap_attn_prefill=v:ppq reap_attn_prefill_scratch=q:pq reap_residual=v:ppqq "
             "reap_moe_prefill=v:p reap_linear_pairs=i:pppqqq reap_moe_prefill_scratch=v:qqqqqp "
             "reap_head_step=v:pppqqqqdpp")),
}  # fmt: skip
# v none, i int, q int64, d double, p pointer, s char*
_CTYPES = {"v": None, "i": ctypes.c_int, "q": ctypes.c_int64, "d": ctypes.c_double,
           "p": ctypes.c_void_p, "s": ctypes.c_char_p}  # fmt: skip
_COST = "the torch fallback runs at about 0.37x their speed and bf16 greedy tokens may differ"
_LOADED: dict = {}  # (name, flags, where) -> ctypes.CDLL or None, once tried
_LOCK = threading.Lock()
_SAID: set = set()  # warnings already printed
_TEMP: list = []  # the private temporary directory, once the cache was refused
_KERNEL_THREADS: list[int] = []  # the kernels' thread count while torch runs on one
_SPINNING = [0]  # open `spinning()` blocks
_SPIN_LOCK = threading.Lock()
SPINS = 20000  # pause loops idle workers spin between calls (0 after a pooled call)


def _arg_layout(header: Path) -> dict[str, tuple[str, ...]]:
    """The argument blocks declared in `header`: list name -> field names, in index order."""
    found = re.findall(r"#define REAP_(\w+)_ARGS\(arg\)((?:.*\\\n)*.*)", header.read_text())
    return {n.lower(): tuple(f.lower() for f in re.findall(r"arg\((\w+)\)", b)) for n, b in found}


ARGS = _arg_layout(_HERE / "step_args.h")  # the step kernels' int64 argument blocks


def library(name: str = "mxfp4", flags: tuple[str, ...] = (), where: Path | None = None):
    """The compiled library `name` (extra compiler `flags`, sources from `where`: the tests'
    vector widths, a benchmark's other version), built once per source, flags and machine, its
    signatures declared; None if unavailable (REAP_NO_CKERNEL=1, no compiler, failed build)."""
    key = (name, tuple(flags), where or _HERE)
    if key in _LOADED:  # no lock on the per-call path
        return _LOADED[key]
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = None if os.environ.get("REAP_NO_CKERNEL") else _load(*key)
        return _LOADED[key]


def _load(name: str, flags: tuple[str, ...], where: Path):
    files, own, signatures = _LIBRARIES[name]
    sources = [Path(where) / f for f in files.split()]
    try:
        cc = shlex.split(os.environ.get("CC", "")) or ["cc"]
        cmd = [*cc, *_FLAGS, *own.split(), *flags, *shlex.split(os.environ.get("CFLAGS", ""))]
    except ValueError as e:  # an unbalanced quote
        _say(f"compiled kernels off, CC or CFLAGS cannot be split ({e}); {_COST}", "off")
        return None
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    text = "".join(p.read_text() for p in (*sources, *headers)) + shlex.join(cmd) + machine_tag()
    so = _private_dir() / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    lib = _open_trusted(so) or _build(cmd, sources, so, quiet=bool(flags) or where != _HERE)
    if lib is None:
        return None
    try:
        for fn, sig in (d.split("=") for d in signatures.split()):
            getattr(lib, fn).restype = _CTYPES[sig[0]]
            getattr(lib, fn).argtypes = [_CTYPES[c] for c in sig[2:]]
        if name == "step" and lib.reap_arg_layout().decode() != layout_text(ARGS):
            raise AttributeError("another argument layout than step_args.h")
    except AttributeError as e:  # sources of another version
        _say(f"{so} not used: {e}")
        return None
    return lib


def layout_text(args: dict[str, tuple[str, ...]]) -> str:
    """The layout as `reap_arg_layout()` spells it: "ATTN H X2 ... MOE X2 ..."."""
    return " ".join(" ".join((n, *f)).upper() for n, f in args.items())


def _say(message: str, key: str | None = None) -> None:
    """One warning line on stderr, once per process and `key` (default: the message)."""
    if (key or message) not in _SAID:
        _SAID.add(key or message)
        print(f"reap: warning: {message}", file=sys.stderr)


def _private(st: os.stat_result) -> bool:
    """Owned by this user and not writable by group or others."""
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_dir() -> Path:
    """`cache_dir()/kernels` (made 0700) if private, else a temporary one (said once)."""
    d = cache_dir() / "kernels"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and _private(st):
            return d
    except OSError:
        pass
    if not _TEMP:
        _TEMP.append(Path(tempfile.mkdtemp(prefix="reap-kernels-")))
        atexit.register(shutil.rmtree, _TEMP[0], True)
    _say(f"kernel cache {d} is unusable (not a directory of this user's that only it can "
         f"write): compiling into {_TEMP[0]} (fix: chmod 700 {d}, or remove it)")  # fmt: skip
    return _TEMP[0]


def _open_private(path: Path) -> int | None:
    """A read descriptor of `path` if it is a private regular file (no symlink), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: no wait
    except OSError:
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and _private(st):
        return fd
    os.close(fd)
    return None


def _digest(fd: int) -> str:
    return hashlib.sha256(os.pread(fd, os.fstat(fd).st_size, 0)).hexdigest()


def _dlopen(fd: int, so: Path):
    """Load `so` (open as `fd`) through a descriptor where the OS has them: the bytes checked
    are the bytes loaded (a copy of `fd` kept open: a name seen before is an old library)."""
    if not os.path.isdir("/proc/self/fd"):
        return ctypes.CDLL(str(so))
    return ctypes.CDLL(f"/proc/self/fd/{os.dup(fd)}")


def _open_trusted(so: Path):
    """`so` loaded if it and its record are private and its sha256 is the recorded one."""
    fds = [_open_private(p) for p in (so, Path(f"{so}.sha256"))]
    try:
        if None not in fds and os.read(fds[1], 100).decode().strip() == _digest(fds[0]):
            return _dlopen(fds[0], so)
    except (OSError, UnicodeDecodeError):
        pass
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
    return None


def _build(cmd: list[str], sources: list[Path], so: Path, quiet: bool):
    """Compile to a temp name beside `so`, rename it to `so`, record its sha256 beside it (a
    crash between is a mismatch) and load it; None (said once on stderr, unless `quiet`) when
    there is no compiler or the build fails."""
    fd = None
    try:
        with atomic_path(so) as tmp:
            subprocess.run([*cmd, "-o", tmp, *map(str, sources), "-lm"], check=True,
                           capture_output=True, timeout=300)  # fmt: skip
            os.chmod(tmp, 0o700)
            fd = _open_private(tmp)
            if fd is None:
                raise OSError(f"{tmp} is not private after the build")
        with atomic_path(f"{so}.sha256") as tmp, open(
                os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(_digest(fd) + "\n")
        return _dlopen(fd, so)
    except (OSError, ReapError, subprocess.SubprocessError) as e:
        e = e.__cause__ or e
        said = (getattr(e, "stderr", None) or str(e).encode()).decode(errors="replace")
        why = (f"no C compiler ({cmd[0]})" if isinstance(e, FileNotFoundError) else str(e)
               if isinstance(e, ReapError)  # the cached name is a link, FIFO or directory
               else f"{cmd[0]} failed: {said.strip().splitlines()[-1:]}")  # fmt: skip
        if not quiet:
            _say(f"compiled kernels off, {why}; {_COST} (set CC to a C compiler)", "off")
        return None
    finally:
        if fd is not None:
            os.close(fd)


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


def threads() -> int:
    """The threads a kernel call splits its work over: torch's intra-op thread count, or inside
    `torch_serial` the count torch had when it began."""
    return _KERNEL_THREADS[-1] if _KERNEL_THREADS else torch.get_num_threads()


@contextmanager
def torch_serial(on: bool = True):
    """Inside (when `on`): torch's own ops on one thread, the kernels on the threads torch had
    (`threads`): a step whose weight products all run in the kernels leaves torch small ops
    that a second OpenMP thread slows down (its barrier waits for a thread the OS may not have
    scheduled; 1b float32, 2 threads: prefill of 32/64/512 tokens 1.27x/1.35x/1.13x)."""
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


@contextmanager
def spinning(lib):
    """Pool calls with little torch work between them (one between torch ops, or a step of
    many): the pool at `threads()`, its workers spinning between the calls inside and sleeping
    at once after the outermost block, so that torch's OpenMP threads get the cores next."""
    lib.reap_pool_size(threads())
    lib.reap_pool_spin(SPINS)
    with _SPIN_LOCK:
        _SPINNING[0] += 1
    try:
        yield
    finally:
        with _SPIN_LOCK:
            _SPINNING[0] -= 1
            if not _SPINNING[0]:
                lib.reap_pool_spin(0)


_TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def parallel(run, total: int, grain: int, align: int = 1) -> None:
    """run(a, b) over [0, total) in ranges of at least `grain` items cut at multiples of
    `align`, on the pool (the caller among its `threads()`; the C calls in `run` release the
    GIL); on this thread alone when the pool is missing, busy with another caller's job (a
    call from inside a pool job) or the work is small. An exception in `run` is raised here."""
    lib = library("step")
    if lib is None or total < 2 * grain or threads() == 1:
        run(0, total)
        return
    errors = []

    def task(_ctx, a: int, b: int) -> None:
        try:
            run(a * align, min(total, b * align))
        except BaseException as e:  # noqa: BLE001  # a ctypes callback cannot raise: kept
            errors.append(e)

    units = -(-total // align)
    with spinning(lib):
        lib.reap_parallel(_TASK(task), None, units, max(1, grain // align))
    if errors:
        raise errors[0]
