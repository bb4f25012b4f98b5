"""Text rendering of ``oomdoctor explain`` (rich; the JSON form is ``oomdoctor.explain.render``)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape as esc
from rich.table import Table

from oomdoctor.units import format_bytes as fb

#: Headline for each message kind.
KIND = {
    "cuda-allocator": "out of memory in PyTorch's caching allocator",
    "fsdp-clone-warning": "out of memory inside an FSDP state_dict() clone (only a warning!)",
    "cuda-error": "CUDA error: out of memory (outside PyTorch's allocator)",
    "cpu-allocator": "host RAM exhausted (CPU allocator)",
    "mps-allocator": "out of memory on Apple MPS",
    "quantized-offload": "quantized model does not fit on the GPU at load time",
    "cpu-oom-killer": "killed by the Linux OOM killer (host RAM)",
    "batch-size-exhausted": "automatic batch size search ran out of memory at every size",
}


def bar(r, width: int = 56) -> str | None:
    """One-line picture of the card: allocated | reserved-unallocated | outside PyTorch | free."""
    T = r.total_bytes
    if not T or r.allocated_bytes is None:
        return None
    parts = [
        (r.allocated_bytes, "red", "allocated"),
        (r.reserved_unallocated_bytes or 0, "yellow", "reserved, unallocated"),
        (r.non_pytorch_bytes or 0, "magenta", "outside PyTorch"),
        (r.free_bytes or 0, "green", "free"),
    ]
    out, used = "", 0
    for i, (b, color, _) in enumerate(parts):
        n = round(width * b / T) if i < len(parts) - 1 else max(0, width - used)
        n = min(n, width - used)
        if b and n == 0 and used < width:
            n = 1
        used += n
        out += f"[{color}]" + ("█" * n) + "[/]"
    legend = "  ".join(f"[{c}]█[/] {lbl}" for _, c, lbl in parts)
    return f"{out}\n{legend}"


def print_explanation(diag, source: str, note: str | None) -> None:
    """The diagnosis as text: the message's numbers, the plan, the causes with their fixes, notes, next command."""
    con = Console()
    r = diag.report
    head = f"[bold]{KIND.get(r.kind, r.kind)}[/] on {r.device}  [dim]({esc(r.format)} message, from {esc(source)})[/]"
    con.print(head)
    if r.phase:
        con.print(f"phase: [bold]{r.phase}[/]  [dim]{esc(r.phase_frame or '')}[/]")
    if r.failing_frame and r.failing_frame != r.phase_frame:
        con.print(f"failing line: [dim]{esc(r.failing_frame)}[/]")
    if r.occurrences > 1 or r.ranks:
        ranks = f" on rank(s) {', '.join(map(str, r.ranks))}" if r.ranks else ""
        con.print(f"{r.occurrences} OOM message(s){ranks}; numbers below are from the first")

    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    rows = [
        ("requested", r.requested_bytes, "the allocation that failed"),
        ("card total", r.total_bytes, ""),
        ("free", r.free_bytes, "on the device when it failed"),
        ("allocated by PyTorch", r.allocated_bytes, "live tensors"
         + (f", {fb(r.private_pool_bytes)} in CUDA-graph pools" if r.private_pool_bytes else "")),
        ("reserved, unallocated", r.reserved_unallocated_bytes, "cached by PyTorch, not holding tensors"),
        ("other processes", r.other_processes_bytes,
         ", ".join(f"PID {p.pid}" for p in r.processes if not p.is_self and p.pid is not None)),
        ("outside PyTorch", r.non_pytorch_bytes, "total - free - reserved: CUDA context, libraries, other processes"),
    ]
    if r.allowed_bytes is not None:
        rows.insert(2, ("allowed (cap)", r.allowed_bytes, "set_per_process_memory_fraction"))
    for name, val, why in rows:
        if val is None and name in ("outside PyTorch",):
            continue
        t.add_row(name, fb(val) if val is not None else "[dim]not printed[/]", esc(why))
    con.print(t)
    picture = bar(r) if con.is_terminal else None
    if picture:
        con.print(picture)
    if diag.plan_label:
        cap = f" vs card {fb(diag.capacity_bytes)}" if diag.capacity_bytes else ""
        con.print(f"your plan: [bold]{esc(diag.plan_label)}[/], memory-model peak {fb(diag.plan_peak_bytes)}"
                  f" ({diag.plan_peak_phase}){cap}")
        if note:
            con.print(f"[dim]{esc(note)}[/]")
    con.print()
    con.print("[bold]Likely causes, most likely first[/]")
    seen: set[str] = set()
    for i, c in enumerate(diag.causes, 1):
        con.print(f"[bold cyan]{i}. {c.id}[/]  [dim](weight {c.score:.2f})[/]")
        for e in c.evidence:
            con.print(f"   - {esc(e)}")
        fresh = [f for f in c.fixes if f.id not in seen]
        shown = fresh[:4] if i == 1 else fresh[:2]
        seen.update(f.id for f in shown)
        if not fresh:
            con.print("   [dim](fixes: see above)[/]")
        for j, f in enumerate(shown, 1):
            saves = ""
            if f.saves_bytes is not None:
                verdict = {True: "[green]fits[/]", False: "[red]still too big[/]", None: ""}[f.fits]
                saves = f"  [bold]saves {fb(f.saves_bytes)}[/] -> {fb(f.peak_after_bytes)} {verdict}"
            con.print(f"   [green]fix {j}[/]: {esc(f.text)}{saves}")
            con.print(f"          [bold]{esc(f.how)}[/]")
        if len(shown) < len(fresh):
            con.print(f"   [dim](+{len(fresh) - len(shown)} more fixes in --json)[/]")
    for n in r.notes:
        con.print(f"[dim]note: {esc(n)}[/]")
    if diag.next_command:
        con.print(f"next: [bold]{esc(diag.next_command)}[/]")
