"""PyTorch's CPU allocator: ``DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes`` (and the
older ``not enough memory`` wording)."""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText

_CPU_RE = re.compile(
    r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to allocate (\d+) bytes"
)


def parse(text: FlatText) -> Found | None:
    m = _CPU_RE.search(text.flat)
    if not m:
        return None
    return Found(
        OomMessage(
            kind="cpu-allocator",
            format="torch-cpu",
            device="cpu",
            message=m.group(0),
            requested_bytes=int(m.group(1)),
            occurrences=len(_CPU_RE.findall(text.flat)),
        ),
        m.start(),
    )
