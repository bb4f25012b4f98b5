"""Byte sizes: parsed and printed in this one place.

Decimal units are powers of 10 (``GB`` = 10**9, as GPU vendors and ``--gpu-mem 24GB`` mean them);
binary units are powers of 2 (``GiB`` = 2**30, as PyTorch prints them). All sizes inside oomdoctor are
integer bytes.
"""

from __future__ import annotations

import math
import re

from oomdoctor.errors import BadInput

DECIMAL = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15, "EB": 10**18}
BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50, "EIB": 2**60}
UNITS = {**DECIMAL, **BINARY, "BYTES": 1, "BYTE": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}

#: Sizes from 1 ZiB (2^70) up are typos (``1e999GB``), not memory; drivers do print 2^64 for "unknown".
MAX_SIZE = 2**70

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float, *, what: str = "size") -> int:
    """Parse ``24GB`` (10**9), ``24GiB`` (2**30), ``24000MiB``, ``1.5 TB`` or ``512B`` into bytes; a Python int is a
    byte count.

    Raises :class:`BadInput` naming the accepted forms on anything else; text without a unit (``24``: 24 bytes or
    24 GB?) is an error with a hint, and so are zero and sizes too large to be real.
    """
    if isinstance(text, bool):
        raise BadInput(f"{what}: expected a size such as 24GB or 24GiB, got {text!r}")
    if isinstance(text, (int, float)):
        if text < 0 or not math.isfinite(text) or text >= MAX_SIZE:
            raise BadInput(f"{what}: a size must be a positive number of bytes, got {text!r}")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise BadInput(
            f"{what}: cannot read {text!r} as a size; use e.g. 24GB (10^9 bytes), 24GiB (2^30 bytes) or 24000MiB"
        )
    value = float(m.group(1))
    if not m.group(2):
        raise BadInput(
            f"{what}: {text!r} has no unit",
            f"write {m.group(1)}GB (10^9 bytes) or {m.group(1)}GiB (2^30 bytes); {m.group(1)}B for bytes",
        )
    unit = m.group(2).upper()
    if unit not in UNITS:
        raise BadInput(
            f"{what}: unknown unit {m.group(2)!r} in {text!r}; use B, KB, MB, GB, TB (powers of 10) "
            "or KiB, MiB, GiB, TiB (powers of 2)"
        )
    size = value * UNITS[unit]
    if not math.isfinite(size) or size >= MAX_SIZE:
        raise BadInput(f"{what}: {text!r} is not a real memory size (at most {format_bytes(MAX_SIZE)})")
    return int(round(size))


def format_bytes(n: int | float | None, *, binary: bool = True, digits: int = 2) -> str:
    """Human-readable size: ``format_bytes(3 * 2**30) == '3.00 GiB'``; ``binary=False`` prints GB."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    steps = (
        [("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]
        if binary
        else [("EB", 10**18), ("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)]
    )
    for name, size in steps:
        if n >= size:
            return f"{sign}{n / size:.{digits}f} {name}"
    return f"{sign}{int(n)} B"


def gib(n: int | float) -> float:
    """Bytes as GiB (float), for tables and plots."""
    return n / 2**30
