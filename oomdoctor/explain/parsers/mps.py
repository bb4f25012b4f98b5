"""Apple MPS: ``MPS backend out of memory (MPS allocated: A, other allocations: O, max allowed: M). Tried to
allocate R``."""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText
from oomdoctor.units import parse_size

_MPS_RE = re.compile(
    r"MPS backend out of memory \(MPS allocated: ([\d.]+\s*\w+), other allocations: ([\d.]+\s*\w+), "
    r"max allowed: ([\d.]+\s*\w+)\)\.\s*Tried to allocate ([\d.]+\s*\w+)"
)
_NOTE = ("MPS: 'max allowed' is the high-watermark limit (PYTORCH_MPS_HIGH_WATERMARK_RATIO), "
         "'other allocations' are this process's non-tensor allocations")


def mps_size(text: str) -> int:
    """MPSAllocator prints binary sizes labelled KB/MB/GB (``size / 1048576.0 << " MB"``)."""
    return parse_size(re.sub(r"([KMGTPE])B$", r"\1iB", text.strip()))


def parse(text: FlatText) -> Found | None:
    m = _MPS_RE.search(text.flat)
    if not m:
        return None
    allocated, other, allowed, requested = (mps_size(m.group(i)) for i in range(1, 5))
    return Found(OomMessage(
        kind="mps-allocator", format="torch-mps", device="mps", message=m.group(0),
        requested_bytes=requested, total_bytes=allowed, allocated_bytes=allocated, non_pytorch_bytes=other,
        occurrences=len(_MPS_RE.findall(text.flat)), notes=(_NOTE,),
    ), m.start())
