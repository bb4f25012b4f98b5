"""Verifying a tuned plan: a real GPU probe or the simulated step judges each (plan, micro-batch); the search's best
candidate is stepped down, refined up, or replaced by the next one until one verifies.

* :func:`gpu_prober`: a child process runs 2+ full steps on the local GPU (``oomdoctor.engines.probe``), its allocator
  capped at the planned capacity;
* :func:`simulate_prober`: without a GPU, the real Hugging Face step replayed on fake tensors
  (``oomdoctor.engines.estimate(..., "simulate")``), judged by ``Budget.fits``;
* :func:`verify`: the candidates in rank order through ``oomdoctor.tune.batch_search.verify_and_refine``;
* :func:`verification_mode`: which of the two ``--verify auto`` means for a plan, and what ``--verify gpu`` refuses.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput
from oomdoctor.gpu import GpuInfo
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import DEFAULT_MICRO_LIMIT, divisors
from oomdoctor.plan.budget import Budget
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.plan.techniques import DEFAULTS
from oomdoctor.progress import report
from oomdoctor.tune.batch_search import Estimator, verify_and_refine
from oomdoctor.tune.ranking import Candidate
from oomdoctor.units import format_bytes

#: ``--verify`` values: ``auto`` (the GPU when the plan can run there, else the simulated step), ``gpu``,
#: ``simulate``, ``none``.
VERIFY_MODES: tuple[str, ...] = ("auto", "gpu", "simulate", "none")


@dataclass(frozen=True)
class Trial:
    """One verification of a (plan, micro-batch): a real GPU probe or a simulated step."""

    micro_batch: int
    """Micro-batch tried."""
    grad_accum: int
    """Accumulation that keeps the effective batch at this micro-batch."""
    outcome: str
    """``fits``, ``oom`` (out of memory / over the budget) or ``error`` (the probe itself failed)."""
    verified_by: str
    """``gpu`` (child process on the real device) or ``simulate`` (fake-tensor replay)."""
    plan_label: str
    """The plan's label (``Plan.label``)."""
    predicted_peak_bytes: int
    """The search's (analytic) ``peak_device`` for this micro-batch."""
    measured_peak_bytes: int | None = None
    """GPU: peak device memory used by the probe (reserved + context); simulate: what the budget counts of its
    breakdown (``resident_device``)."""
    measured_peak_allocated_bytes: int | None = None
    """GPU: ``torch.cuda.max_memory_allocated``; simulate: its ``peak_allocated``."""
    steps: int = 0
    """Full training steps run (forward, backward, optimizer step)."""
    seconds: float = 0.0
    """Wall time of the trial."""
    message: str | None = None
    """Why it did not fit or could not run (None: it fit)."""

    def to_dict(self) -> dict:
        return {
            "micro_batch": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "outcome": self.outcome,
            "verified_by": self.verified_by,
            "plan": self.plan_label,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_peak_allocated_bytes": self.measured_peak_allocated_bytes,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "message": self.message,
        }


#: A prober runs one (plan, micro-batch) and returns a Trial; ``predicted`` is the analytic peak.
Prober = Callable[[Plan, int], Trial]


def simulate_prober(spec: ModelSpec, budget: Budget, predicted: Callable[[Plan], int], device: str = "cuda") -> Prober:
    """Verification without a GPU: ``estimate(spec, plan, "simulate", device)`` (the real HF step on fake tensors),
    judged by ``budget.fits``."""

    def run(plan: Plan, micro: int) -> Trial:
        p = plan.with_(micro_batch=micro)
        report(
            "verify",
            f"verifying {p.label()} at micro-batch {micro} x {p.grad_accum}: the training step "
            "replayed on fake tensors",
        )
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():  # transformers deprecation chatter from the replayed step
                warnings.simplefilter("ignore")
                mem = estimate(spec, p, "simulate", device)
        except Exception as exc:  # noqa: BLE001 - any simulator failure is reported, not fatal
            return Trial(
                micro,
                p.grad_accum,
                "error",
                "simulate",
                p.label(),
                predicted(p),
                seconds=time.perf_counter() - t0,
                message=f"{type(exc).__name__}: {exc}"[:500],
            )
        ok = budget.fits(mem)
        return Trial(
            micro,
            p.grad_accum,
            "fits" if ok else "oom",
            "simulate",
            p.label(),
            predicted(p),
            measured_peak_bytes=budget.needed(mem),
            measured_peak_allocated_bytes=mem.peak_allocated,
            steps=2,
            seconds=time.perf_counter() - t0,
            message=None
            if ok
            else (
                f"simulated {budget.counted.replace('_', ' ')} {format_bytes(budget.needed(mem))}"
                f" > budget {format_bytes(budget.limit_bytes)}"
            ),
        )

    return run


def gpu_prober(
    model_ref: str,
    spec: ModelSpec,
    capacity: int,
    predicted: Callable[[Plan], int],
    *,
    steps: int = 2,
    timeout_s: float = 900.0,
) -> Prober:
    """Verification on the local GPU: a child process runs ``steps`` real steps (``oomdoctor.engines.probe``), its
    allocator capped at ``capacity`` so that an OOM means "does not fit the card you planned for"."""

    def run(plan: Plan, micro: int) -> Trial:
        from oomdoctor.engines.probe import run_probe

        p = plan.with_(micro_batch=micro)
        report(
            "verify",
            f"verifying {p.label()} at micro-batch {micro} x {p.grad_accum}: {steps} real steps on the "
            "GPU in a child process",
        )
        res = run_probe(model_ref, p, device="cuda", steps=steps, cap_bytes=capacity, timeout_s=timeout_s)
        return Trial(
            micro,
            p.grad_accum,
            res.outcome,
            "gpu",
            p.label(),
            predicted(p),
            measured_peak_bytes=res.peak_device_bytes,
            measured_peak_allocated_bytes=res.peak_allocated_bytes,
            steps=res.steps,
            seconds=res.seconds,
            message=res.message,
        )

    return run


