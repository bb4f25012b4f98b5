"""``oomdoctor explain [FILE|-]``: read a real out-of-memory message and say why it happened and what to change."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from oomdoctor.cli.app import app
from oomdoctor.cli.output import emit_json

HELP = """Read an out-of-memory error (a log or traceback) and explain it: what was asked, what was free, where the
rest went, the likely causes with their numbers, and the fixes, best first.

FILE is a log file; `-` (or no FILE with piped input) reads stdin: `python train.py 2>&1 | oomdoctor explain -`.
Understands every PyTorch CUDA/HIP/XPU OOM wording (<= 2.0, 2.1, >= 2.2), rank prefixes (\\[rank0]:), process
lists, FSDP "Failed to clone()" warnings, `CUDA error: out of memory`, cuBLAS/cuDNN errors, CPU and MPS allocator
errors, the Linux OOM killer (host or container), accelerate's auto batch size giving up, and the bitsandbytes /
accelerate offload errors; the phase (model load, forward, loss, backward, optimizer step, evaluation, checkpoint
save) comes from the traceback. With --model (and optionally --config or plan flags) the fixes are ranked by the
bytes they save for your plan, computed with the memory model. On a terminal the text folds to its width; piped,
every line is whole.
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
                note = (
                    "no --config or plan flags: fixes priced for the default plan "
                    f"({plan.label()}, micro-batch 1 x {seq} tokens)"
                )
    if flags:
        plan = (plan or Plan()).with_(**flags)
    return spec, plan, note


@app.command(help=HELP)
def explain(
    file: Optional[str] = typer.Argument(None, help="log/traceback file; `-` or nothing (with piped input): stdin"),
    model: Optional[str] = typer.Option(
        None, help="the model you trained (HF id, dir or config.json): ranks fixes by bytes saved"
    ),
    config: Optional[str] = typer.Option(None, help="your train YAML (oomdoctor train format): the plan to price"),
    gpu_mem: Optional[str] = typer.Option(None, help="card size for fit verdicts (default: the message's total)"),
    method: Optional[str] = typer.Option(None, help="plan: full | lora | qlora"),
    precision: Optional[str] = typer.Option(None, help="plan: fp32 | fp16-mixed | bf16-mixed | bf16"),
    optimizer: Optional[str] = typer.Option(
        None, help="plan: adamw | adamw-8bit | paged-adamw-8bit | adafactor | sgd | lion"
    ),
    micro_batch: Optional[int] = typer.Option(None, help="plan: sequences per forward/backward"),
    seq_len: Optional[int] = typer.Option(None, help="plan: tokens per sequence"),
    gradient_checkpointing: Optional[bool] = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing", help="plan: gradient checkpointing on/off"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    from oomdoctor.cli.explain_render import print_explanation
    from oomdoctor.explain.core import explain as run_explain
    from oomdoctor.units import parse_size

    text, source = _read_input(file)
    capacity = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
    flags = dict(
        method=method,
        precision=precision,
        optimizer=optimizer,
        micro_batch=micro_batch,
        seq_len=seq_len,
        gradient_checkpointing=gradient_checkpointing,
    )
    spec, plan, note = _plan_and_spec(model, config, flags)
    diag = run_explain(text, spec=spec, plan=plan, capacity_bytes=capacity)
    if as_json:
        d = diag.to_dict()
        d["source"] = source
        if note:
            d["plan_note"] = note
        emit_json(d)
        return
    print_explanation(diag, source, note)
