"""PyTorch's caching allocator on CUDA, HIP (ROCm) and XPU (wordings of ``c10/cuda/CUDACachingAllocator.cpp``,
whose ``format_size`` prints ``N bytes`` up to 1 KiB, then KiB/MiB/GiB with two decimals):

* torch >= 2.2: ``CUDA out of memory. Tried to allocate X. GPU 0 has a total capacity of T of which F is free.
  [Process P has Y memory in use. ...] Including non-PyTorch memory, this process has Y memory in use. [M allowed; ]Of
  the allocated memory A is allocated by PyTorch, [with Z allocated in private pools (e.g., CUDA Graphs), ]and U is
  reserved by PyTorch but unallocated.`` The process entries come in NVML's order, ``M allowed;`` only under
  ``set_per_process_memory_fraction``; the hint names ``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` in
  newer torch; XPU prints no free memory;
* torch 2.1: the same with the ``total capacty`` typo;
* torch <= 2.0: ``CUDA out of memory. Tried to allocate X (GPU 0; T total capacity; A already allocated; F free;
  [M allowed; ]R reserved in total by PyTorch)`` (torch < 1.5 printed ``R cached`` instead).

Values NVML cannot know are printed as ``2**64 - 1`` bytes (``17179869184.00 GiB``, WSL, some containers) or as
``0 bytes``; they are read as unknown (``None``), never used as numbers. An FSDP clone warning around the message
(:mod:`oomdoctor.explain.parsers.fsdp`) makes it a ``fsdp-clone-warning``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from oomdoctor.explain.parsers import cuda_error, fsdp
from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage, ProcessUse
from oomdoctor.explain.text import SIZE, FlatText, is_absurd, size
from oomdoctor.units import format_bytes

GiB = 2**30

_CUDA_OOM_RE = re.compile(rf"\b(CUDA|HIP|XPU) out of memory\.?\s*(?:Tried to allocate ({SIZE}))?", re.I)
_NEW_TOTAL_RE = re.compile(rf"GPU (\d+) has a total (capacity|capacty) of ({SIZE})(?: of which ({SIZE}) is free)?")
_PROC_RE = re.compile(rf"(?:Process (\d+)|Including non-PyTorch memory, this process) has ({SIZE}) memory in use")
_NEW_ALLOC_RE = re.compile(
    rf"Of the allocated memory ({SIZE}) is allocated by PyTorch,\s*"
    rf"(?:with ({SIZE}) allocated in private pools \(e\.g\., CUDA Graphs\),\s*)?"
    rf"and ({SIZE}) is reserved by PyTorch but unallocated"
)
_OLD_RE = re.compile(
    rf"\(GPU (\d+); ({SIZE}) total capacity; ({SIZE}) already allocated; ({SIZE}) free;\s*"
    rf"(?:({SIZE}) allowed;\s*)?({SIZE}) (reserved in total by PyTorch|cached)\)"
)
#: The ``set_per_process_memory_fraction`` cap as torch >= 2.1 prints it, between the process list and ``Of the
#: allocated memory`` (torch <= 2.0 prints it inside the parentheses: ``_OLD_RE``).
_ALLOWED_RE = re.compile(rf"({SIZE}) allowed;")
_MESSAGE_END = "reserved by PyTorch but unallocated"
#: Window after a message start searched for its numbers.
WINDOW = 4000


def _alloc_conf_var(win: str, backend: str) -> str:
    m = re.search(r"(PYTORCH_(?:CUDA_|HIP_)?ALLOC_CONF)=expandable", win)
    if m:
        return m.group(1)
    return "PYTORCH_HIP_ALLOC_CONF" if backend.upper() == "HIP" else "PYTORCH_CUDA_ALLOC_CONF"


def _message_text(flat: str, start: int) -> str:
    """The OOM sentence starting at ``start``: up to the allocator summary, else the closing parenthesis."""
    end = flat.find(_MESSAGE_END, start)
    if 0 <= end and end - start <= 3000:
        return flat[start : end + len(_MESSAGE_END) + 1].strip()
    end = flat.find(")", start)
    end = end + 1 if 0 <= end - start < 600 else min(len(flat), start + 200)
    return flat[start:end].strip()


def _total_and_free(new: re.Match) -> tuple[int | None, int | None, list[str]]:
    total, free, notes = size(new.group(3)), size(new.group(4)), []
    if new.group(4) is None:
        notes.append("the message does not print the device's free memory (XPU wording)")
    if is_absurd(total, None):
        notes.append(f"total capacity printed as {new.group(3)}: not a real size, treated as unknown")
        total = None
    if is_absurd(free, total):
        notes.append(f"free memory printed as {new.group(4)}: not a real size, treated as unknown")
        free = None
    return total, free, notes


def read_processes(win: str, pos: int, endpos: int, total: int | None) -> tuple[list[ProcessUse], list[str]]:
    """Process entries in ``win[pos:endpos]`` (usage ``None`` where the driver could not tell) and, for those, the
    entry as printed."""
    procs, unknown = [], []
    for m in _PROC_RE.finditer(win, pos, endpos):
        val, is_self = size(m.group(2)), m.group(1) is None
        if val == 0 or is_absurd(val, total):
            unknown.append(f"{'this process' if is_self else 'process ' + m.group(1)} ({m.group(2)})")
            val = None
        procs.append(ProcessUse(pid=None if is_self else int(m.group(1)), bytes=val, is_self=is_self))
    return procs, unknown


def unknown_usage_note(unknown: list[str], procs: list[ProcessUse]) -> list[str]:
    """A note on the entries whose usage the driver could not tell (after :func:`identify_self`)."""
    if not unknown:
        return []
    others_unknown = any(p.bytes is None for p in procs if not p.is_self)
    return [
        "per-process memory is not available from the driver here (printed as "
        + ", ".join(unknown)
        + "; typical of WSL/Windows WDDM and some containers)"
        + (": other processes' share is unknown" if others_unknown else "")
    ]


Rule = Callable[[list[ProcessUse], "int | None"], "tuple[ProcessUse, str] | None"]


def lone_entry(procs: list[ProcessUse], reserved: int | None) -> tuple[ProcessUse, str] | None:
    """The message's only entry is this process: the process that ran out holds a context on the card."""
    if len(procs) != 1 or procs[0].is_self:
        return None
    me = procs[0]
    return me, (
        f"the message lists one process, process {me.pid} ({_usage(me.bytes)}): the process that ran out "
        "holds a context on the card, so it is this one (torch names it 'Process N' when its PID differs "
        "from the driver's, e.g. in containers or WSL)"
    )


