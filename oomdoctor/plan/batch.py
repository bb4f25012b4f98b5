"""Batch arithmetic every planner needs: the largest micro-batch a monotone memory predicate allows, the micro-batch
that divides a global batch exactly, and the accumulation that keeps it. Pure integers (no memory model, no torch):
``tune`` sizes plans with it and ``train`` sizes ``micro_batch_size: auto`` with it.

* :func:`max_fitting` — the largest integer ``b`` in ``[1, limit]`` with ``fits(b)`` for a monotone predicate
  (doubling, then bisection: ``2*ceil(log2(b))`` evaluations at most).
* :func:`choose_micro_batch` — given that maximum and the global batch, the micro-batch that divides the global
  batch exactly (largest divisor <= max) and the gradient accumulation that keeps ``micro * accum == global``.
* :func:`accum_for` — the accumulation to price a micro-batch with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from oomdoctor.errors import BadInput

#: Upper end of the micro-batch search when no global batch bounds it.
DEFAULT_MICRO_LIMIT = 1024


@dataclass
class SearchTrace:
    """Evaluations of the memory predicate made while searching (for tests and the benchmark's counts)."""

    evaluations: list[tuple[int, bool]] = field(default_factory=list)
    """(micro-batch, fits) in the order evaluated."""


def max_fitting(fits: Callable[[int], bool], limit: int, trace: SearchTrace | None = None) -> int:
    """Largest ``b`` in ``[1, limit]`` with ``fits(b)``, for a monotone predicate (fits(b) implies fits(b-1)).

    Doubling from 1 until the first failure (or ``limit``), then bisection between the last success and the
    first failure. Returns 0 when even ``fits(1)`` is false. Each ``b`` is evaluated at most once.
    """
    if limit < 1:
        raise BadInput(f"micro-batch search limit must be >= 1, got {limit}")
    cache: dict[int, bool] = {}

    def ok(b: int) -> bool:
        if b not in cache:
            cache[b] = bool(fits(b))
            if trace is not None:
                trace.evaluations.append((b, cache[b]))
        return cache[b]

    if not ok(1):
        return 0
    lo, hi = 1, None  # lo fits; hi (if set) does not
    b = 1
    while hi is None:
        if b >= limit:
            return limit
        nb = min(b * 2, limit)
        if ok(nb):
            lo = b = nb
        else:
            hi = nb
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def divisors(n: int, upto: int | None = None) -> list[int]:
    """Positive divisors of ``n`` in increasing order; with ``upto``, those up to it only, found in at most ``upto``
    steps (an absurd ``--global-batch 10**18`` answers at once instead of trial-dividing up to 10**9)."""
    if n < 1:
        raise BadInput(f"expected a positive integer, got {n}")
    if upto is not None and upto * upto < n:
        return [d for d in range(1, upto + 1) if n % d == 0]
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return [d for d in small + large[::-1] if upto is None or d <= upto]


@dataclass(frozen=True)
class BatchChoice:
    """Micro-batch and gradient accumulation for one plan."""

    max_micro_batch: int
    """Largest micro-batch that fits the budget (capped at the global batch when one is given)."""
    micro_batch: int
    """Chosen micro-batch (``per_device_train_batch_size``): divides the global batch exactly."""
    grad_accum: int
    """``gradient_accumulation_steps``: ``micro_batch * grad_accum == global_batch``."""
    global_batch: int | None
    """The requested effective batch (None: not given, the effective batch is the micro-batch)."""
    note: str | None = None
    """Set when exactness cost micro-batch size, with the nearest global batches that would not."""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum

    @property
    def exact(self) -> bool:
        return self.global_batch is None or self.effective_batch == self.global_batch

    def to_dict(self) -> dict:
        return {
            "max_micro_batch": self.max_micro_batch,
            "micro_batch_size": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "global_batch": self.global_batch,
            "effective_batch_size": self.effective_batch,
            "note": self.note,
        }


def choose_micro_batch(max_micro: int, global_batch: int | None) -> BatchChoice:
    """Pick the micro-batch (largest divisor of ``global_batch`` <= ``max_micro``) and the accumulation steps.

    Without a global batch the micro-batch is ``max_micro`` and accumulation 1. When the largest divisor is below
    ``max_micro`` the choice says so and names the nearest global batches that the full ``max_micro`` divides.
    """
    if max_micro < 1:
        raise BadInput("no micro-batch fits (not even 1)")
    if global_batch is None:
        return BatchChoice(max_micro, max_micro, 1, None)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise BadInput(f"--global-batch must be a positive integer, got {global_batch!r}")
    cap = min(max_micro, global_batch)
    micro = max(divisors(global_batch, upto=cap))
    accum = global_batch // micro
    note = None
    if micro < cap:
        lower = (global_batch // cap) * cap
        upper = lower + cap
        alts = [g for g in (lower, upper) if g >= cap]
        alt_txt = " or ".join(f"--global-batch {g} ({cap} x {g // cap})" for g in alts)
        note = (
            f"the largest micro-batch that fits is {cap}, but {global_batch} is not a multiple of it: using the "
            f"largest divisor, {micro} x {accum} accumulation steps ({100 * (1 - micro / cap):.0f}% smaller "
            f"micro-batch, same effective batch); {alt_txt} would use all {cap}"
        )
    return BatchChoice(max_micro, micro, accum, global_batch, note)


def accum_for(micro: int, global_batch: int | None) -> int:
    """Gradient accumulation to price a micro-batch with: ``global // micro`` (1 without a global batch or when the
    micro-batch covers it). Memory depends only on whether it is 1 or more."""
    if not global_batch or micro >= global_batch:
        return 1
    return max(global_batch // micro, 2)


__all__ = [
    "DEFAULT_MICRO_LIMIT",
    "SearchTrace",
    "max_fitting",
    "divisors",
    "BatchChoice",
    "choose_micro_batch",
    "accum_for",
]
