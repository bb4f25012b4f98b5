"""The user's plan priced by the memory model: its device peak and the plan changes that lower it, by bytes saved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomdoctor.explain.report import Fix
from oomdoctor.units import format_bytes

if TYPE_CHECKING:
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan


@dataclass(frozen=True)
class PricedPlan:
    """The plan's peak and its priced fixes (memory model)."""

    peak_bytes: int
    """Device peak of the plan (``MemoryBreakdown.peak_device``)."""
    peak_phase: str
    """Phase of that peak."""
    fixes: tuple[Fix, ...]
    """Plan changes that lower the peak, largest saving first; a combined fix first when no single one fits."""


def rank_plan_fixes(
    spec: ModelSpec, plan: Plan, capacity: int | None, engine: str = "analytic", capacity_label: str | None = None
) -> PricedPlan:
    """The device peak of ``plan``, its peak phase, and single-knob fixes sorted by bytes saved, largest first.

    The candidate changes and their prices come from ``oomdoctor.diagnose.advice`` (one knob each, priced as
    ``estimate(plan).peak_device - estimate(plan.with_(change)).peak_device``); explain orders them by bytes saved,
    because after an OOM the user wants the biggest lever first.
    """
    from oomdoctor.diagnose.advice import advise
    from oomdoctor.engines import estimate
    from oomdoctor.plan.budget import resolve_budget

    base = estimate(spec, plan, engine)
    budget = resolve_budget(capacity, None, None, gpu_mem_source="explain") if capacity else None
    advice = advise(spec, plan, budget, estimator=lambda s, p: estimate(s, p, engine))
    fixes = [
        Fix(
            ch.id,
            ch.description,
            ch.yaml,
            saves_bytes=int(ch.saves_bytes),
            peak_after_bytes=int(base.peak_device - ch.saves_bytes),
            fits=ch.fits,
        )
        for ch in advice.single
        if ch.saves_bytes > 0
    ]
    fixes.sort(key=lambda f: (-(f.saves_bytes or 0), f.id))
    if advice.path and len(advice.path) > 1 and not any(f.fits for f in fixes):
        # No single change fits: the advice module's cheapest path of changes, as one combined fix, first.
        end = advice.path[-1].plan
        after = estimate(spec, end, engine).peak_device
        steps = list(dict.fromkeys(ch.id for ch in advice.path))
        mem = capacity_label or (format_bytes(capacity).replace(" ", "") if capacity else "SIZE")
        fixes.insert(
            0,
            Fix(
                "combined",
                "No single change is enough; together (cheapest first): " + ", then ".join(steps) + ".",
                f"plan: {end.label()}, micro-batch {end.micro_batch} x gradient accumulation {end.grad_accum}"
                f" (`oomdoctor tune {spec.name} --gpu-mem {mem}` writes the YAML)",
                saves_bytes=int(base.peak_device - after),
                peak_after_bytes=int(after),
                fits=advice.path_fits,
            ),
        )
    return PricedPlan(int(base.peak_device), base.peak_phase, tuple(fixes))
