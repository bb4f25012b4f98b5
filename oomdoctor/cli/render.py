"""Rich rendering of diagnose reports (printing only; the numbers come from ``oomdoctor.diagnose.report``)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from oomdoctor.cli.console import fold_column, out_console, print_table, whole_column
from oomdoctor.memory.breakdown import LABELS
from oomdoctor.units import format_bytes, gib

#: Terminals narrower than this get the compact plan table (states / activ. instead of every component).
FULL_TABLE_WIDTH = 130
#: The plan column folds down to this width and no further (a 60-column terminal still gets every number whole).
PLAN_MIN_WIDTH = 12

FIT = {True: "[green]yes[/]", False: "[red]no[/]", None: "[dim]-[/]"}


def _g(n: int) -> str:
    return f"{gib(n):.2f}"


def model_line(report) -> str:
    s = report.spec
    src = {"bundled": "bundled config", "local": "local config", "hub": "hub config.json"}.get(s.source, s.source)
    return (
        f"[bold]{s.name}[/] ({s.model_type}, {s.num_params / 1e9:.2f} B params, {s.num_layers} layers, "
        f"hidden {s.hidden_size}, vocab {s.vocab_size:,}; {src})"
    )


def capacity_line(report) -> str:
    cpu = report.device == "cpu"
    if report.capacity_bytes is None:
        return (
            "RAM budget: none given (pass --mem 8GB for fit verdicts on the CPU)"
            if cpu
            else "card: none given and no GPU found (pass --gpu-mem 24GB for fit verdicts)"
        )
    b = report.budget
    cap = b.capacity_bytes
    if cpu:
        return (
            f"RAM budget: {format_bytes(cap, binary=False)} = {format_bytes(cap)} (--mem), a CPU run: a plan fits "
            f"when its live tensor bytes (peak alloc) are at most that minus the margin, "
            f"{format_bytes(b.margin_bytes)}"
        )
    where = "--gpu-mem" if b.source == "--gpu-mem" else f"NVML: {report.gpu.name}, free memory"
    return (
        f"card: {format_bytes(cap, binary=False)} = {format_bytes(cap)} ({where}); a plan fits when its resident "
        f"peak (paged optimizer state excluded) is at most that minus the margin, {format_bytes(b.margin_bytes)}"
    )


def _needed(report, m) -> int:
    """What the fits rule counts of ``m``: the budget's quantity (the resident device peak without a budget)."""
    return report.budget.needed(m) if report.budget is not None else m.resident_device


def plan_table(report, width: int) -> Table:
    """One row per plan; on terminals narrower than :data:`FULL_TABLE_WIDTH` columns a compact set of columns.
    ``peak dev`` is what the fits rule counts (paged optimizer state excluded: its own ``paged`` column)."""
    first = report.results[0].plan
    compact = width < FULL_TABLE_WIDTH
    ranks = f", per GPU of {first.world_size}" if first.world_size > 1 else ""
    host = any(r.memory.host_per_node for r in report.results)
    paged = any(r.memory.paged_optimizer for r in report.results)
    t = Table(
        title=f"Training memory per plan, GiB  (micro-batch {first.micro_batch} x {first.seq_len} tokens{ranks}, "
        f"engine: {report.engine}, device: {report.device})",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
    )
    cols = (
        ("#", "plan", "states", "activ.", "peak dev", "fits")
        if compact
        else ("#", "plan", "weights", "grads", "optim", "activ.", "logits", "other", "peak alloc", "peak dev", "fits")
    )
    if paged:
        cols = cols[:-1] + ("paged",) + cols[-1:]
    if host:
        cols = cols[:-1] + ("host/node",) + cols[-1:]
    for name in cols:
        if name == "plan":
            fold_column(t, name, min_width=PLAN_MIN_WIDTH)
        else:
            whole_column(t, name, justify="center" if name == "fits" else "right")
    for i, r in enumerate(report.results, 1):
        m = r.memory
        if compact:
            states = m.parameters + m.gradients + m.optimizer_states + m.master_weights
            cells = (_g(states), _g(m.activations + m.logits + m.temporaries), _g(_needed(report, m)))
        else:
            cells = (
                _g(m.parameters),
                _g(m.gradients),
                _g(m.optimizer_states),
                _g(m.activations),
                _g(m.logits),
                _g(m.master_weights + m.temporaries),
                _g(m.peak_allocated),
                _g(_needed(report, m)),
            )
        if paged:
            cells += (_g(m.paged_optimizer) if m.paged_optimizer else "-",)
        if host:
            cells += (_g(m.host_per_node) if m.host_per_node else "-",)
        t.add_row(str(i), r.plan.label(), *cells, FIT[r.fits])
    return t


