"""Typer options of the plan knobs, from the technique table (``oomdoctor.plan.techniques``): one flag name, help
text and default per knob for diagnose and tune."""

from __future__ import annotations

from typing import Any

import typer

from oomdoctor.plan.techniques import technique

OFFLOAD_PARTS = ("optimizer", "activations", "params")

#: What ``--device`` means, for diagnose and tune (train reads ``device`` from its YAML).
DEVICE_HELP = (
    "cuda (default): a GPU, priced with its CUDA context, cuBLAS workspace and caching-allocator slack | "
    "cpu: a CPU run, its tensors alone (none of those), the budget (--mem) capping live tensor bytes as "
    "`oomdoctor train` does on the CPU"
)


def mem_option(default: str) -> Any:
    """``--gpu-mem`` / ``--mem`` (one option, two names): the memory of the device the plan runs on. ``default``: what
    is used when it is not given."""
    return typer.Option(
        None,
        "--gpu-mem",
        "--mem",
        help="memory of the device: the GPU's (24GB = 10^9 bytes, 24GiB = 2^30, 24000MiB) or, with "
        f"--device cpu, the RAM the run may fill with tensors; default: {default}",
    )


def device_option() -> Any:
    """``--device cuda|cpu``: the device the plan is priced for."""
    return typer.Option("cuda", "--device", help=DEVICE_HELP)


def plan_option(name: str, unset: str = "spanned/searched") -> Any:
    """A pinning option for the plan knob ``name`` (default None: not pinned; ``unset`` says what the command does
    then)."""
    t = technique(name)
    return typer.Option(None, t.option, help=t.flag_help(unset))


def offload_option() -> Any:
    """``--offload optimizer,activations,params|none``: the three offload knobs as one flag."""
    parts = ", ".join(f"{p}: {technique('offload_' + p).help}" for p in OFFLOAD_PARTS)
    return typer.Option(None, help=f"CPU offload, comma-separated parts or none (unset: spanned/searched). {parts}")


def pins_from(offload: str | None = None, **values: Any) -> dict[str, Any]:
    """The pinned knobs: the given (not None) values, comma-separated LoRA targets split into a tuple, ``--offload``
    expanded into the three ``offload_*`` knobs. Switch flags without a negative form (``--lora-on-head``,
    ``--double-quant``) pin only when given."""
    pins = {k: v for k, v in values.items() if v is not None}
    for switch in ("lora_on_head", "double_quant"):
        if pins.get(switch) is False:
            pins.pop(switch)
    if "lora_targets" in pins:
        pins["lora_targets"] = tuple(t.strip() for t in str(pins["lora_targets"]).split(",") if t.strip())
    if offload:
        from oomdoctor.errors import BadInput

        names = [o.strip() for o in offload.split(",") if o.strip()]
        bad = [n for n in names if n not in ("none",) + OFFLOAD_PARTS]
        if bad:
            raise BadInput(
                f"--offload {offload!r}: unknown part(s) {', '.join(bad)}",
                "use optimizer, activations, params (comma-separated) or none",
            )
        for part in OFFLOAD_PARTS:
            pins[f"offload_{part}"] = part in names
    return pins
