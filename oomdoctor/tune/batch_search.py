"""Batch search for one plan: the largest micro-batch the memory model lets fit a :class:`Budget`, and the device
trials that verify and refine it (predict, verify once, refine once).

Every memory number comes from an *estimator* ``(spec, plan) -> MemoryBreakdown`` (by default the analytic model),
so the same search runs on the analytic model, the simulator, or a fake in a unit test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import (
    DEFAULT_MICRO_LIMIT,
    BatchChoice,
    SearchTrace,
    accum_for,
    choose_micro_batch,
    max_fitting,
)
from oomdoctor.plan.budget import Budget

Estimator = Callable[[ModelSpec, Plan], MemoryBreakdown]


def analytic_estimator(spec: ModelSpec, plan: Plan) -> MemoryBreakdown:
    """The default estimator: the analytic memory model (formulas; measured blocks come from their cache)."""
    from oomdoctor.engines import estimate

    return estimate(spec, plan, "analytic")


def micro_batch_search(
    spec: ModelSpec,
    plan: Plan,
    budget: Budget,
    estimator: Estimator,
    *,
    global_batch: int | None = None,
    limit: int = DEFAULT_MICRO_LIMIT,
    trace: SearchTrace | None = None,
) -> tuple[BatchChoice | None, MemoryBreakdown]:
    """Largest micro-batch of ``plan`` that fits ``budget`` (:meth:`Budget.fits`), then the divisor choice.

    Returns (None, breakdown at micro-batch 1) when micro-batch 1 does not fit; else (choice, breakdown at the
    chosen micro-batch).
    """
    cache: dict[int, MemoryBreakdown] = {}

    def mem(b: int) -> MemoryBreakdown:
        # accumulation matters for memory only as "1" vs ">= 2" (from the second micro-batch on, the backward runs
        # with every gradient already allocated): price the accumulation the global batch implies at this size
        if b not in cache:
            cache[b] = estimator(spec, plan.with_(micro_batch=b, grad_accum=accum_for(b, global_batch)))
        return cache[b]

    upper = min(limit, global_batch) if global_batch else limit
    best = max_fitting(lambda b: budget.fits(mem(b)), upper, trace)
    if best == 0:
        return None, mem(1)
    choice = choose_micro_batch(best, global_batch)
    # choose_micro_batch's accumulation is accum_for's (global // micro for a divisor): the cached breakdown is it
    return choice, mem(choice.micro_batch)


@dataclass
class VerifyStep:
    """One device trial made by :func:`verify_and_refine`."""

    micro_batch: int
    fits: bool
    predicted: int
    """Memory-model prediction for this micro-batch (same quantity as ``measured``)."""
    measured: int | None
    """Measured peak when the trial reports one (None after an OOM on a real GPU)."""


def verify_and_refine(
    start: int,
    allowed: Iterable[int],
    predicted: Callable[[int], int],
    trial: Callable[[int], tuple[bool, int | None]],
    limit: int,
    capacity: int,
    *,
    max_trials: int = 4,
    refine: bool = True,
) -> tuple[int, list[VerifyStep]]:
    """Predict, verify once, refine once: the device-trial part of the batch finder.

    ``start`` is the memory model's answer; ``trial(b) -> (fits, measured peak or None)`` runs it for real.

    * fits: with a measured peak, the prediction is calibrated by ``k = measured / predicted`` and the largest
      ``allowed`` size above ``start`` with ``predicted * k <= limit`` is tried once (``refine``); if that one
      fails, the verified ``start`` stays the answer. Without a measurement the verified size is returned.
    * fails: the overshoot is at least ``capacity / predicted`` (the trial needed more than the capacity), times
      1.05, 1.10, 1.20... for the 1st, 2nd, 3rd failure; the next size is the largest allowed one below whose
      prediction times the overshoot fits ``limit`` — at least one step down — until one fits (then refine once
      below the smallest failing size) or ``max_trials`` is spent.

    ``limit`` is the budget's ``capacity - margin`` in the unit ``predicted`` returns (``Budget.needed``).
    Returns (verified size or 0, trials). ``allowed`` are the admissible sizes (divisors of the global batch, or
    1..micro_limit); memory must be monotone in the size.
    """
    sizes = sorted(set(int(a) for a in allowed if a >= 1))
    steps: list[VerifyStep] = []
    b = start
    best = 0
    failed = 1 << 62  # smallest size seen failing
    refined = False
    while b >= 1 and len(steps) < max_trials:
        pred = max(int(predicted(b)), 1)
        ok, measured = trial(b)
        steps.append(VerifyStep(b, ok, pred, measured))
        if ok:
            best = max(best, b)
            if refined or not refine or not measured:
                break
            k = measured / pred
            up = [d for d in sizes if b < d < failed and predicted(d) * k <= limit]
            if not up:
                break
            b, refined = max(up), True
            continue
        failed = min(failed, b)
        if best:  # the refinement step failed: keep the verified size
            break
        fails = sum(1 for s in steps if not s.fits)
        # the trial needed more than the capacity: assume the model is off by at least that, plus 5%, 10%, 20%...
        # for successive failures (a geometric step-down instead of one size at a time)
        over = max(capacity / pred, (measured or 0) / pred, 1.0) * (1.0 + 0.05 * 2 ** (fails - 1))
        down = [d for d in sizes if d < b]
        fit_down = [d for d in down if predicted(d) * over <= limit]
        b = max(fit_down) if fit_down else (max(down) if down else 0)
    return best, steps


__all__ = ["Estimator", "analytic_estimator", "micro_batch_search", "VerifyStep", "verify_and_refine"]


#: ``--seq-len max`` searches in steps of this many tokens, up to :data:`MAX_SEQ_LEN`.
SEQ_STEP = 64
MAX_SEQ_LEN = 1 << 21


def longest_seq_len(
    spec: ModelSpec,
    plan: Plan,
    budget: Budget,
    estimator: Estimator,
    *,
    micro_batch: int = 1,
    limit: int = MAX_SEQ_LEN,
    overshoot: float = 1.0,
    start: int = SEQ_STEP,
    accept: Callable[[Plan, MemoryBreakdown], bool] | None = None,
) -> int:
    """The longest sequence (a multiple of :data:`SEQ_STEP`, at most ``limit``) at which ``plan`` with
    ``micro_batch`` fits ``budget`` — its estimate times ``overshoot`` (a verified calibration), when given; 0 when
    not even one step does. Bisection: memory grows with the sequence. ``start``: a length known to be near or
    below the answer (the search begins there, or at one step when it does not fit). ``accept(plan, memory)``: a
    further condition that fails from some length on (the host RAM an offload plan needs)."""

    def fits(s: int) -> bool:
        p = plan.with_(seq_len=s, micro_batch=micro_batch, grad_accum=1)
        mem = estimator(spec, p)
        return budget.fits(mem, overshoot) and (accept is None or accept(p, mem))

    lo, hi = 0, limit // SEQ_STEP  # fits(lo * STEP) holds (vacuously for 0); find the largest such lo
    first = max(1, min(start // SEQ_STEP, hi))
    if first > 1 and fits(first * SEQ_STEP):
        lo = first
    elif not fits(SEQ_STEP):
        return 0
    else:
        lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * SEQ_STEP):
            lo = mid
        else:
            hi = mid - 1
    return lo * SEQ_STEP
