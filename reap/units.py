"""Byte sizes as people write them: `parse_bytes("8GB")` for arguments, `format_bytes(n)` for
messages and tables. Decimal units (KB, MB, GB, TB = powers of 1000) and binary ones (KiB, MiB,
GiB, TiB = powers of 1024), as disks and `free` report them.
"""

from __future__ import annotations

import re

from reap.errors import ReapError

_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)
_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


def parse_bytes(text: str) -> int:
    """'8GB', '512MiB', '1.5 TB', '1.5g', '1000000' -> bytes; ReapError (exit 2) otherwise."""
    match = _SIZE_RE.fullmatch(text)
    if not match:
        raise ReapError(f"cannot read size {text!r}: cannot parse it (use e.g. 8GB, 512MiB, 1.5TB)")
    value, prefix, binary = float(match.group(1)), match.group(2).upper(), bool(match.group(3))
    power = "KMGT".find(prefix) + 1 if prefix else 0
    size = int(value * (1024 if binary else 1000) ** power)
    if size >= 2**63:  # beyond any machine, and beyond the 64-bit sizes torch and the OS use
        raise ReapError(f"cannot read size {text!r}: larger than 2^63 bytes")
    return size


def format_bytes(n: float, digits: int = 3) -> str:
    """1.5e9 -> '1.500 GB' (the largest decimal unit not above n; `digits` after the point)."""
    for unit, size in _DECIMAL:
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"
