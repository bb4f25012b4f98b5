"""``diagnose``: the likely causes of a parsed OOM (:mod:`oomdoctor.explain.causes`), most likely first, with the
user's plan priced by the memory model when it is known (:mod:`oomdoctor.explain.pricing`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from oomdoctor.explain import causes
from oomdoctor.explain.logits import LogitsShape
from oomdoctor.explain.pricing import rank_plan_fixes
from oomdoctor.explain.report import Diagnosis, OomReport
from oomdoctor.units import format_bytes

if TYPE_CHECKING:
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan


def card_label(capacity: int | None, given: bool) -> str:
    """The card as the user gave it (``--gpu-mem 24GB``: decimal), else as torch printed it (GiB); ``SIZE`` when
    unknown."""
    return format_bytes(capacity, binary=not given).replace(" ", "") if capacity else "SIZE"


def logits_shape(spec: ModelSpec | None, plan: Plan | None) -> LogitsShape:
    """The logits the user's model and plan would make (common vocabularies when the model is not given)."""
    shape = LogitsShape()
    if spec is not None:
        shape = replace(shape, vocabs=(spec.vocab_size,), model=spec.name)
    if plan is not None:
        shape = replace(shape, tokens=plan.micro_batch * plan.seq_len, seq_len=plan.seq_len)
    return shape


def diagnose(
    report: OomReport, spec: ModelSpec | None = None, plan: Plan | None = None, capacity_bytes: int | None = None
) -> Diagnosis:
    """Order the likely causes of ``report``; with ``spec`` and ``plan``, price the plan fixes with the memory model."""
    r = report
    cap = capacity_bytes if capacity_bytes is not None else r.total_bytes
    mem = card_label(cap, given=capacity_bytes is not None)
    priced = rank_plan_fixes(spec, plan, cap, capacity_label=mem) if spec is not None and plan is not None else None
    free = causes.usable_free(r)
    found = [
        c
        for c in (
            causes.fragmentation(r, free),
            causes.other_processes(r),
            causes.huge_allocation(r, free, logits_shape(spec, plan)),
        )
        if c
    ]
    found.append(causes.capacity(r, free, found, priced, cap, plan))
    found.sort(key=lambda c: -c.score)
    nxt = None
    if r.kind not in ("cpu-allocator", "cpu-oom-killer"):
        nxt = f"oomdoctor tune {spec.name if spec is not None else 'MODEL'} --gpu-mem {mem}"
    return Diagnosis(
        report=r,
        causes=tuple(found),
        plan_label=plan.label() if plan is not None else None,
        plan_peak_bytes=priced.peak_bytes if priced else None,
        plan_peak_phase=priced.peak_phase if priced else None,
        capacity_bytes=cap,
        next_command=nxt,
    )
