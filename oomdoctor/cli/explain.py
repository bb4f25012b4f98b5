"""``oomdoctor explain [FILE|-]``: read a real out-of-memory message and say why it happened and what to change."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from oomdoctor.cli.app import app

HELP = """Read an out-of-memory error (a log or traceback) and explain it: what was asked, what was free, where the
rest went, the likely causes with their numbers, and the fixes, best first.

FILE is a log file; `-` (or no FILE with piped input) reads stdin: `python train.py 2>&1 | oomdoctor explain -`.
Understands every PyTorch CUDA/HIP/XPU OOM wording (<= 2.0, 2.1, >= 2.2), rank prefixes (\\[rank0]:), process
lists, FSDP "Failed to clone()" warnings, `CUDA error: out of memory`, CPU and MPS allocator errors, the Linux OOM
killer, accelerate's auto batch size giving up, and the bitsandbytes / accelerate offload errors. With --model (and optionally --config or plan flags) the fixes are ranked by the bytes
they save for your plan, computed with the memory model.
"""
HELP = "\n\n".join(" ".join(par.split()) for par in HELP.strip().split("\n\n"))


def _read_input(file: Optional[str]) -> tuple[str, str]:
    """(text, where it came from)."""
    from oomdoctor.errors import BadInput

    if file is None or file == "-":
        if file is None and sys.stdin.isatty():
            raise BadInput(
                "no input: pass a log file, or pipe one in",
                "e.g. `oomdoctor explain train.log` or `python train.py 2>&1 | oomdoctor explain -`",
            )
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        return data.decode("utf-8", errors="replace"), "stdin"
    p = Path(file)
    if not p.exists():
        raise BadInput(f"{file}: no such file", "pass the log or traceback file, or `-` to read stdin")
    if p.is_dir():
        raise BadInput(f"{file} is a directory", "pass the log or traceback file, or `-` to read stdin")
    try:
        return p.read_bytes().decode("utf-8", errors="replace"), str(p)
    except OSError as exc:
        raise BadInput(f"cannot read {file}: {exc.strerror or exc}") from None


def _plan_and_spec(model, config, flags: dict):
    """(spec or None, plan or None, note) from --model/--config/plan flags."""
    from oomdoctor.plan import Plan, validate

    spec = plan = None
    note = None
    flags = {k: v for k, v in flags.items() if v is not None}
    if config is not None:
        from oomdoctor.train.config import load_train_config

        cfg = load_train_config(config)
        mb = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 1
        if not isinstance(cfg.micro_batch_size, int):
            note = "micro_batch_size is 'auto' in the config: priced at micro-batch 1"
        plan = cfg.to_plan(micro_batch=mb)
        if model is None:
            model = cfg.model_ref
    if model is not None:
        from oomdoctor.model.load import load_spec

        spec = load_spec(model)
        if plan is None:
            seq = min(2048, spec.max_position_embeddings or 2048)
            plan = validate(Plan(seq_len=seq))
            if not flags:
                note = ("no --config or plan flags: fixes priced for the default plan "
                        f"({plan.label()}, micro-batch 1 x {seq} tokens)")
    if flags:
        plan = (plan or Plan()).with_(**flags)
    return spec, plan, note


@app.command(help=HELP)
def explain(
    file: Optional[str] = typer.Argument(None, help="log/traceback file; `-` or nothing (with piped input): stdin"),
    model: Optional[str] = typer.Option(None, help="the model you trained (HF id, dir or config.json): ranks fixes "
                                        "by bytes saved"),
    config: Optional[str] = typer.Option(None, help="your train YAML (oomdoctor train format): the plan to price"),
    gpu_mem: Optional[str] = typer.Option(None, help="card size for fit verdicts (default: the message's total)"),
    method: Optional[str] = typer.Option(None, help="plan: full | lora | qlora"),
    precision: Optional[str] = typer.Option(None, help="plan: fp32 | fp16-mixed | bf16-mixed | bf16"),
    optimizer: Optional[str] = typer.Option(None, help="plan: adamw | adamw-8bit | paged-adamw-8bit | adafactor | "
                                            "sgd | lion"),
    micro_batch: Optional[int] = typer.Option(None, help="plan: sequences per forward/backward"),
    seq_len: Optional[int] = typer.Option(None, help="plan: tokens per sequence"),
    gradient_checkpointing: Optional[bool] = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing", help="plan: gradient checkpointing on/off"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    from oomdoctor.explain.core import explain as run_explain
    from oomdoctor.units import parse_size

    text, source = _read_input(file)
    capacity = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
    flags = dict(method=method, precision=precision, optimizer=optimizer, micro_batch=micro_batch,
                 seq_len=seq_len, gradient_checkpointing=gradient_checkpointing)
    spec, plan, note = _plan_and_spec(model, config, flags)
    diag = run_explain(text, spec=spec, plan=plan, capacity_bytes=capacity)
    if as_json:
        d = diag.to_dict()
        d["source"] = source
        if note:
            d["plan_note"] = note
        typer.echo(json.dumps(d, indent=2))
        return
    _print(diag, source, note)


# ---------------------------------------------------------------------------------------------- rendering

_KIND = {
    "cuda-allocator": "out of memory in PyTorch's caching allocator",
    "fsdp-clone-warning": "out of memory inside an FSDP state_dict() clone (only a warning!)",
    "cuda-error": "CUDA error: out of memory (outside PyTorch's allocator)",
    "cpu-allocator": "host RAM exhausted (CPU allocator)",
    "mps-allocator": "out of memory on Apple MPS",
    "quantized-offload": "quantized model does not fit on the GPU at load time",
    "cpu-oom-killer": "killed by the Linux OOM killer (host RAM)",
    "batch-size-exhausted": "automatic batch size search ran out of memory at every size",
}


def _bar(r, width: int = 56) -> str | None:
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


def _print(diag, source: str, note: str | None) -> None:
    from rich.console import Console
    from rich.markup import escape as esc
    from rich.table import Table

    from oomdoctor.units import format_bytes as fb

    con = Console()
    r = diag.report
    head = f"[bold]{_KIND.get(r.kind, r.kind)}[/] on {r.device}  [dim]({esc(r.format)} message, from {esc(source)})[/]"
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
    bar = _bar(r) if con.is_terminal else None
    if bar:
        con.print(bar)
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
