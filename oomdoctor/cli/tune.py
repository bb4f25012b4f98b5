"""``oomdoctor tune MODEL``: the plan that fits, its largest micro-batch, exact accumulation, verified, emitted."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import typer

from oomdoctor.cli.app import app
from oomdoctor.cli.console import add_columns, new_table, out_console, print_table, showing_progress
from oomdoctor.cli.options import device_option, mem_option, offload_option, pins_from, plan_option
from oomdoctor.cli.output import emit_json

HELP = """Pick the training plan that fits, the largest micro-batch, and the gradient accumulation that keeps
--global-batch exact; verify it; write a commented `oomdoctor train` config and print the command to run it.

Capacity: --gpu-mem (24GB = 10^9 bytes, 24GiB = 2^30), else the local GPU's free memory (NVML; other processes'
usage is subtracted). A plan fits when its resident device peak (the memory model's peak, paged optimizer state
excluded) is at most the capacity minus --margin (default 0: the model already prices context, workspace and
fragmentation) - the rule diagnose and train --dry-run use. Ranking: --prefer quality (default) keeps the
most faithful plan (full > LoRA > QLoRA, fp32 master weights > pure bf16, 32-bit > 8-bit optimizer states,
no gradient checkpointing > checkpointing), then the fastest; --prefer speed ranks by estimated throughput first.
Verification: on a GPU a child process runs 2 real steps at --seq-len (steps down on OOM); without one, the
simulated engine replays the Hugging Face step on fake tensors, and the output says so.

CPU runs: --device cpu --mem 8GB plans a run on the CPU: priced without CUDA's context, cuBLAS workspace and
allocator slack, the live tensors within --mem (the same option as --gpu-mem), verified by the simulated engine; the
config says device: cpu and caps the run there.

