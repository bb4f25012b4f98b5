"""``oomdoctor diagnose MODEL``: memory of training MODEL per technique stack, from its config alone."""

from __future__ import annotations

import json
from typing import Optional

import typer

from oomdoctor.cli.app import app

HELP = """Memory of fine-tuning MODEL under each stack of techniques, from its config alone (no weights, no GPU).

MODEL is a Hugging Face id (bundled configs resolve offline: `oomdoctor models`), a local directory holding
config.json, or a config.json path. Flags you give pin that technique; the table spans the rest. With --gpu-mem
(or a GPU found through NVML) each plan gets a fit verdict, and plans that do not fit get the smallest changes
that make them fit, with the bytes each saves.

Techniques, correctly: LoRA is Low-Rank Adaptation (peft: frozen base + rank-r adapters). AdamW keeps exactly
Adam's two states (decoupled weight decay costs nothing); leaner are 8-bit/paged AdamW, Adafactor, Lion, SGD.
Gradient checkpointing is the biggest activation saver. Efficient init means building on the meta device and
loading straight into the target dtype; Xavier init changes weight variance, not memory.
"""
HELP = "\n\n".join(" ".join(par.split()) for par in HELP.strip().split("\n\n"))


def _pins(**kw) -> dict:
    pins = {k: v for k, v in kw.items() if v is not None}
    if "lora_targets" in pins:
        raw = [t.strip() for t in str(pins["lora_targets"]).split(",") if t.strip()]
        pins["lora_targets"] = tuple(raw)
    if pins.get("lora_on_head") is False:
        pins.pop("lora_on_head")
    if pins.get("double_quant") is False:
        pins.pop("double_quant")
    offload = pins.pop("offload", None)
    if offload:
        from oomdoctor.errors import BadInput

        names = [o.strip() for o in offload.split(",") if o.strip()]
        bad = [n for n in names if n not in ("none", "optimizer", "activations", "params")]
        if bad:
            raise BadInput(f"--offload {offload!r}: unknown part(s) {', '.join(bad)}; use optimizer, activations, "
                           "params (comma-separated) or none")
        for part in ("optimizer", "activations", "params"):
            pins[f"offload_{part}"] = part in names
    return pins


@app.command(help=HELP)
def diagnose(
    model: str = typer.Argument(..., help="HF id (e.g. meta-llama/Llama-2-7b-hf), model dir, or config.json"),
    method: Optional[str] = typer.Option(None, help="full | lora | qlora  (LoRA = Low-Rank Adaptation)"),
    precision: Optional[str] = typer.Option(
        None, help="fp32 | fp16-mixed | bf16-mixed (fp32 weights under autocast) | bf16 (pure bf16, no master copy)"
    ),
    optimizer: Optional[str] = typer.Option(
        None, help="adamw | adamw-8bit | paged-adamw | paged-adamw-8bit | adafactor | sgd | lion"
    ),
    attn: Optional[str] = typer.Option(None, help="eager (materializes seq^2 scores) | sdpa | flash"),
    gradient_checkpointing: Optional[bool] = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing", help="recompute activations in backward"
    ),
    lora_r: Optional[int] = typer.Option(None, help="LoRA rank r (adapters add r*(in+out) params per module)"),
    lora_targets: Optional[str] = typer.Option(None, help="q_proj,v_proj,... or all-linear"),
    lora_on_head: Optional[bool] = typer.Option(None, "--lora-on-head", help="also adapt the output head"),
    quant: Optional[str] = typer.Option(None, help="bitsandbytes base quantization: int8 | nf4 | fp4 (QLoRA)"),
    double_quant: Optional[bool] = typer.Option(None, "--double-quant", help="QLoRA double quantization"),
    offload: Optional[str] = typer.Option(None, help="CPU offload: optimizer,activations,params or none"),
    micro_batch: Optional[int] = typer.Option(None, help="sequences per forward/backward (default 1)"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per sequence (default min(2048, model max))"),
    gpu_mem: Optional[str] = typer.Option(None, help="card size: 24GB (10^9), 24GiB (2^30), 24000MiB; default: NVML"),
    engine: str = typer.Option("analytic", help="analytic (formulas) | simulate (real step on fake tensors) | measure (GPU)"),
    plot: Optional[str] = typer.Option(None, help="write a picture: FILE.png or FILE.html"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
) -> None:
    from oomdoctor.diagnose.report import diagnose as run_diagnose
    from oomdoctor.errors import BadInput
    from oomdoctor.units import parse_size

    if plot and not plot.lower().endswith((".png", ".html", ".htm")):
        raise BadInput(f"--plot {plot!r}: use a .png or .html file name")
    pins = _pins(
        method=method, precision=precision, optimizer=optimizer, attn=attn,
        gradient_checkpointing=gradient_checkpointing, lora_r=lora_r, lora_targets=lora_targets,
        lora_on_head=lora_on_head, quant=quant, double_quant=double_quant, offload=offload,
        micro_batch=micro_batch, seq_len=seq_len,
    )
    capacity = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
    report = run_diagnose(model, pins, gpu_mem=capacity, engine=engine)
    if plot:
        _write_plot(report, plot)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
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

        timeline = simulate_plan(report.spec, report.results[0].plan, timeline=True).timeline
    if timeline is not None:
        plotting.plot_timeline(timeline, path, capacity_bytes=report.capacity_bytes)
    else:
        plotting.plot_plans(rows, report.capacity_bytes, path)
