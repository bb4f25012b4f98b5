"""``--seq-len max``: the longest sequence any plan fits, and the plan that fits it.

Every candidate plan's longest sequence is bisected over the memory model (``oomdoctor.tune.batch_search``), tiled
MLPs tried on the plans they can lengthen (:func:`tiling_finalists`); ``tune`` then searches the plan for that length
with the winner's techniques pinned. When verification shows the memory model's longest sequence does not fit,
:func:`calibrated_context` finds the longest one that does once the model is scaled by the measured overshoot.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from oomdoctor.errors import DoesNotFit
from oomdoctor.model.execution import tiled_mlp_refusal
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.budget import Budget
from oomdoctor.plan.techniques import DEFAULTS
from oomdoctor.tune.batch_search import MAX_SEQ_LEN, SEQ_STEP, Estimator, longest_seq_len
from oomdoctor.tune.ranking import Candidate, fidelity_key
from oomdoctor.tune.search import enumerate_candidates, host_bytes
from oomdoctor.tune.throughput import HardwareProfile
from oomdoctor.tune.verify import Trial

#: ``--seq-len max`` with tiled MLPs looks up to this many times a plan's longest untiled sequence.
TILED_REACH = 4
#: Knobs ``--seq-len max`` leaves to the regular search once the sequence is known.
NOT_PINNED_BY_MAX = ("micro_batch", "grad_accum", "seq_len")


def tiling_finalists(found: list[tuple[int, Plan]]) -> list[tuple[int, Plan]]:
    """The plans ``--seq-len max`` tries with tiled MLPs: of each group of plans that differ only in what does not
    grow with the sequence (the optimizer, its implementation, double quantization: constant bytes), the one with
    the longest untiled sequence — tiles save the same bytes per token across a group, so its longest plan stays
    its longest tiled. Longest first; the optimizer in backward cannot run tiles. Groups, not a couple of overall
    finalists: a plan that reaches less untiled can reach more tiled (its MLP the larger share of what grows), and a
    pinned knob would find it (Llama-3.3-70B QLoRA on 80 GB: 33,792 tokens unpinned, 89,728 with --tiled-mlp)."""
    best: dict[Plan, tuple[int, Plan]] = {}
    for s, p in found:
        if p.optimizer_in_backward:
            continue
        key = replace(
            p,
            optimizer=DEFAULTS["optimizer"],
            optimizer_impl=DEFAULTS["optimizer_impl"],
            double_quant=False,
            seq_len=SEQ_STEP,
        )
        if s > best.get(key, (0, p))[0]:
            best[key] = (s, p)
    return sorted(best.values(), key=lambda sp: -sp[0])


def longest_context(
    spec: ModelSpec,
    pins: dict[str, Any],
    budget: Budget,
    estimator: Estimator,
    profile: HardwareProfile,
    prefer: str,
    host_ram: int | None,
    world_size: int = 1,
) -> tuple[Plan, int]:
    """The plan that fits the longest sequence (micro-batch ``pins["micro_batch"]`` or 1) and that length: every
    candidate plan's longest sequence by bisection (:func:`longest_seq_len`, up to the model's positions,
    :attr:`ModelSpec.position_limit`; offload and paged-optimizer plans only within ``host_ram`` bytes of CPU RAM,
    ``search.host_bytes``; None: unchecked), the longest wins, ties broken by the quality tier, then by the untiled
    MLP. Tiled MLPs (unless pinned off; one GPU, a model that runs them: ``model.execution.tiled_mlp_refusal``): each
    :func:`tiling_finalists` plan is bisected again with its MLPs tiled, from its untiled length up to
    :data:`TILED_REACH` times it (each power of two a block replay, seconds, cached per block shape) — unless one
    more step does not fit tiled (tiles gain it nothing) or its reach cannot beat a tiled plan already found;
    pinned on, only tiled plans count. No single pinned knob finds a longer sequence (tests/test_search_pins.py).
    DoesNotFit when no plan fits even one step of tokens."""
    micro = int(pins.get("micro_batch", 1))
    tiled_pin = pins.get("tiled_mlp")
    plans = enumerate_candidates(
        {k: v for k, v in pins.items() if k not in ("micro_batch", "tiled_mlp")},
        Plan(seq_len=SEQ_STEP),
        bf16_supported=profile.bf16,
        chunked_loss=spec.arch_kind == "decoder",
        model_type=spec.model_type,
    )

    def host_fits(p: Plan, mem) -> bool:  # what it offloads or pages out must fit this machine's RAM
        return host_ram is None or host_bytes(mem, budget, p) <= host_ram

    def at(p: Plan, s: int) -> Plan:
        return p.with_(seq_len=s, micro_batch=micro, grad_accum=1)

    reach = min(MAX_SEQ_LEN, spec.position_limit or MAX_SEQ_LEN)  # never past the model's positions

    def longest_of(plans: list[Plan], start: int = SEQ_STEP, limit: int = reach) -> list[tuple[int, Plan]]:
        found = [
            (
                longest_seq_len(
                    spec, p, budget, estimator, micro_batch=micro, start=start, limit=limit, accept=host_fits
                ),
                p,
            )
            for p in plans
        ]
        return [(s, at(p, s)) for s, p in found if s > 0]

    def gains(p: Plan, s: int) -> bool:  # one more step fits
        mem = estimator(spec, at(p, s + SEQ_STEP))
        return budget.fits(mem) and host_fits(at(p, s + SEQ_STEP), mem)

    found = longest_of(plans)
    if tiled_pin or (tiled_pin is None and world_size == 1 and tiled_mlp_refusal(spec) is None):
        tiled: list[tuple[int, Plan]] = []
        for s, p in tiling_finalists(found):
            limit = min(reach, max(s, SEQ_STEP) * TILED_REACH)
            reached = max((t for t, _ in tiled), default=0)
            if limit < reached or s + SEQ_STEP > limit:
                continue
            tp = p.with_(tiled_mlp=True)
            if not tiled_pin and not gains(tp, s):
                continue
            tiled += longest_of([tp], start=s + SEQ_STEP if not tiled_pin else s, limit=limit)
        found = tiled if tiled_pin else found + tiled
    if not found:
        raise DoesNotFit(
            f"no plan fits {budget.describe()} even at {SEQ_STEP} tokens per sequence",
            f"see `oomdoctor diagnose {spec.name} --seq-len {SEQ_STEP}` for what is missing",
        )
    longest = max(s for s, _ in found)
    ties = [Candidate(p, estimator(spec, p), None) for s, p in found if s == longest]
    best = min(ties, key=lambda c: (fidelity_key(c.plan) if prefer == "quality" else (0,), c.plan.tiled_mlp))
    return best.plan, longest


def calibrated_context(
    spec: ModelSpec, plan: Plan, budget: Budget, estimator: Estimator, trials: list[Trial], failed: int
) -> int:
    """The longest sequence below ``failed`` at which ``plan`` fits once the memory model is scaled by the worst
    verified overshoot (measured / predicted peak of the failed trials); 0 when none does."""
    k = max(t.measured_peak_bytes / max(t.predicted_peak_bytes, 1) for t in trials if t.measured_peak_bytes)
    return longest_seq_len(
        spec, plan, budget, estimator, micro_batch=plan.micro_batch, limit=failed - 1, overshoot=max(k, 1.0)
    )


__all__ = ["NOT_PINNED_BY_MAX", "TILED_REACH", "calibrated_context", "longest_context", "tiling_finalists"]