Several GPUs: --gpus N (--gpus-per-node M) prices one rank per plan and climbs the strategies cheapest first: DDP
when it fits, then FSDP (HSDP across nodes), CPU offload last with the host RAM per node it needs; DeepSpeed
ZeRO-2/3 only with --strategy zero2|zero3. --global-batch is the batch over every GPU (micro-batch x accumulation x
GPUs).
"""
HELP = "\n\n".join(" ".join(par.split()) for par in HELP.strip().split("\n\n"))


@app.command(help=HELP)
def tune(
    model: str = typer.Argument(..., help="HF id (e.g. meta-llama/Llama-2-7b-hf), model dir, or config.json"),
    gpu_mem: Optional[str] = mem_option("the local GPU's free memory (NVML); required with --device cpu"),
    device: str = device_option(),
    host_mem: Optional[str] = typer.Option(
        None, help="CPU RAM of the training machine, which offload plans must fit (512GB); default: this machine's"
    ),
    seq_len: Optional[str] = typer.Option(
        None,
        help="longest sequence in tokens (default min(2048, model max)), or max: the longest any plan fits "
        "(micro-batch 1 unless --micro-batch)",
    ),
    micro_batch: Optional[int] = typer.Option(None, help="with --seq-len max: the micro-batch to fit (default 1)"),
    global_batch: Optional[int] = typer.Option(
        None, help="effective batch per optimizer step: micro-batch x accumulation equals it exactly"
    ),
    prefer: str = typer.Option("quality", help="quality (fidelity first, then speed) | speed (throughput first)"),
    margin: Optional[str] = typer.Option(
        None,
        help="reserve kept free on top of the memory model: a fraction (0.1), a percentage (10%) or a size "
        "(2GB); default 0 B",
    ),
    method: Optional[str] = plan_option("method"),
    precision: Optional[str] = plan_option("precision"),
    optimizer: Optional[str] = plan_option("optimizer", "the AdamW family is searched"),
    optimizer_impl: Optional[str] = plan_option("optimizer_impl"),
    attn: Optional[str] = plan_option("attn"),
    gradient_checkpointing: Optional[bool] = plan_option("gradient_checkpointing"),
    loss: Optional[str] = plan_option("loss"),
    optimizer_in_backward: Optional[bool] = plan_option("optimizer_in_backward"),
    tiled_mlp: Optional[bool] = plan_option("tiled_mlp"),
    lora_r: Optional[int] = plan_option("lora_r"),
    lora_targets: Optional[str] = plan_option("lora_targets"),
    lora_on_head: Optional[bool] = plan_option("lora_on_head"),
    adapter_dtype: Optional[str] = plan_option("adapter_dtype", "fp32, peft's default"),
    quant: Optional[str] = plan_option("quant"),
    double_quant: Optional[bool] = plan_option("double_quant"),
    kbit_upcast: Optional[bool] = plan_option("kbit_upcast", "on with a quantized base (peft's k-bit preparation)"),
    offload: Optional[str] = offload_option(),
    world_size: Optional[int] = plan_option("world_size", "1"),
    gpus_per_node: Optional[int] = typer.Option(
        None,
        "--gpus-per-node",
        help="GPUs per node (default --gpus: one node); more nodes: FSDP shards inside a "
        "node and replicates across nodes (HSDP), host RAM is checked per node",
    ),
    strategy: Optional[str] = plan_option(
        "strategy", "ddp when it fits, else fsdp, offload last; zero2/zero3 only when given"
    ),
    shard_group: Optional[int] = plan_option("shard_group", "one node"),
    reshard_after_forward: Optional[bool] = plan_option("reshard_after_forward", "on"),
    bucket_size: Optional[int] = plan_option("bucket_size", "hidden^2 for ZeRO"),
    verify: str = typer.Option("auto", help="auto (GPU if present, else simulate) | gpu | simulate | none"),
    output: Optional[str] = typer.Option(
        None, "--output", "-o", help="YAML to write (default ./oomdoctor-plan.yaml, or -2, -3... if it exists)"
    ),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --output file"),
    dataset: Optional[str] = typer.Option(None, help="dataset.path for the emitted config (default: bundled sample)"),
    tokenizer: Optional[str] = typer.Option(None, help="tokenizer for config-only models (init: random)"),
    emit: str = typer.Option(
        "oomdoctor",
        "--emit",
        help="oomdoctor (the `oomdoctor train` YAML) | trl (`trl sft --config`) | hf "
        "(transformers' Trainer: TrainingArguments JSON + model/peft/bnb keys) | axolotl | "
        "accelerate (launch config): tune searches only the plans that trainer runs, "
        "priced as its step runs (`oomdoctor targets` lists what each runs)",
    ),
    launch: bool = typer.Option(False, "--launch", help="run `oomdoctor train` on the written config right away"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
) -> None:
    from oomdoctor.engines import DEVICES
    from oomdoctor.errors import BadInput
    from oomdoctor.files import check_output_path
    from oomdoctor.tune.emit import EMIT_TARGETS, default_emit_path, default_output_path, write_config, write_emitted
    from oomdoctor.tune.ranking import PREFERS
    from oomdoctor.tune.tuner import tune as run_tune
    from oomdoctor.units import parse_size

    if emit not in EMIT_TARGETS:
        raise BadInput(f"--emit {emit!r}: use one of {', '.join(EMIT_TARGETS)}")
    if launch and emit != "oomdoctor":
        raise BadInput(f"--launch runs `oomdoctor train`; with --emit {emit} run the command tune prints")
    if prefer not in PREFERS:
        raise BadInput(f"--prefer {prefer!r}: use quality or speed")
    if device not in DEVICES:
        raise BadInput(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    seq: int | str | None = seq_len
    if seq_len is not None and seq_len != "max":
        if not seq_len.isdigit() or int(seq_len) < 1:
            raise BadInput(f"--seq-len {seq_len!r}: give a positive number of tokens or max")
        seq = int(seq_len)
    if micro_batch is not None and (seq_len != "max" or micro_batch < 1):
        raise BadInput("--micro-batch goes with --seq-len max (a positive integer); tune sizes it otherwise")
    if global_batch is not None and global_batch < 1:
        raise BadInput(f"--global-batch must be a positive integer, got {global_batch}")
    cap = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
    host = parse_size(host_mem, what="--host-mem") if host_mem is not None else None
    pins = pins_from(
        precision=precision,
        optimizer=optimizer,
        optimizer_impl=optimizer_impl,
        attn=attn,
        gradient_checkpointing=gradient_checkpointing,
        loss=loss,
        lora_r=lora_r,
        optimizer_in_backward=optimizer_in_backward,
        tiled_mlp=tiled_mlp,
        lora_targets=lora_targets,
        lora_on_head=lora_on_head,
        adapter_dtype=adapter_dtype,
        quant=quant,
        double_quant=double_quant,
        kbit_upcast=kbit_upcast,
        offload=offload,
        world_size=world_size,
        strategy=strategy,
        shard_group=shard_group,
        reshard_after_forward=reshard_after_forward,
        bucket_size=bucket_size,
    )
    # the file is written after the search: a path that cannot take it is refused now, not minutes later
    check_output_path(
        output if output is not None else default_output_path() if emit == "oomdoctor" else default_emit_path(emit),
        overwrite=force,
    )
    if micro_batch is not None:
        pins["micro_batch"] = micro_batch
    if emit != "oomdoctor":  # search and price only what that trainer runs, as it runs it
        pins["trainer"] = emit
    with showing_progress():
        result = run_tune(
            model,
            gpu_mem=cap,
            seq_len=seq,
            global_batch=global_batch,
            method=method,
            prefer=prefer,
            margin=margin,
            pins=pins,
            verify_mode=verify,
            gpus_per_node=gpus_per_node,
            host_mem=host,
            device=device,
        )
    written = None
    if emit == "oomdoctor":
        path = write_config(result, model, output, overwrite=force, dataset=dataset, tokenizer=tokenizer)
    else:
        written = write_emitted(result, model, output, overwrite=force, dataset=dataset)
        path = result.config_path = str(written.path)
    if as_json:
        doc = result.to_dict()
        doc["emit"] = emit
        doc["emit_notes"] = list(written.emitted.notes) if written is not None else []
        doc["emit_knobs"] = list(written.emitted.knobs) if written is not None else []
        if written is not None:
            doc["command"] = written.command
        emit_json(doc)
    else:
        _print(result, written, host_mem_given=host is not None)
    if launch:
        from oomdoctor.memory.runtime import ALLOC_CONF_VAR

        env = dict(os.environ)
        env.setdefault(ALLOC_CONF_VAR, result.alloc_conf)
        if not as_json:
            typer.echo(f"\nlaunching: {result.command}", err=True)
        rc = subprocess.call([sys.executable, "-m", "oomdoctor", "train", str(path)], env=env)
        raise typer.Exit(rc)


def _print(r, written=None, host_mem_given: bool = False) -> None:
    from oomdoctor.memory.breakdown import LABELS, TENSOR_COMPONENTS
    from oomdoctor.units import format_bytes

    con = out_console()
    p, m = r.plan, r.memory
    n = r.spec.num_params
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
    cpu = r.device == "cpu"
    con.print(
        f"[bold]{r.spec.name}[/]  {size} params  seq_len {r.seq_len}  "
        f"{'CPU run, RAM for tensors' if cpu else 'capacity'} {format_bytes(r.capacity_bytes)} "
        f"({r.capacity_source}), margin "
        f"{format_bytes(r.budget.margin_bytes)} -> budget {format_bytes(r.budget_bytes)}"
    )
    con.print(f"\n[bold green]plan[/]  {p.label()}")
    eff = f"effective batch {p.effective_batch}" + (" (exact)" if r.batch.exact and r.global_batch else "")
    gpus = f" x {p.world_size} GPUs" if p.world_size > 1 else ""
    con.print(
        f"      micro-batch {p.micro_batch} x gradient accumulation {p.grad_accum}{gpus} = {eff}; "
        f"largest micro-batch that fits: {r.batch.max_micro_batch}"
    )
    evictable = f" (+ {format_bytes(m.paged_optimizer)} paged optimizer state, evictable)" if m.paged_optimizer else ""
    con.print(
        f"      predicted {'live tensor' if cpu else 'resident'} peak {format_bytes(r.budget.needed(m))}{evictable} "
        f"({m.peak_phase}) of "
        f"{format_bytes(r.budget_bytes)} budget; engine {m.engine}"
    )
    if r.throughput:
        con.print(
            f"      est. throughput ~{r.throughput.tokens_per_s:,.0f} tokens/s ({r.throughput.profile}; "
            "rough, for ranking)"
        )
    parts = [(LABELS.get(c, c), getattr(m, c)) for c in TENSOR_COMPONENTS if getattr(m, c)]
    parts += [
        (LABELS.get(c, c), getattr(m, c))
        for c in ("allocator_slack", "cuda_context", "cublas_workspace", "nccl_buffers", "paged_optimizer")
        if getattr(m, c)
    ]
    con.print("      " + ", ".join(f"{n} {format_bytes(v)}" for n, v in parts))

    if r.strategies:
        st = new_table(
            f"strategies on {r.topology.world_size} GPUs ({r.topology.gpus_per_node} per node), cheapest "
            "communication first"
        )
        add_columns(st, ("strategy", "per GPU", "host RAM/node", "verdict"), text=("strategy", "verdict"))
        for s in r.strategies:
            st.add_row(
                s.label,
                format_bytes(s.needed_bytes),
                format_bytes(s.host_per_node_bytes) if s.host_per_node_bytes else "-",
                "[green]chosen[/]" if s.reason == "chosen" else s.reason,
            )
        print_table(con, st)
    if r.trials:
        t = new_table(f"verification: {r.verification}")
        add_columns(t, ("trial", "plan", "micro x accum", "outcome", "predicted", "measured", "time"), text=("plan",))
        for i, tr in enumerate(r.trials, 1):
            t.add_row(
                str(i),
                tr.plan_label,
                f"{tr.micro_batch} x {tr.grad_accum}",
                tr.outcome,
                format_bytes(tr.predicted_peak_bytes),
                format_bytes(tr.measured_peak_bytes),
                f"{tr.seconds:.1f}s",
            )
        print_table(con, t)
    else:
        con.print(f"verification: {r.verification}")

    shown = r.search.fitting[:6]
    paged = any(c.memory.paged_optimizer for c in shown)
    counted = "resident peak" if r.budget.counted == "resident_device" else "peak allocated"
    alt = new_table(
        f"ranking (fitting plans; {counted} vs the {format_bytes(r.budget_bytes)} budget"
        + ("; paged optimizer state is evictable, not counted" if paged else "")
        + ")"
    )
    cols = (
        ("#", "plan", "max micro", "micro x accum", counted)
        + (("paged optim.",) if paged else ())
        + ("host RAM", "est. tok/s")
    )
    add_columns(alt, cols, text=("plan",))
    for c in shown:
        cells = [
            str(c.rank),
            c.plan.label(),
            str(c.batch.max_micro_batch),
            f"{c.plan.micro_batch} x {c.plan.grad_accum}",
            format_bytes(r.budget.needed(c.memory)),
        ]
        if paged:
            cells.append(format_bytes(c.memory.paged_optimizer) if c.memory.paged_optimizer else "-")
        cells += [
            format_bytes(c.memory.cpu_offloaded) if c.memory.cpu_offloaded else "-",
            f"{c.throughput.tokens_per_s:,.0f}" if c.throughput else "-",
        ]
        alt.add_row(*cells)
    print_table(con, alt)
    if r.memory.cpu_offloaded:
        against = "--host-mem" if host_mem_given else "this machine's RAM"
        con.print(
            f"[yellow]the plan offloads to the CPU: it needs {format_bytes(r.host_per_node_bytes)} of host RAM "
            f"per node (checked against {against}); no on-device plan of its quality tier fits[/]"
        )
    for c in r.search.candidates:
        if c.why_not:
            con.print(f"[dim]out: {c.plan.label()}: {c.why_not}[/]")
    nf = sum(1 for c in r.search.candidates if not c.fits and not c.why_not)
    if nf:
        con.print(f"{nf} more plan(s) do not fit at micro-batch 1 (see `oomdoctor diagnose`).")
    for n in r.notes:
        con.print(f"[yellow]note:[/] {n}")
    # paths and commands are copied: never wrapped at the console's width
    con.print(f"\nwrote {r.config_path}", soft_wrap=True)
    if written is not None:
        for n in written.emitted.notes:
            con.print(f"[yellow]{written.emitted.target}:[/] {n}")
        con.print(f"run:  [bold]{written.command}[/]", soft_wrap=True)
        return
    con.print(f"run:  [bold]{r.command}[/]", soft_wrap=True)
    if not cpu:
        con.print(
            f"      (PYTORCH_CUDA_ALLOC_CONF={r.alloc_conf}: expandable segments cut fragmentation, "
            "the 'reserved but unallocated' part of OOM messages)"
        )
