"""The input text made searchable: escaped tracebacks restored, rank prefixes stripped, one flat string in which a
message wrapped over several lines reads as one, and the sizes the messages print read as bytes."""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass

from oomdoctor.units import parse_size

#: A size as torch prints it (``N bytes``, ``1.25 GiB``; larger units and decimal ones are accepted too).
SIZE = r"\d+(?:\.\d+)?\s*(?:bytes|[KMGTPE]i?B|B)\b"

#: Anything at or above this is not a real GPU/host size (NVML's "not available" is 2**64 - 1 bytes).
ABSURD_BYTES = 2**50

_PREFIX_RE = re.compile(r"^\s*\[(?:rank|default)(\d+)\]:\s?")
_OOM_LINE_RE = re.compile(r"out of memory|DefaultCPUAllocator|Failed to clone|dispatched on the CPU", re.I)


@dataclass(frozen=True)
class FlatText:
    """The input as lines (for tracebacks) and as one whitespace-collapsed string (for messages)."""

    lines: tuple[str, ...]
    """Input lines with rank prefixes stripped."""
    line_ranks: tuple[int | None, ...]
    """Each line's ``[rankN]:`` / ``[defaultN]:`` rank, ``None`` without a prefix."""
    flat: str
    """Every line stripped and whitespace-collapsed, joined with single spaces."""
    offsets: tuple[int, ...]
    """Offset in :attr:`flat` where each line starts."""

    def line_of(self, offset: int) -> int:
        """Index of the line holding ``flat[offset]``."""
        return max(0, bisect_right(self.offsets, offset) - 1)

    def oom_ranks(self) -> tuple[int, ...]:
        """Ranks whose prefixed lines report an out-of-memory error, sorted."""
        return tuple(
            sorted({r for r, ln in zip(self.line_ranks, self.lines) if r is not None and _OOM_LINE_RE.search(ln)})
        )


def size(text: str | None) -> int | None:
    """Bytes of a size torch printed (whitespace inside tolerated); ``None`` for ``None``."""
    if text is None:
        return None
    return parse_size(re.sub(r"\s+", " ", text.strip()))


def is_absurd(value: int | None, total: int | None) -> bool:
    """True for NVML's "unknown" values: 2**64 - 1 bytes, or more than the device's total."""
    if value is None:
        return False
    return value >= ABSURD_BYTES or (total is not None and value > total)


def unescape_logged_tracebacks(text: str) -> str:
    """Tracebacks stored as one escaped string (JSON logs, experiment trackers): restore their lines and quotes."""
    if "\\n" not in text:
        return text
    out = []
    for line in text.split("\n"):
        if "\\n" in line and ("Traceback (most recent call last)" in line or "out of memory" in line.lower()):
            line = (
                line.replace("\\r\\n", "\n")
                .replace("\\n", "\n")
                .replace('\\"', '"')
                .replace("\\'", "'")
                .replace("\\\\", "\\")
            )
        out.append(line)
    return "\n".join(out)


def strip_rank_prefix(raw: str) -> tuple[str, int | None]:
    """``raw`` without its (possibly nested: ``[default0]:[rank0]:``) torchrun prefixes, and the rank they name."""
    rank = None
    m = _PREFIX_RE.match(raw)
    while m:
        rank = int(m.group(1))
        raw = raw[m.end() :]
        m = _PREFIX_RE.match(raw)
    return raw, rank


def flatten(text: str) -> FlatText:
    """Prepare ``text`` (a log or traceback) for the parsers and the traceback reader."""
    raw_lines = unescape_logged_tracebacks(text).replace("\r\n", "\n").replace("\r", "\n").split("\n")
    stripped = [strip_rank_prefix(raw) for raw in raw_lines]
    parts = [re.sub(r"\s+", " ", ln.strip()) for ln, _ in stripped]
    offsets, pos = [], 0
    for part in parts:
        offsets.append(pos)
        pos += len(part) + 1
    return FlatText(
        lines=tuple(ln for ln, _ in stripped),
        line_ranks=tuple(r for _, r in stripped),
        flat=" ".join(parts),
        offsets=tuple(offsets),
    )
