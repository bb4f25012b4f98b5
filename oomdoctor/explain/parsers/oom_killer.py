"""The Linux kernel's OOM killer (dmesg / journalctl -k): ``Out of memory: Killed process N (python)
total-vm:...kB, anon-rss:...kB``: the host ran out of RAM and the kernel killed the process."""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText
from oomdoctor.units import format_bytes

_OOM_KILLER_RE = re.compile(
    r"Out of memory: Kill(?:ed)? process (\d+) \(([^)]*)\)(?: score \d+ or sacrifice child)?"
    r"(?:,? total-vm:(\d+)kB, anon-rss:(\d+)kB)?"
)


def parse(text: FlatText) -> Found | None:
    m = _OOM_KILLER_RE.search(text.flat)
    if not m:
        return None
    rss = int(m.group(4)) * 1024 if m.group(4) else None
    note = (f"the kernel killed process {m.group(1)} ({m.group(2)}): host RAM, not the GPU"
            + (f"; it held {format_bytes(rss)} resident" if rss else ""))
    return Found(OomMessage(
        kind="cpu-oom-killer", format="linux-oom-killer", device="cpu", message=m.group(0),
        this_process_bytes=rss, occurrences=len(_OOM_KILLER_RE.findall(text.flat)), notes=(note,),
    ), m.start())
