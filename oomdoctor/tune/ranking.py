"""Ranking fitting plans: fidelity first (what the plan changes about training), then estimated throughput — or
throughput first with ``--prefer speed``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.model.execution import upcast_changes_bytes
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import BatchChoice
from oomdoctor.tune.throughput import Throughput

Prefer = Literal["quality", "speed"]
PREFERS: tuple[str, ...] = ("quality", "speed")

METHOD_RANK = {"full": 0, "lora": 1, "qlora": 2}
QUANT_RANK = {None: 0, "int8": 1, "nf4": 2, "fp4": 3}
#: fp32 weights with bf16 autocast keep fp32 master weights: same fidelity tier as fp32.
PRECISION_RANK = {"fp32": 0, "bf16-mixed": 0, "fp16-mixed": 1, "bf16": 2}
OPTIMIZER_RANK = {
    "adamw": 0,
    "paged-adamw": 0,
    "adamw-8bit": 1,
    "paged-adamw-8bit": 1,
    "adafactor": 2,
    "lion": 3,
    "sgd": 4,
}


def fidelity_key(plan: Plan) -> tuple[int, ...]:
    """The quality tier of a plan (lower is more faithful), as an expert ranks plans before speed:

    1. what is trained: full > LoRA > QLoRA, the quantization bits of a frozen base, and a quantized base's
       unquantized weights: peft's k-bit upcast (fp32 embeddings, norms and head, and with them an fp32 residual
       stream) > left in bf16 (``kbit_upcast: false``, where it changes anything: a bf16-loaded base);
    2. on the device > CPU offload: offloading optimizer state, activations or weights is chosen only when no
       on-device plan of the same tier fits (it changes no numbers but costs PCIe time, often 2-4x);
    3. weight precision where it matters — a full fine-tune updates every weight, so fp32 master weights (fp32 or
       bf16 autocast) beat pure bf16 (updates lost to bf16 rounding); LoRA/QLoRA train fp32 adapters on a frozen
       base (peft keeps adapters fp32), so their base precision is left to throughput;
    4. optimizer state precision (32-bit > 8-bit > other optimizers);
    5. the optimizer stepped after backward > in backward (which gives up gradient clipping).

    Gradient checkpointing changes no numbers either: it is left to throughput, which charges its recompute."""
    offload = plan.offload_optimizer or plan.offload_activations or plan.offload_params
    return (
        METHOD_RANK[plan.method],
        QUANT_RANK.get(plan.quant, 9),
        int(upcast_changes_bytes(plan) and not plan.kbit_upcast),
        int(offload),
        PRECISION_RANK.get(plan.precision, 9) if plan.method == "full" else 0,
        OPTIMIZER_RANK.get(plan.optimizer, 9),
        int(plan.optimizer_in_backward),  # no gradient clipping: only when the tier needs it
    )


@dataclass
class Candidate:
    """One enumerated plan, priced."""

    plan: Plan
    """The plan; when it fits, with the chosen micro-batch and gradient accumulation."""
    memory: MemoryBreakdown
    """Breakdown at the chosen micro-batch (at micro-batch 1 when nothing fits)."""
    batch: BatchChoice | None
    """Micro-batch choice; None when micro-batch 1 does not fit."""
    throughput: Throughput | None = None
    rank: int | None = None
    """1 = chosen; None for plans that do not fit."""
    why_not: str | None = None
    """Why a plan whose device memory fits is still out (the host RAM its offload or paged optimizer states need)."""

    @property
    def fits(self) -> bool:
        return self.batch is not None

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "label": self.plan.label(),
            "fits": self.fits,
            "peak_device_bytes": self.memory.peak_device,
            "batch": self.batch.to_dict() if self.batch else None,
            "throughput": self.throughput.to_dict() if self.throughput else None,
            "host_ram_bytes": self.memory.cpu_offloaded,
            "why_not": self.why_not,
        }


def rank_key(c: Candidate, prefer: Prefer = "quality") -> tuple:
    """Sort key (ascending = better). ``quality``: the quality tier (:func:`fidelity_key`), then the fastest plan
    of the tier. ``speed``: throughput, then the tier. Throughput is compared at 3 significant digits so
    estimation noise does not beat the tier."""
    tps = c.throughput.tokens_per_s if c.throughput else 0.0
    tps_r = float(f"{tps:.3g}") if tps > 0 else 0.0
    if prefer == "speed":
        return (-tps_r, fidelity_key(c.plan))
    return (fidelity_key(c.plan), -tps_r)


__all__ = [
    "Prefer",
    "PREFERS",
    "METHOD_RANK",
    "QUANT_RANK",
    "PRECISION_RANK",
    "OPTIMIZER_RANK",
    "fidelity_key",
    "Candidate",
    "rank_key",
]