def breakdown_table(m) -> Table:
    t = Table(title="Breakdown at the peak" + (" (one GPU of the plan)" if m.nccl_buffers else ""), header_style="bold")
    fold_column(t, "component")
    whole_column(t, "bytes", justify="right")
    whole_column(t, "GiB", justify="right")
    for key in (
        "parameters",
        "adapters",
        "master_weights",
        "gradients",
        "optimizer_states",
        "activations",
        "logits",
        "temporaries",
    ):
        label = LABELS[key] + (" (of weights)" if key == "adapters" else "")
        t.add_row(label, f"{getattr(m, key):,}", _g(getattr(m, key)))
    t.add_row("[bold]peak allocated[/] (" + m.peak_phase + ")", f"{m.peak_allocated:,}", _g(m.peak_allocated))
    t.add_row(LABELS["allocator_slack"], f"{m.allocator_slack:,}", _g(m.allocator_slack))
    t.add_row("[bold]peak reserved[/]", f"{m.peak_reserved:,}", _g(m.peak_reserved))
    for key in ("cuda_context", "cublas_workspace", "nccl_buffers", "paged_optimizer"):
        if key != "nccl_buffers" or m.nccl_buffers:
            t.add_row(LABELS[key], f"{getattr(m, key):,}", _g(getattr(m, key)))
    t.add_row("[bold]peak device[/] (nvidia-smi)", f"{m.peak_device:,}", _g(m.peak_device))
    if m.paged_optimizer:  # what the fits rule counts on a GPU: the paged state is evicted when the card runs short
        t.add_row("[bold]resident device[/] (paged state excluded)", f"{m.resident_device:,}", _g(m.resident_device))
    if m.comm_buffers:
        t.add_row(LABELS["comm_buffers"] + " (of the above, at the peak)", f"{m.comm_buffers:,}", _g(m.comm_buffers))
    if m.cpu_offloaded:
        t.add_row(LABELS["cpu_offloaded"] + " (host RAM)", f"{m.cpu_offloaded:,}", _g(m.cpu_offloaded))
    if m.host_per_node:
        t.add_row(LABELS["host_per_node"], f"{m.host_per_node:,}", _g(m.host_per_node))
    return t


def _change_line(console: Console, prefix: str, c) -> None:
    console.print(f"{prefix}{c.description}")
    console.print(f"        [dim]saves {format_bytes(c.saves_bytes)}; {c.flags}[/]")


def print_advice(console: Console, report, result, index: int) -> None:
    adv = result.advice
    if adv is None:
        return
    paged = (
        f" (+ {format_bytes(result.memory.paged_optimizer)} paged optimizer state, evictable)"
        if result.memory.paged_optimizer
        else ""
    )
    console.print(
        f"\n[bold]#{index} {result.plan.label()}[/] needs {format_bytes(_needed(report, result.memory))}{paged}:"
    )
    fitting = [c for c in adv.single if c.fits]
    if fitting:
        for c in fitting[:4]:
            _change_line(console, "  [green]fits[/] with ", c)
        return
    if adv.path:
        verdict = "[green]fits[/]" if adv.path_fits else "[red]still does not fit[/]"
        console.print(f"  no single change is enough; cheapest combination ({verdict}):")
        for k, c in enumerate(adv.path, 1):
            _change_line(console, f"   {k}. ", c)
    else:
        for c in adv.single[:3]:
            _change_line(console, "  - ", c)


