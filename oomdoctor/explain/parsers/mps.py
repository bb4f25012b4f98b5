"""Apple MPS (``aten/src/ATen/mps/MPSAllocator.mm``): ``MPS backend out of memory (MPS allocated: A, other
allocations: O, max allowed: M). Tried to allocate R on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 ...``,
and ``Invalid buffer size: R`` when one tensor is larger than the largest buffer Metal allows."""

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
_BUFFER_RE = re.compile(r"Invalid buffer size: ([\d.]+\s*\w+)")
_BUFFER_NOTE = (
    "MPS: one tensor larger than the largest single buffer Metal allows on this Mac (maxBufferLength, "
    "a fixed share of the unified memory): no watermark setting raises it, the tensor must shrink"
)
_NOTE = (
    "MPS: 'max allowed' is the high-watermark limit (PYTORCH_MPS_HIGH_WATERMARK_RATIO), "
    "'other allocations' are this process's non-tensor allocations"
)


def mps_size(text: str) -> int:
    """MPSAllocator prints binary sizes labelled KB/MB/GB (``size / 1048576.0 << " MB"``)."""
    return parse_size(re.sub(r"([KMGTPE])B$", r"\1iB", text.strip()))


def _buffer_too_large(text: FlatText) -> Found | None:
    m = _BUFFER_RE.search(text.flat)
    if not m:
        return None
    return Found(
        OomMessage(
            kind="mps-allocator",
            format="torch-mps-buffer",
            device="mps",
            message=m.group(0),
            requested_bytes=mps_size(m.group(1)),
            occurrences=len(_BUFFER_RE.findall(text.flat)),
            notes=(_BUFFER_NOTE,),
        ),
        m.start(),
    )


def parse(text: FlatText) -> Found | None:
    m = _MPS_RE.search(text.flat)
    if not m:
        return _buffer_too_large(text)
    allocated, other, allowed, requested = (mps_size(m.group(i)) for i in range(1, 5))
    return Found(
        OomMessage(
            kind="mps-allocator",
            format="torch-mps",
            device="mps",
            message=m.group(0),
            requested_bytes=requested,
            total_bytes=allowed,
            allocated_bytes=allocated,
            non_pytorch_bytes=other,
            occurrences=len(_MPS_RE.findall(text.flat)),
            notes=(_NOTE,),
        ),
        m.start(),
    )
