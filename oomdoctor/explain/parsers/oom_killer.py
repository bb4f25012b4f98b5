"""The Linux kernel's OOM killer as dmesg / ``journalctl -k`` print it: the host (or the container's memory cgroup)
ran out of RAM and the kernel killed the process.

* ``Out of memory: Killed process N (python) total-vm:...kB, anon-rss:...kB, ...`` (kernels >= 4.19);
* ``Out of memory: Kill process N (python) score S or sacrifice child`` followed by ``Killed process N (python)
  total-vm:...kB, anon-rss:...kB`` (older kernels);
* ``Memory cgroup out of memory: Killed process N ...`` when a container's limit was reached (Docker ``--memory``,
  Kubernetes ``resources.limits.memory``, systemd ``MemoryMax``), with ``memory: usage XkB, limit YkB`` before it.
"""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText
from oomdoctor.units import format_bytes

_OOM_KILLER_RE = re.compile(
    r"(Memory cgroup o|O)ut of memory: Kill(?:ed)? process (\d+) \(([^)]*)\)(?: score \d+ or sacrifice child)?"
)
_RSS_RE = r"Killed process {pid} \([^)]*\),? total-vm:(\d+)kB, anon-rss:(\d+)kB"
_MEMCG_LIMIT_RE = re.compile(r"memory: usage (\d+)kB, limit (\d+)kB")


def _resident(flat: str, m: re.Match) -> int | None:
    """The killed process's anonymous resident memory, on the kill line or (older kernels) the line after it."""
    rss = re.compile(_RSS_RE.format(pid=m.group(2))).search(flat, m.start())
    return int(rss.group(2)) * 1024 if rss else None


def _cgroup_limit(flat: str, m: re.Match) -> int | None:
    """The memory cgroup's limit printed before a cgroup kill (``None`` for a host-wide kill)."""
    if not m.group(1).startswith("Memory cgroup"):
        return None
    limits = list(_MEMCG_LIMIT_RE.finditer(flat, 0, m.start()))
    return int(limits[-1].group(2)) * 1024 if limits else None


def parse(text: FlatText) -> Found | None:
    m = _OOM_KILLER_RE.search(text.flat)
    if not m:
        return None
    cgroup = m.group(1).startswith("Memory cgroup")
    rss, limit = _resident(text.flat, m), _cgroup_limit(text.flat, m)
    where = "host RAM"
    if cgroup:
        where = "its container's memory cgroup" + (f" (limit {format_bytes(limit)})" if limit else "")
    note = f"the kernel killed process {m.group(2)} ({m.group(3)}): {where} ran out, not the GPU" + (
        f"; it held {format_bytes(rss)} resident" if rss else ""
    )
    return Found(
        OomMessage(
            kind="cpu-oom-killer",
            format="linux-oom-killer-cgroup" if cgroup else "linux-oom-killer",
            device="cpu",
            message=m.group(0),
            total_bytes=limit,
            this_process_bytes=rss,
            occurrences=len(_OOM_KILLER_RE.findall(text.flat)),
            notes=(note,),
        ),
        m.start(),
    )