def print_diagnose(report) -> None:
    console = out_console()
    console.print(model_line(report))
    console.print(capacity_line(report))
    for note in report.notes:
        console.print(f"[yellow]note: {note}[/]")
    if not report.results:  # --fits-only and nothing fits
        console.print(
            f"\nNone of the {report.priced} plans fits; run without --fits-only for them and the changes "
            "that would make one fit."
        )
        if report.smaller_model:
            sm = report.smaller_model
            console.print(
                f"A smaller model of the same family does: [bold]{sm.model_id}[/] ({sm.params / 1e9:.2f} B) "
                f"with {sm.plan.label()} at {format_bytes(_needed(report, sm.memory))}."
            )
        return
    print_table(console, plan_table(report, console.width))
    if console.width < FULL_TABLE_WIDTH:
        console.print(
            "[dim]states: weights + gradients + optimizer states + AMP weight copies; activ.: activations "
            "+ logits + temporaries (widen the terminal to 130+ columns for every component).[/]"
        )
    console.print(
        "[dim]weights: stored weights incl. quantization constants and LoRA adapters; grads: trainable only; "
        "optim: optimizer states; activ.: saved for backward; logits: logits + fp32 upcast + loss; other: AMP "
        "weight copies + temporaries; peak alloc: tensor bytes (max_memory_allocated); "
        + (
            "peak dev: = peak alloc on the CPU (no CUDA context, workspace or allocator cache)"
            if report.device == "cpu"
            else "peak dev: + allocator slack, CUDA context, cuBLAS workspace: the resident peak the fits verdict compares "
            "with the card"
        )
        + (
            "; paged: bitsandbytes' paged optimizer state, in unified memory, evicted to host RAM when the card runs "
            "short (not counted for fits; nvidia-smi shows it on top while resident)"
            if any(r.memory.paged_optimizer for r in report.results)
            else ""
        )
        + ".[/]"
    )
    if any(r.plan.world_size > 1 for r in report.results):
        console.print(
            "[dim]several GPUs: every number is one GPU's (the largest rank); weights/grads include the "
            "gathered units and communication buckets; peak dev adds NCCL's buffers; host/node: host RAM "
            "one node needs for offloaded states (every rank on one node).[/]"
        )
    if len(report.results) == 1:
        print_table(console, breakdown_table(report.results[0].memory))
        for note in report.results[0].memory.notes:
            console.print(f"[dim]note: {note}[/]")
    if report.capacity_bytes is None:
        return
    fitting = report.fitting
    subset = "" if len(report.results) == report.priced else f" (showing {len(report.results)})"
    console.print(f"\n{report.fitting_count} of {report.priced} plans fit{subset}.")
    if fitting:
        best = fitting[0]
        idx = report.results.index(best) + 1
        b = report.budget
        console.print(
            f"Most faithful plan that fits: [bold]#{idx} {best.plan.label()}[/] "
            f"({format_bytes(b.needed(best.memory))} of {format_bytes(b.limit_bytes)})"
        )
    shown = set()  # advice for the most faithful plan of each method (the rows with a full advice path)
    for i, r in enumerate(report.results, 1):
        if r.plan.method not in shown:
            shown.add(r.plan.method)
            print_advice(console, report, r, i)
    if report.smaller_model:
        sm = report.smaller_model
        console.print(
            f"\nNothing fits, not even with the changes above. A smaller model of the same family does: "
            f"[bold]{sm.model_id}[/] "
            f"({sm.params / 1e9:.2f} B) with {sm.plan.label()} at {format_bytes(_needed(report, sm.memory))}."
        )
    elif not report.fitting_count:
        rescued = any(r.advice and (r.advice.path_fits or any(c.fits for c in r.advice.single)) for r in report.results)
        if not rescued:
            console.print(
                "\nNothing fits, not even with the changes above, and no smaller bundled model of this "
                "family does either."
            )
