"""Text rendering of ``oomdoctor explain`` (rich; the JSON form is ``oomdoctor.explain.render``).

Width: on a terminal, prose folds at word boundaries to the terminal's width, with a hanging indent; when piped (or
redirected to a file) every line is printed whole, never folded, so ``grep`` and pasting into an issue keep sentences
together. Either way a command, a path, a traceback frame, an env-var assignment or a `code span` is never split:
fixes' commands break only between their ``;``-separated alternatives, each of which stays whole even when it is
wider than the terminal.
"""

from __future__ import annotations

import re

from rich.console import Console
from rich.markup import escape as esc
from rich.text import Text

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
#: Indent of a fix's command under its ``fix N:`` line.
HOW_INDENT = 10
#: Spans of prose never split: `code spans` and sizes (``578.02 MiB``).
_KEEP_RE = re.compile(r"`[^`]*`|\d+(?:\.\d+)? (?:[KMGTPE]i?B|B|bytes)\b")


def alternatives(how: str) -> list[tuple[int, int]]:
    """(start, end) of each ``; ``-separated alternative of a command (the separators outside brackets)."""
    spans, depth, start = [], 0, 0
    for i, ch in enumerate(how):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and how.startswith("; ", i):
            spans.append((start, i))
            start = i + 2
    return spans + [(start, len(how))]


def break_offsets(plain: str, width: int, indent: int, protected: list[tuple[int, int]]) -> list[int]:
    """Where to fold ``plain`` so that each line fits ``width`` (continuation lines start with ``indent`` spaces):
    at word starts outside the ``protected`` spans, greedily. A word or span wider than a line stays whole."""

    def inside(i: int) -> bool:
        return any(a < i < b for a, b in protected)

    ends = [i for i in range(1, len(plain)) if plain[i - 1] == " " and plain[i] != " " and not inside(i)]
    offsets, start, avail, prev = [], 0, width, None
    for end in ends + [len(plain)]:
        if len(plain[start:end].rstrip()) > avail and prev is not None and plain[start:prev].strip():
            offsets.append(prev)
            start, avail = prev, width - indent
        prev = end
    return offsets


class Printer:
    """Prints lines at the console's width (see the module docstring)."""

    def __init__(self, console: Console) -> None:
        self.con = console
        self.width: int | None = console.width if console.is_terminal else None
        """Columns to fold prose at; ``None`` when not printing to a terminal (lines whole)."""

    def line(self, markup: str, indent: int = 0, protected: list[tuple[int, int]] | None = None) -> None:
        """One logical line (rich markup), folded on a terminal with continuation lines indented by ``indent``;
        `code spans`, sizes and the ``protected`` (start, end) spans of its plain text never split."""
        text = Text.from_markup(markup)
        if self.width is None:
            self.con.print(text, soft_wrap=True)
            return
        spans = [m.span() for m in _KEEP_RE.finditer(text.plain)] + (protected or [])
        offsets = break_offsets(text.plain, self.width, indent, spans)
        for i, part in enumerate(text.divide(offsets)):
            part.rstrip()
            self.con.print(Text(" " * indent) + part if i else part, soft_wrap=True)

    def command(self, how: str, indent: int = HOW_INDENT) -> None:
        """A command, config key or env var (bold): broken only between its alternatives, each kept whole."""
        pad = " " * indent
        self.line(f"{pad}[bold]{esc(how)}[/]", indent, [(a + indent, b + indent) for a, b in alternatives(how)])

    def frame(self, label: str, frame: str, style: str = "dim") -> None:
        """``label`` then a traceback frame (``dir/file.py:line in func: code``), the frame never split."""
        start = len(Text.from_markup(label).plain)
        self.line(f"{label}[{style}]{esc(frame)}[/]", 2, [(start, start + len(frame))])


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