def listed_twice(procs: list[ProcessUse], reserved: int | None) -> tuple[ProcessUse, str] | None:
    """The only ``Process N`` entry reports exactly what ``this process`` reports (known values): the same process."""
    others = [p for p in procs if not p.is_self]
    selfs = [p for p in procs if p.is_self]
    if len(others) != 1 or len(selfs) != 1 or others[0].bytes is None or others[0].bytes != selfs[0].bytes:
        return None
    me = others[0]
    return me, (
        f"process {me.pid} reports the same {_usage(me.bytes)} as 'this process': this process listed "
        "twice (its PID differs from the driver's, e.g. in containers or WSL), not another process"
    )


def holding_reservation(procs: list[ProcessUse], reserved: int | None) -> tuple[ProcessUse, str] | None:
    """No ``this process`` entry: the one entry holding at least PyTorch's reservation (when several do, the closest
    within 2 GiB of context above it) is this process."""
    if any(p.is_self for p in procs) or reserved is None:
        return None
    holding = [p for p in procs if p.bytes is not None and p.bytes >= reserved]
    if len(holding) > 1:
        holding = [p for p in holding if p.bytes <= reserved + 2 * GiB]
    if not holding:
        return None
    me = min(holding, key=lambda p: p.bytes - reserved)
    return me, (
        f"no 'this process' entry (PID namespaces in containers hide it): process {me.pid} "
        f"({format_bytes(me.bytes)}) holds PyTorch's {format_bytes(reserved)} reservation, taken to be this "
        "process"
    )


#: How a ``Process N`` entry is known to be this process, tried in order.
SELF_RULES: tuple[Rule, ...] = (lone_entry, listed_twice, holding_reservation)


def identify_self(procs: list[ProcessUse], reserved: int | None) -> tuple[list[ProcessUse], list[str]]:
    """Mark the ``Process N`` entry that is this process (:data:`SELF_RULES`). NVML lists every process with a
    context on the device, this one included, and torch prints it as ``this process`` only when its ``getpid()`` is
    NVML's PID; in containers and under WSL it is not."""
    for rule in SELF_RULES:
        found = rule(procs, reserved)
        if found is not None:
            me, note = found
            return [ProcessUse(p.pid, p.bytes, p.is_self or p is me) for p in procs], [note]
    return procs, []


def _usage(n: int | None) -> str:
    """A process's usage as printed, ``unknown`` when the driver could not tell."""
    return format_bytes(n) if n is not None else "usage unknown"


def other_processes_bytes(procs: list[ProcessUse]) -> int | None:
    """Memory of every other listed process; ``None`` when none is listed or one is unknown."""
    others = [p for p in procs if not p.is_self]
    if not procs or any(p.bytes is None for p in others):
        return None
    return sum(p.bytes for p in others)


