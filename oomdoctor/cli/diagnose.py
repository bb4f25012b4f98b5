"""``oomdoctor diagnose MODEL``: memory of training MODEL per technique stack, from its config alone."""

from __future__ import annotations

from typing import Optional

import typer

from oomdoctor.cli.app import app
from oomdoctor.cli.console import showing_progress
from oomdoctor.cli.options import device_option, mem_option, offload_option, pins_from, plan_option
from oomdoctor.cli.output import emit_json

HELP = """Memory of fine-tuning MODEL under each stack of techniques, from its config alone (no weights, no GPU).

MODEL is a Hugging Face id (bundled configs resolve offline: `oomdoctor models`), a local directory holding
config.json, or a config.json path. Flags you give pin that technique; the table spans the rest. With --gpu-mem
(or a GPU found through NVML) each plan gets a fit verdict, and plans that do not fit get the smallest changes
that make them fit, with the bytes each saves.

CPU runs: --device cpu prices the plan as PyTorch runs it on the CPU: its tensors, with no CUDA context, cuBLAS
workspace or allocator slack; --mem (the same option as --gpu-mem) is then the RAM the run may fill with tensors.

Several GPUs: --gpus N prices one rank of N data-parallel GPUs (every number is per GPU) under each strategy (DDP,
FSDP, DeepSpeed ZeRO-2/3; pin one with --strategy); offload plans also show the host RAM a node needs.

Techniques, correctly: LoRA is Low-Rank Adaptation (peft: frozen base + rank-r adapters). AdamW keeps exactly
Adam's two states (decoupled weight decay costs nothing); leaner are 8-bit/paged AdamW, Adafactor, Lion, SGD.
Gradient checkpointing is the biggest activation saver. Efficient init means building on the meta device and
loading straight into the target dtype; Xavier init changes weight variance, not memory.
"""
HELP = "\n\n".join(" ".join(par.split()) for par in HELP.strip().split("\n\n"))


@app.command(help=HELP)
def diagnose(
    model: str = typer.Argument(..., help="HF id (e.g. meta-llama/Llama-2-7b-hf), model dir, or config.json"),
    method: Optional[str] = plan_option("method"),
    precision: Optional[str] = plan_option("precision"),
    optimizer: Optional[str] = plan_option("optimizer"),
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
    strategy: Optional[str] = plan_option(
        "strategy", "single on one GPU; with --gpus N > 1 ddp, fsdp, zero2, zero3 spanned"
    ),
    shard_group: Optional[int] = plan_option("shard_group", "every rank"),
    reshard_after_forward: Optional[bool] = plan_option("reshard_after_forward", "on"),
    bucket_size: Optional[int] = plan_option("bucket_size", "hidden^2 for ZeRO"),
    trainer: Optional[str] = plan_option("trainer", "oomdoctor"),
    micro_batch: Optional[int] = plan_option("micro_batch", "1"),
    seq_len: Optional[int] = plan_option("seq_len", "min(2048, model max)"),
    gpu_mem: Optional[str] = mem_option("NVML's free memory of the local GPU (none on the CPU: no verdicts)"),
    device: str = device_option(),
    fits_only: bool = typer.Option(False, "--fits-only", help="show only the plans that fit (needs a capacity)"),
    top: Optional[int] = typer.Option(None, "--top", help="show only the first N plans (most faithful first)"),
    engine: str = typer.Option(
        "analytic", help="analytic (formulas) | simulate (real step on fake tensors) | measure (GPU)"
    ),
    plot: Optional[str] = typer.Option(None, help="write a picture: FILE.png or FILE.html"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
) -> None:
    from oomdoctor.diagnose.report import diagnose as run_diagnose
    from oomdoctor.engines import DEVICES
    from oomdoctor.errors import BadInput
    from oomdoctor.units import parse_size

    if plot and not plot.lower().endswith((".png", ".html", ".htm")):
        raise BadInput(f"--plot {plot!r}: use a .png or .html file name")
    if plot:  # the picture is drawn after the pricing: a path that cannot take it is refused now
        from oomdoctor.diagnose.plot import PLOT_FLAG
        from oomdoctor.files import check_output_path

        check_output_path(plot, what=PLOT_FLAG, overwrite=True, example="memory.png")
    pins = pins_from(
        method=method,
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
        micro_batch=micro_batch,
        seq_len=seq_len,
        world_size=world_size,
        strategy=strategy,
        shard_group=shard_group,
        reshard_after_forward=reshard_after_forward,
        bucket_size=bucket_size,
        trainer=trainer,
    )
    if device not in DEVICES:
        raise BadInput(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    capacity = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
    with showing_progress():
        report = run_diagnose(model, pins, gpu_mem=capacity, engine=engine, fits_only=fits_only, top=top, device=device)
        if plot:
            _write_plot(report, plot)
    if as_json:
        emit_json(report.to_dict())
        return
    from oomdoctor.cli.render import print_diagnose

    print_diagnose(report)
    if plot:
        typer.echo(f"picture written to {plot}")


def _write_plot(report, path: str) -> None:
    from oomdoctor.diagnose import plot as plotting

    rows = [(r.plan.label(), r.memory) for r in report.results]
    timeline = None
    if report.engine == "simulate" and len(report.results) == 1:
        from oomdoctor.engines.simulate import simulate_plan

        timeline = simulate_plan(report.spec, report.results[0].plan, timeline=True, device=report.device).timeline
    if timeline is not None:
        plotting.plot_timeline(timeline, path, capacity_bytes=report.capacity_bytes)
    else:
        plotting.plot_plans(rows, report.budget, path)