def _numbers(out: Printer, r) -> None:
    """The message's numbers, one per line: name, size, what it is."""
    rows = [
        ("requested", r.requested_bytes, "the allocation that failed"),
        ("card total", r.total_bytes, ""),
        ("free", r.free_bytes, "on the device when it failed"),
        (
            "allocated by PyTorch",
            r.allocated_bytes,
            "live tensors" + (f", {fb(r.private_pool_bytes)} in CUDA-graph pools" if r.private_pool_bytes else ""),
        ),
        ("reserved, unallocated", r.reserved_unallocated_bytes, "cached by PyTorch, not holding tensors"),
        (
            "other processes",
            r.other_processes_bytes,
            ", ".join(f"PID {p.pid}" for p in r.processes if not p.is_self and p.pid is not None),
        ),
        ("outside PyTorch", r.non_pytorch_bytes, "total - free - reserved: CUDA context, libraries, other processes"),
    ]
    if r.allowed_bytes is not None:
        rows.insert(2, ("allowed (cap)", r.allowed_bytes, "set_per_process_memory_fraction"))
    for name, val, why in rows:
        if val is None and name == "outside PyTorch":
            continue
        size = fb(val) if val is not None else "not printed"
        out.line(f"[bold]{name:<22}[/]{size:>12}" + (f"  [dim]{esc(why)}[/]" if why else ""), 36)


def _causes(out: Printer, diag) -> None:
    """The causes, most likely first: evidence, then the fixes not shown under an earlier cause."""
    seen: set[str] = set()
    for i, c in enumerate(diag.causes, 1):
        out.line(f"[bold cyan]{i}. {c.id}[/]  [dim](weight {c.score:.2f})[/]")
        for e in c.evidence:
            out.line(f"   - {esc(e)}", 5)
        fresh = [f for f in c.fixes if f.id not in seen]
        shown = fresh[:4] if i == 1 else fresh[:2]
        seen.update(f.id for f in shown)
        if not fresh:
            out.line("   [dim](fixes: see above)[/]")
        for j, f in enumerate(shown, 1):
            saves = ""
            if f.saves_bytes is not None:
                verdict = {True: "[green]fits[/]", False: "[red]still too big[/]", None: ""}[f.fits]
                saves = f"  [bold]saves {fb(f.saves_bytes)}[/] -> {fb(f.peak_after_bytes)} {verdict}"
            out.line(f"   [green]fix {j}[/]: {esc(f.text)}{saves}", HOW_INDENT)
            out.command(f.how)
        if len(shown) < len(fresh):
            out.line(f"   [dim](+{len(fresh) - len(shown)} more fixes in --json)[/]")


def print_explanation(diag, source: str, note: str | None, console: Console | None = None) -> None:
    """The diagnosis as text: the message's numbers, the plan, the causes with their fixes, notes, next command."""
    con = console or Console()
    out = Printer(con)
    r = diag.report
    out.line(
        f"[bold]{KIND.get(r.kind, r.kind)}[/] on {r.device}  [dim]({esc(r.format)} message, from {esc(source)})[/]", 2
    )
    if r.phase:
        out.frame(f"phase: [bold]{r.phase}[/]  ", r.phase_frame or "")
    if r.failing_frame and r.failing_frame != r.phase_frame:
        out.frame("failing line: ", r.failing_frame)
    if r.occurrences > 1 or r.ranks:
        ranks = f" on rank(s) {', '.join(map(str, r.ranks))}" if r.ranks else ""
        out.line(f"{r.occurrences} OOM message(s){ranks}; numbers below are from the first")
    _numbers(out, r)
    picture = bar(r, min(56, out.width - 2)) if out.width else None
    if picture:
        con.print(picture)
    if diag.plan_label:
        cap = f" vs card {fb(diag.capacity_bytes)}" if diag.capacity_bytes else ""
        out.line(
            f"your plan: [bold]{esc(diag.plan_label)}[/], memory-model peak {fb(diag.plan_peak_bytes)}"
            f" ({diag.plan_peak_phase}){cap}",
            2,
        )
        if note:
            out.line(f"[dim]{esc(note)}[/]", 2)
    con.print()
    out.line("[bold]Likely causes, most likely first[/]")
    _causes(out, diag)
    for n in r.notes:
        out.line(f"[dim]note: {esc(n)}[/]", 6)
    if diag.next_command:
        out.line(f"next: [bold]{esc(diag.next_command)}[/]", 6, [(6, 6 + len(diag.next_command))])