def _read_new(base: OomMessage, win: str, new: re.Match, dev: str) -> OomMessage:
    """torch >= 2.1 wording (and XPU's)."""
    total, free, notes = _total_and_free(new)
    alloc = _NEW_ALLOC_RE.search(win)
    allocated = size(alloc.group(1)) if alloc else None
    unallocated = size(alloc.group(3)) if alloc else None
    reserved = allocated + unallocated if alloc else None
    summary_start = alloc.start() if alloc else len(win)
    procs, unknown = read_processes(win, new.end(), summary_start, total)
    allowed = _ALLOWED_RE.search(win, new.end(), summary_start)
    procs, self_notes = identify_self(procs, reserved)
    proc_notes = unknown_usage_note(unknown, procs)
    selfs = [p for p in procs if p.is_self]
    if not procs:
        self_notes.append("the message lists no processes (NVML unavailable): other processes' share unknown")
    fmt = "torch-2.1" if new.group(2) == "capacty" else ("torch-xpu" if dev == "xpu" else "torch>=2.2")
    return replace(
        base,
        format=fmt,
        device=f"{dev}:{new.group(1)}",
        total_bytes=total,
        free_bytes=free,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        reserved_unallocated_bytes=unallocated,
        private_pool_bytes=size(alloc.group(2)) if alloc and alloc.group(2) else None,
        allowed_bytes=size(allowed.group(1)) if allowed else None,
        this_process_bytes=selfs[0].bytes if selfs else None,
        processes=tuple(procs),
        other_processes_bytes=other_processes_bytes(procs),
        notes=tuple(notes + proc_notes + self_notes),
    )


def _read_old(base: OomMessage, old: re.Match, dev: str) -> OomMessage:
    """torch <= 2.0 wording (``cached`` before torch 1.5): no process list."""
    total = size(old.group(2))
    total = None if is_absurd(total, None) else total
    free = size(old.group(4))
    allocated, reserved = size(old.group(3)), size(old.group(6))
    return replace(
        base,
        format="torch<1.5" if old.group(7) == "cached" else "torch<=2.0",
        device=f"{dev}:{old.group(1)}",
        total_bytes=total,
        free_bytes=None if is_absurd(free, total) else free,
        allocated_bytes=allocated,
        allowed_bytes=size(old.group(5)) if old.group(5) else None,
        reserved_bytes=reserved,
        reserved_unallocated_bytes=max(0, reserved - allocated),
        notes=("this torch version does not list processes: other processes' share is not printed",),
    )


def read_message(flat: str, start: int, end: int, backend: str) -> OomMessage:
    """The caching-allocator message at ``flat[start:]``, its numbers searched up to ``end``."""
    win = flat[start:end]
    m = _CUDA_OOM_RE.match(win)
    dev = backend.lower() if backend.upper() != "HIP" else "cuda"
    base = OomMessage(
        kind="cuda-allocator",
        format="",
        device=dev,
        message=_message_text(flat, start),
        requested_bytes=size(m.group(2)) if m and m.group(2) else None,
        alloc_conf_var=_alloc_conf_var(win, backend),
    )
    new, old = _NEW_TOTAL_RE.search(win), _OLD_RE.search(win)
    if new and (not old or new.start() < old.start()):
        msg = _read_new(base, win, new, dev)
    elif old:
        msg = _read_old(base, old, dev)
    else:
        return replace(
            base,
            format="torch (numbers not printed)" if base.requested_bytes is None else "torch (partial)",
            notes=("the message carries no capacity/free/allocated numbers (truncated or reworded)",),
        )
    if None in (msg.total_bytes, msg.free_bytes, msg.reserved_bytes):
        return msg
    return replace(msg, non_pytorch_bytes=max(0, msg.total_bytes - msg.free_bytes - msg.reserved_bytes))


def _has_numbers(found: Found) -> bool:
    return found.message.total_bytes is not None or found.message.allocated_bytes is not None


def parse(text: FlatText) -> Found | None:
    """The first message that carries numbers (ranks repeat the same message; loggers echo its first sentence)."""
    flat = text.flat
    hits = list(_CUDA_OOM_RE.finditer(flat))
    if not hits:
        return None
    bounds = [h.start() for h in hits[1:]] + [len(flat)]
    found = [
        Found(read_message(flat, h.start(), min(b, h.start() + WINDOW), h.group(1)), h.start())
        for h, b in zip(hits, bounds)
    ]
    with_request = [f for f in found if f.message.requested_bytes is not None]
    first = ([f for f in found if _has_numbers(f)] or with_request or found)[0]
    # Distinct messages, not the echoes of one.
    msg = replace(first.message, occurrences=max(1, len(with_request)))
    later = cuda_error.after_oom_note(flat, first.start)
    if later is not None:
        msg = replace(msg, notes=msg.notes + (later,))
    tensor = fsdp.clone_tensor_before(flat, first.start)
    if tensor is not None:
        msg = replace(msg, kind="fsdp-clone-warning", tensor_name=tensor, notes=msg.notes + (fsdp.NOTE,))
    return Found(msg, first.start)
