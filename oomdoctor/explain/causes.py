"""One function per likely cause of an out-of-memory error. Each reads the report's numbers as :class:`Term` s (a
sentence of evidence and what it does to the score), and returns a :class:`~oomdoctor.explain.report.Cause` with its
fixes, or ``None`` when nothing points to it. Scores are heuristic weights for ordering, not probabilities.

Letters in the comments: R requested, T total, F free, U reserved-but-unallocated, O other processes.

Two rules fix the order whatever the other numbers say: reserved-but-unallocated memory that covers the request
(U >= R) puts fragmentation first (:data:`FRAGMENTATION_FIRST`), and a request large against the card or against what
remained is its own cause (:func:`request_size_term`, :func:`remaining_term`), not "the plan needs more than the card".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomdoctor.explain.fixes import capacity_fixes, fragmentation_fixes, huge_allocation_fixes, other_process_fixes
from oomdoctor.explain.logits import LogitsShape, logits_match
from oomdoctor.explain.pricing import PricedPlan
from oomdoctor.explain.report import Cause, OomReport
from oomdoctor.units import format_bytes as fb

if TYPE_CHECKING:
    from oomdoctor.plan import Plan

GiB = 2**30
MiB = 2**20

#: Score of fragmentation when the cached blocks alone could hold the request (U >= R): above every other cause a
#: request that fits the card can have (a huge allocation scores at most :data:`HUGE_MOST`).
FRAGMENTATION_FIRST = 0.95
#: Highest score of a huge allocation that fits the card (one larger than the card scores up to 0.97).
HUGE_MOST = 0.94


@dataclass(frozen=True)
class Term:
    """One reading of the numbers that points to a cause."""

    evidence: str
    """The sentence, with the numbers."""
    floor: float | None = None
    """The cause scores at least this; ``None``: no lower bound."""
    bonus: float = 0.0
    """Added to the score once the floors are applied."""
    ceiling: float | None = None
    """The cause scores at most this; ``None``: no upper bound."""


def combine(base: float, terms: Sequence[Term], most: float = 1.0) -> float:
    """The score of a cause: the highest of ``base`` and the floors, plus the bonuses, within the ceilings and
    ``most``."""
    score = max([base] + [t.floor for t in terms if t.floor is not None])
    for t in terms:
        score += t.bonus
    for t in terms:
        if t.ceiling is not None:
            score = min(score, t.ceiling)
    return min(score, most)


def pct(part: int, whole: int | None) -> str:
    """``42% of the card`` (``""`` when the card's size is unknown; ``<1%`` rather than ``0%`` for a little)."""
    if not whole:
        return ""
    share = 100 * part / whole
    return ("<1%" if 0 < share < 0.5 else f"{share:.0f}%") + " of the card"


def usable_free(r: OomReport) -> int | None:
    """Free memory the process could actually use: a per-process cap (``set_per_process_memory_fraction``) can bind
    before the card is full."""
    if r.free_bytes is not None and r.allowed_bytes is not None and r.reserved_bytes is not None:
        return max(0, min(r.free_bytes, r.allowed_bytes - r.reserved_bytes))
    return r.free_bytes


def slack_after(r: OomReport, free: int | None) -> int:
    """What U and F leave once the request is served from them (negative: they fall short)."""
    return r.reserved_unallocated_bytes + (free or 0) - r.requested_bytes


def roomy(r: OomReport, free: int | None) -> bool:
    """Once the request is served from U and F, >= 5% of the card (1 GiB when its size is unknown) is left: the rest of
    the step can go on; else its next allocations fail anyway."""
    return slack_after(r, free) >= (0.05 * r.total_bytes if r.total_bytes else 1 * GiB)


def _cause(cause_id: str, score: float, terms: Sequence[Term], fixes) -> Cause:
    return Cause(cause_id, score, tuple(t.evidence for t in terms), tuple(fixes))


# ---------------------------------------------------------------------------------------------- fragmentation


def fragmentation_term(r: OomReport, free: int | None, roomy: bool) -> Term | None:
    """Reserved-but-unallocated memory (plus free memory) would have served the request.

    Before raising, the caching allocator already released every fully free cached segment and retried; what is left
    in U sits in partly used segments, so U >= R means fragmentation proper, and it comes first (the capacity cause
    states the headroom). ``roomy``: the card keeps >= 5% slack after the request; when U alone falls short, without
    that slack the next allocations of the step fail anyway and capacity leads.
    """
    U, R, T = r.reserved_unallocated_bytes, r.requested_bytes, r.total_bytes
    if U >= R:
        return Term(
            f"PyTorch held {fb(U)} reserved but unallocated, more than the {fb(R)} requested: the allocation "
            "would fit in the cached blocks if they were not fragmented (none of them is big enough)",
            floor=FRAGMENTATION_FIRST,
        )
    if free is not None and U + free >= R:
        return Term(
            f"{fb(U)} reserved-but-unallocated + {fb(free)} free = {fb(U + free)} >= the {fb(R)} "
            "requested: enough memory existed, only not in one piece",
            floor=0.75 if roomy else 0.55,
        )
    if U >= max(0.05 * (T or 0), 512 * MiB):
        return Term(
            f"{fb(U)} ({pct(U, T) or 'of the card'}) is reserved by PyTorch but unallocated: "
            "fragmentation adds to the shortage",
            floor=0.3,
        )
    return None


def fragmentation(r: OomReport, free: int | None) -> Cause | None:
    """The memory existed but not in one piece (caching-allocator messages only); ``free``: :func:`usable_free`."""
    U, R, T = r.reserved_unallocated_bytes, r.requested_bytes, r.total_bytes
    if U is None or R is None or r.kind not in ("cuda-allocator", "fsdp-clone-warning"):
        return None
    term = fragmentation_term(r, free, roomy(r, free))
    if term is None:
        return None
    terms = [term]
    slack = slack_after(r, free)
    if not roomy(r, free) and term.floor > 0.3 and U < R:
        terms.append(
            Term(
                f"but only {fb(max(0, slack))} would be left after serving it ({pct(max(0, slack), T)}): "
                "the rest of the step would likely fail next"
            )
        )
    return _cause("fragmentation", combine(0.0, terms), terms, fragmentation_fixes(r))


# ---------------------------------------------------------------------------------------------- other processes


def listed_processes_term(r: OomReport) -> Term | None:
    """Other processes the message lists hold memory (O > 0)."""
    R, T, F, O = r.requested_bytes, r.total_bytes, r.free_bytes, r.other_processes_bytes
    listed = ", ".join(f"PID {p.pid}: {fb(p.bytes)}" for p in r.processes if not p.is_self and p.bytes)
    deficit = (R - F) if (R is not None and F is not None) else None
    if deficit is not None and O >= deficit and O >= (0.05 * T if T else 1 * GiB):
        return Term(
            f"other processes hold {fb(O)}{' (' + pct(O, T) + ')' if T else ''} ({listed}); without them "
            f"the {fb(R)} request would have fit ({fb(F)} free + {fb(O)})",
            floor=0.8,
        )
    if T and O >= 0.1 * T:
        return Term(f"other processes hold {fb(O)} ({pct(O, T)}): {listed}", floor=0.5)
    if O >= 256 * MiB:
        return Term(f"other processes hold {fb(O)} ({listed})", floor=0.15)
    return None


def unlisted_processes_term(r: OomReport) -> Term | None:
    """No process list, but the numbers (or the kind of message) point to memory held by someone else."""
    T, N = r.total_bytes, r.non_pytorch_bytes
    if r.other_processes_bytes is None and N is not None and T and N >= max(2 * GiB, 0.1 * T):
        return Term(
            f"total - free - reserved = {fb(N)} ({pct(N, T)}) is held outside PyTorch's allocator; a CUDA "
            "context takes ~0.3-1 GiB, so the rest is likely other processes or libraries (the message does "
            "not list processes)",
            floor=0.45,
        )
    if r.kind == "cuda-error" and r.format == "cudnn":
        return Term(
            "cuDNN allocates its workspace outside the caching allocator: memory other processes hold "
            "leaves less for it",
            floor=0.4,
        )
    if r.kind == "cuda-error":
        return Term(
            "'CUDA error: out of memory' is raised outside the caching allocator, typically when creating "
            "the CUDA context or a cuBLAS/NCCL workspace on a card another process already fills",
            floor=0.6,
        )
    if r.kind == "quantized-offload":
        return Term(
            "device_map='auto' sizes the GPU share by the memory free at load time: memory held by other "
            "processes pushes modules to the CPU/disk",
            floor=0.4,
        )
    return None


def other_processes(r: OomReport) -> Cause | None:
    """Other processes (or other users of the card) hold the memory that was missing."""
    O = r.other_processes_bytes
    term = listed_processes_term(r) if O is not None and O > 0 else unlisted_processes_term(r)
    if term is None:
        return None
    return _cause("other-processes", combine(0.0, [term]), [term], other_process_fixes(r))


# ---------------------------------------------------------------------------------------------- huge allocation


def request_size_term(r: OomReport) -> Term | None:
    """The one request is large against the card (against the host for the CPU allocator, against Metal's largest
    buffer on MPS)."""
    R, T = r.requested_bytes, r.total_bytes
    if r.kind == "cpu-allocator":
        if R >= 2**40:
            return Term(f"one host allocation of {fb(R)}: more than any machine's RAM, a shape or size bug", floor=0.95)
        if R >= 8 * GiB:
            return Term(f"one host allocation of {fb(R)}", floor=0.6)
        return None
    if r.format == "torch-mps-buffer":
        return Term(
            f"one tensor of {fb(R)} is larger than the largest single buffer Metal allows: no memory setting "
            "serves it, the tensor itself must shrink",
            floor=0.95,
        )
    if T:
        frac = R / T
        if frac > 1:
            return Term(
                f"{fb(R)} requested is more than the whole card ({fb(T)}): no allocator setting can serve "
                "it; look for a shape bug (packing, missing truncation) or an enormous logits tensor",
                floor=0.95,
            )
        if frac >= 0.25:
            return Term(
                f"one request of {fb(R)} is {pct(R, T)} ({fb(T)}): a single tensor that size is a problem "
                "of its own (logits, an eval batch's outputs, a whole model's weights at once)",
                floor=0.85,
            )
        if frac >= 0.10:
            return Term(f"one request of {fb(R)} is {pct(R, T)} ({fb(T)})", floor=0.6)
        return None
    if R >= 8 * GiB:
        return Term(f"one request of {fb(R)}", floor=0.5)
    return None


def remaining_term(r: OomReport, free: int | None) -> Term | None:
    """The one request is far more than what remained (F + U, at least twice) and not small against the card (>= 5%,
    or >= 1 GiB when the card's size is unknown): one tensor ran out, not the many small ones of the step.
    ``free``: :func:`usable_free`."""
    R, U, T = r.requested_bytes, r.reserved_unallocated_bytes, r.total_bytes
    if None in (R, U, free):
        return None
    left = free + U
    if R < 2 * left or R < (0.05 * T if T else 1 * GiB):
        return None
    times = f"{R / left:.1f}x" if left else "far more than"
    return Term(
        f"the {fb(R)} request is {times} what remained ({fb(free)} free + {fb(U)} reserved-but-unallocated "
        f"= {fb(left)}): one tensor this size, not the step's many smaller ones, ran out",
        floor=0.5,
        bonus=0.2,
    )


def large_request_terms(r: OomReport, free: int | None) -> list[Term]:
    """The readings that make one request its own cause (large against the card, or against what remained)."""
    if r.requested_bytes is None:
        return []
    return [t for t in (request_size_term(r), remaining_term(r, free)) if t]


def logits_term(r: OomReport, shape: LogitsShape) -> Term | None:
    """The request has the size of the logits (tokens x vocab x 2|4 bytes)."""
    R = r.requested_bytes
    if R < 64 * MiB or r.kind == "cpu-allocator":
        return None
    match = logits_match(R, shape)
    return Term(match, bonus=0.15) if match else None


def failing_line_term(r: OomReport) -> Term | None:
    """The failing traceback line computes the logits or the loss."""
    code = (r.failing_frame or "").split(": ", 1)[-1]
    if re.search(r"logits|lm_head|cross_entropy|loss_fct", code):
        return Term(f"the failing line computes the logits/loss: `{code}`", bonus=0.1)
    return None


def logits_phase_term(r: OomReport) -> Term | None:
    """The OOM happened where the logits are the largest tensors."""
    if r.phase in ("loss", "evaluation"):
        return Term(
            f"it happened in the {r.phase} phase, where the [batch, seq, vocab] logits (and their fp32 "
            "copies) are the largest tensors",
            bonus=0.1,
        )
    return None


def huge_allocation(r: OomReport, free: int | None, shape: LogitsShape) -> Cause | None:
    """One request is large against the card or against what remained, or is recognisably the logits. ``free``:
    :func:`usable_free`; ``shape``: the vocabularies and token counts to match the logits against."""
    R, T = r.requested_bytes, r.total_bytes
    if R is None:
        return None
    terms = large_request_terms(r, free)
    logits = logits_term(r, shape)
    if logits:
        if not terms:
            terms.append(Term(f"one request of {fb(R)}" + (f" ({pct(R, T)})" if T else ""), floor=0.3))
        terms.append(logits)
    if not terms:
        return None
    terms += [t for t in (failing_line_term(r), logits_phase_term(r)) if t]
    most = 0.97 if T and R > T else HUGE_MOST
    return _cause("huge-allocation", combine(0.0, terms, most=most), terms, huge_allocation_fixes(r))


# ---------------------------------------------------------------------------------------------- capacity


def kind_term(r: OomReport) -> Term | None:
    """What the kind of message alone says about capacity."""
    if r.kind == "cpu-allocator":
        return Term(f"the host could not provide {fb(r.requested_bytes)} of RAM", floor=0.7)
    if r.kind == "cpu-oom-killer":
        return Term(
            "the Linux OOM killer ended the process: host RAM (plus swap) was exhausted"
            + (f"; the process held {fb(r.this_process_bytes)} resident" if r.this_process_bytes else ""),
            floor=0.8,
        )
    if r.kind == "quantized-offload":
        return Term("the quantized model did not fit in the GPU memory that was free when it was loaded", floor=0.8)
    if r.kind == "cuda-error" and r.format == "cudnn":
        return Term(
            "cuDNN found no algorithm whose workspace fits in the memory left: the batch's activations "
            "fill the card (no numbers are printed; check the plan with `oomdoctor diagnose`)",
            floor=0.6,
        )
    if r.kind == "cuda-error":
        return Term("no numbers are printed; check the plan against the card with `oomdoctor diagnose`")
    if r.format == "torch-mps-buffer":
        return Term(
            "Metal refuses one buffer above its size limit however much memory is free: the tensor, not the "
            "card's capacity, is the problem",
            ceiling=0.3,
        )
    if r.kind == "batch-size-exhausted":
        return Term(
            "even a batch of 1 ran out of memory: the model and plan need more than the card at any batch size "
            "(or the OOM came from evaluation: auto_find_batch_size shrinks the train batch for eval OOMs "
            "too, transformers#32215)",
            floor=0.8,
        )
    return None


def memory_cap_term(r: OomReport) -> Term | None:
    """A per-process cap, not the card, refused the request."""
    R, F, cap, reserved = r.requested_bytes, r.free_bytes, r.allowed_bytes, r.reserved_bytes
    if None in (cap, R, reserved, F) or not (reserved + R > cap and F >= R):
        return None
    return Term(
        f"the process is capped at {fb(cap)} (torch.cuda.set_per_process_memory_fraction) "
        f"and had reserved {fb(reserved)}; the card itself still had {fb(F)} free",
        floor=0.9,
    )


def outside_pytorch_term(r: OomReport) -> Term | None:
    """This process holds much memory outside PyTorch's allocator (another framework, paged optimizer state...)."""
    T, used, reserved = r.total_bytes, r.this_process_bytes, r.reserved_bytes
    if used is None or reserved is None or not T:
        return None
    extra = used - reserved
    if extra < max(2 * GiB, 0.1 * T):
        return None
    return Term(
        f"this process holds {fb(extra)} outside PyTorch's allocator ({fb(used)} in "
        f"use, {fb(reserved)} reserved by PyTorch): beyond the ~0.5 GiB CUDA context that is "
        "bitsandbytes paged state, NCCL buffers, or another framework (TensorFlow/JAX) preallocating",
        floor=0.6,
    )


def live_tensors_term(r: OomReport) -> Term | None:
    """How much of the card live tensors held; a large share means the plan fills the card."""
    A, R, T = r.allocated_bytes, r.requested_bytes, r.total_bytes
    if A is None or not T:
        return None
    share = A / T
    floor = 0.75 if share >= 0.9 else (0.65 if share >= 0.75 else None)
    return Term(
        f"PyTorch's live tensors held {fb(A)} ({pct(A, T)}) when the {fb(R) if R else 'new'} request came", floor=floor
    )


def headroom_term(r: OomReport, free: int | None) -> Term | None:
    """What could have served the request (U, then F, then O) against the request, in one sentence. It weighs on
    capacity when even all of it falls short and the request is not large by itself (:func:`large_request_terms`):
    the plan needs more than the card; and when the cached blocks would hold the request but leave under 5% of the
    card: fragmentation comes first, and the step would still run out after it."""
    R, U, O, T = r.requested_bytes, r.reserved_unallocated_bytes, r.other_processes_bytes, r.total_bytes
    if None in (R, U):
        return None
    if U >= R:
        left, tight = slack_after(r, free), not roomy(r, free)
        return Term(
            f"headroom: {fb(U)} reserved but unallocated vs the {fb(R)} request: it would fit in the cached "
            f"blocks with {fb(U - R)} to spare, leaving {fb(left)}{' (' + pct(left, T) + ')' if T else ''} on "
            "the card after it" + ("; the next allocations of the step would likely fail anyway" if tight else ""),
            floor=0.85 if tight else None,
        )
    if free is None:
        return None
    if U + free >= R:
        return Term(
            f"headroom: {fb(U)} reserved but unallocated + {fb(free)} free = {fb(U + free)} vs the {fb(R)} "
            f"request: {fb(U + free - R)} to spare, only not in one piece"
        )
    could = free + U + (O or 0)
    if R <= could:
        return Term(
            f"headroom: {fb(free)} free + {fb(U)} reserved but unallocated = {fb(free + U)} vs the {fb(R)} "
            f"request: short by {fb(R - free - U)}, less than the {fb(O)} other processes hold"
        )
    if large_request_terms(r, free):
        return Term(
            f"headroom: only {fb(could)} could have served the {fb(R)} request (short by {fb(R - could)}): "
            "one large request ran out, not the plan as a whole (see huge-allocation)"
        )
    return Term(
        f"headroom: even with no fragmentation and no other processes, only {fb(could)} could have served the "
        f"{fb(R)} request (short by {fb(R - could)}): the plan needs more than this card",
        floor=0.85,
    )


def plan_term(priced: PricedPlan | None, capacity: int | None) -> Term | None:
    """The memory model's peak for the user's plan against the card: above it confirms capacity, within it
    weakens it."""
    if priced is None or not capacity:
        return None
    need, phase = priced.peak_bytes, priced.peak_phase
    if need > capacity:
        return Term(
            f"the memory model puts your plan's peak at {fb(need)} ({phase}), more than the {fb(capacity)} card",
            floor=0.9,
        )
    return Term(
        f"the memory model puts your plan's peak at {fb(need)} ({phase}), within the "
        f"{fb(capacity)} card: look at the other causes and at phases it does not model (eval, save)",
        ceiling=0.4,
    )


def capacity(
    r: OomReport,
    free: int | None,
    others: Sequence[Cause],
    priced: PricedPlan | None,
    capacity_bytes: int | None,
    plan: Plan | None = None,
) -> Cause:
    """The plan needs more than the card: always a candidate, weighted by the numbers.

    ``others``: the causes found so far (a strong one weakens capacity unless the numbers or the plan insist);
    ``priced``: the user's plan priced by the memory model; ``plan``: the user's plan, when known without a model.
    """
    outside = outside_pytorch_term(r)
    terms = [
        t
        for t in (
            kind_term(r),
            memory_cap_term(r),
            outside,
            live_tensors_term(r),
            headroom_term(r, free),
            plan_term(priced, capacity_bytes),
        )
        if t
    ]
    score = combine(0.5, terms)
    if priced is None and score < 0.85 and any(c.score >= 0.8 for c in others):
        score = min(score, 0.4)
    fixes = capacity_fixes(r, outside is not None, priced.fixes if priced else (), plan)
    return _cause("capacity", score, terms, fixes)