class _ProbeFailed(Exception):
    """A probe could not run at all (outcome ``error``): verification stops."""


def verify(
    candidates: list[Candidate],
    prober: Prober,
    *,
    global_batch: int | None,
    limit: int,
    capacity: int,
    predicted_peak: Callable[[Plan], int],
    max_trials: int = 6,
    micro_limit: int = DEFAULT_MICRO_LIMIT,
    refine: bool = True,
) -> tuple[Candidate | None, Plan | None, list[Trial]]:
    """Verify the best candidate at its micro-batch, refine once upwards when the measurement shows room, step
    down (calibrated by the overshoot) when it fails, and move to the next candidate when even micro-batch 1
    fails (``oomdoctor.tune.batch_search.verify_and_refine``; ``limit`` is the budget's ``capacity - margin``,
    ``predicted_peak`` what it counts). Sizes stay divisors of the global batch.

    Returns (candidate, verified plan, trials). The plan is None when every trial failed or the trial budget ran
    out; an ``error`` outcome (the probe could not run at all) stops verification with plan None."""
    trials: list[Trial] = []
    allowed = divisors(global_batch, upto=micro_limit) if global_batch else range(1, micro_limit + 1)
    for cand in candidates:
        if not cand.fits or len(trials) >= max_trials:
            continue

        def sized(b: int, cand: Candidate = cand) -> Plan:
            return cand.plan.with_(micro_batch=b, grad_accum=(global_batch // b) if global_batch else 1)

        def trial(b: int) -> tuple[bool, int | None]:
            t = prober(sized(b), b)
            trials.append(t)
            if t.outcome == "error":
                raise _ProbeFailed(t.message)
            return t.outcome == "fits", t.measured_peak_bytes

        try:
            best, _ = verify_and_refine(
                cand.plan.micro_batch,
                allowed,
                lambda b: predicted_peak(sized(b)),
                trial,
                limit,
                capacity,
                max_trials=max_trials - len(trials),
                refine=refine,
            )
        except _ProbeFailed:
            return cand, None, trials
        if best:
            return cand, sized(best), trials
    return None, None, trials


def peak_predictor(spec: ModelSpec, budget: Budget, estimator: Estimator) -> Callable[[Plan], int]:
    """What the budget counts of the memory model's breakdown of a plan, cached (the trials' ``predicted`` peak).
    Memory sees accumulation only as 1 vs >= 2, so plans that differ beyond that share one evaluation."""
    cache: dict[Plan, int] = {}

    def predicted_peak(p: Plan) -> int:
        key = p.with_(grad_accum=min(p.grad_accum, 2))
        if key not in cache:
            cache[key] = budget.needed(estimator(spec, key))
        return cache[key]

    return predicted_peak


def verification_mode(
    requested: str, plan: Plan, gpu: GpuInfo | None, gpu_mem: int | None, world_size: int
) -> tuple[str, str | None]:
    """``(mode, note)``: what verifies ``plan`` when ``--verify requested``. ``auto`` is the GPU when one is there
    with the memory planned for (``gpu_mem`` at most its free memory), the plan runs one process and is oomdoctor's
    own step, else the simulated step; a DeepSpeed plan is not verified (``note`` says so). BadInput where ``gpu``
    cannot probe the plan: another trainer's step, no GPU, more than one GPU."""
    note = None
    mode = requested
    if mode == "auto" and plan.strategy in DEEPSPEED:
        mode = "none"
        note = (
            f"{plan.strategy}: DeepSpeed is priced by its formulas only (the simulated engine replays FSDP ranks "
            "and DDP, not DeepSpeed): the plan is unverified"
        )
    foreign = plan.trainer != DEFAULTS["trainer"]
    if mode == "auto":
        on_gpu = gpu is not None and (gpu_mem is None or gpu_mem <= gpu.free_bytes)
        # the GPU probe runs oomdoctor's own step: another trainer's plan is verified by replaying that trainer's
        mode = "gpu" if on_gpu and world_size == 1 and not foreign else "simulate"
    if mode == "gpu" and foreign:
        raise BadInput(
            f"--verify gpu runs oomdoctor's own step, not {plan.trainer}'s",
            "use --verify simulate (the trainer's own step replayed on fake tensors) or none",
        )
    if mode == "gpu" and gpu is None:
        raise BadInput("--verify gpu: no NVIDIA GPU found", "use --verify simulate (fake-tensor replay) or none")
    if mode == "gpu" and world_size > 1:
        raise BadInput(
            f"--verify gpu probes one process; a plan for {world_size} GPUs cannot run there",
            "use --verify simulate (one rank replayed with a fake process group) or none",
        )
    return mode, note


__all__ = [
    "VERIFY_MODES",
    "Prober",
    "Trial",
    "gpu_prober",
    "peak_predictor",
    "simulate_prober",
    "verification_mode",
    "verify",
]
