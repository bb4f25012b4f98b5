"""Ranking fitting plans: fidelity first (what the plan changes about training), then estimated throughput — or
throughput first with ``--prefer speed``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import BatchChoice
from oomdoctor.tune.throughput import Throughput

Prefer = Literal["quality", "speed"]
PREFERS: tuple[str, ...] = ("quality", "speed")

METHOD_RANK = {"full": 0, "lora": 1, "qlora": 2}
QUANT_RANK = {None: 0, "int8": 1, "nf4": 2, "fp4": 3}
#: fp32 weights with bf16 autocast keep fp32 master weights: same fidelity tier as fp32.
PRECISION_RANK = {"fp32": 0, "bf16-mixed": 0, "fp16-mixed": 1, "bf16": 2}
OPTIMIZER_RANK = {"adamw": 0, "paged-adamw": 0, "adamw-8bit": 1, "paged-adamw-8bit": 1, "adafactor": 2, "lion": 3,
                  "sgd": 4}


def fidelity_key(plan: Plan) -> tuple[int, ...]:
    """Lower is more faithful: method (full > LoRA > QLoRA), quantization bits, weight precision (fp32 master
    weights > pure bf16), optimizer state precision (32-bit/bf16 > 8-bit > other optimizers), then plain > a
    compute-for-memory trade (gradient checkpointing or offload). GC and offload change no numbers, so they come
    last, as one criterion: between the two, the estimated throughput decides."""
    trade = plan.gradient_checkpointing or plan.offload_optimizer or plan.offload_activations or plan.offload_params
    return (
        METHOD_RANK[plan.method],
        QUANT_RANK.get(plan.quant, 9),
        PRECISION_RANK.get(plan.precision, 9),
        OPTIMIZER_RANK.get(plan.optimizer, 9),
        int(trade),
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
        }


def rank_key(c: Candidate, prefer: Prefer = "quality") -> tuple:
    """Sort key (ascending = better). ``quality``: fidelity, then throughput. ``speed``: throughput, then
    fidelity. Throughput is compared at 3 significant digits so estimation noise does not beat fidelity."""
    tps = c.throughput.tokens_per_s if c.throughput else 0.0
    tps_r = float(f"{tps:.3g}") if tps > 0 else 0.0
    if prefer == "speed":
        return (-tps_r, fidelity_key(c.plan))
    return (fidelity_key(c.plan), -tps_r)


__all__ = ["Prefer", "PREFERS", "METHOD_RANK", "QUANT_RANK", "PRECISION_RANK", "OPTIMIZER_RANK", "fidelity_key",
           "Candidate", "rank_key"]
