"""``diagnose``: price every plan of the technique matrix for one model, give a fit verdict and advice.

Computing only (the CLI module prints). Verdicts use the one budget rule (``oomdoctor.plan.budget``): ``--gpu-mem``
when given, else the local GPU's free memory through NVML, else no budget (no verdict).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oomdoctor.diagnose.advice import Advice, SmallerModel, advise, smaller_model_that_fits
from oomdoctor.diagnose.matrix import enumerate_plans
from oomdoctor.engines import estimate
from oomdoctor.engines.block_pool import prefetch
from oomdoctor.errors import BadInput
from oomdoctor.gpu import GpuInfo, detect_gpu
from oomdoctor.memory import MemoryBreakdown
from oomdoctor.model.load import load_spec
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.budget import Budget, resolve_budget
from oomdoctor.progress import report as show_progress

#: The simulate/measure engines run real steps (seconds each): refuse huge matrices, ask to pin more flags.
MAX_PLANS_SLOW_ENGINE = 12


@dataclass
class PlanResult:
    """One row of the diagnose table."""

    plan: Plan
    memory: MemoryBreakdown
    fits: bool | None
    advice: Advice | None = None

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "label": self.plan.label(),
            "settings": self.plan.settings(),
            "fits": self.fits,
            "memory": self.memory.to_dict(),
        }
        if self.advice is not None:
            d["advice"] = self.advice.to_dict()
        return d


@dataclass
class DiagnoseReport:
    """Everything ``oomdoctor diagnose`` shows."""

    spec: ModelSpec
    engine: str
    budget: Budget | None
    """What the verdicts use (None: no --gpu-mem and no GPU found)."""
    gpu: GpuInfo | None
    device: str = "cuda"
    """The device the plans are priced for: ``cuda`` or ``cpu`` (``--device``)."""
    results: list[PlanResult] = field(default_factory=list)
    smaller_model: SmallerModel | None = None
    """Set when no plan fits and a smaller bundled model of the same family does."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the inputs (the capacity: other processes on the card, a --gpu-mem bigger
    than its free memory)."""
    priced: int = 0
    """Plans priced (``results`` may show fewer: ``--fits-only``, ``--top``)."""
    fitting_count: int = 0
    """Of the priced plans, those that fit."""

    @property
    def capacity_bytes(self) -> int | None:
        return self.budget.capacity_bytes if self.budget else None

    @property
    def capacity_source(self) -> str | None:
        return self.budget.source if self.budget else None

    @property
    def fitting(self) -> list[PlanResult]:
        return [r for r in self.results if r.fits]

    def to_dict(self) -> dict:
        s = self.spec
        return {
            "model": {
                "name": s.name,
                "model_type": s.model_type,
                "source": s.source,
                "params": s.num_params,
                "layers": s.num_layers,
                "hidden_size": s.hidden_size,
                "vocab_size": s.vocab_size,
            },
            "engine": self.engine,
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "capacity_source": self.capacity_source,
            "budget": self.budget.to_dict() if self.budget else None,
            "gpu": self.gpu.to_dict() if self.gpu else None,
            "plans": [r.to_dict() for r in self.results],
            "smaller_model": self.smaller_model.to_dict() if self.smaller_model else None,
            "notes": list(self.notes),
            "plans_priced": self.priced,
            "plans_fitting": self.fitting_count,
        }


def diagnose(
    model: str | ModelSpec,
    pins: dict[str, Any] | None = None,
    *,
    gpu_mem: int | None = None,
    engine: str = "analytic",
    advice: bool = True,
    fits_only: bool = False,
    top: int | None = None,
    device: str = "cuda",
) -> DiagnoseReport:
    """Price the matrix of plans for ``model`` (pins fix dimensions; see ``oomdoctor.diagnose.matrix``) on ``device``
    (``cpu``: no CUDA context, workspace or allocator slack; the budget, ``gpu_mem`` only, counts live tensor bytes).
    ``fits_only``: keep the plans that fit (needs a capacity); ``top``: keep the first N (most faithful first)."""
    if top is not None and top < 1:
        raise BadInput(f"--top must be >= 1, got {top}")
    spec = load_spec(model) if isinstance(model, str) else model
    pins = dict(pins or {})
    if "seq_len" not in pins and spec.max_position_embeddings:
        pins["seq_len"] = min(Plan().seq_len, spec.max_position_embeddings)
    plans = enumerate_plans(pins)
    spec.check_seq_len(plans[0].seq_len, "--seq-len")
    if engine != "analytic" and len(plans) > MAX_PLANS_SLOW_ENGINE:
        raise BadInput(
            f"--engine {engine} runs a real training step per plan and these flags leave {len(plans)} plans",
            "pin more techniques (e.g. --method lora --precision bf16-mixed --optimizer adamw "
            "--gradient-checkpointing), or use --engine analytic for the whole matrix",
        )
    gpu = None if gpu_mem is not None or device != "cuda" else detect_gpu()
    budget = resolve_budget(gpu_mem, None, gpu, on_cpu=device == "cpu")
    report = DiagnoseReport(
        spec=spec,
        engine=engine,
        budget=budget,
        gpu=gpu,
        device=device,
        notes=list(budget.notes) if budget is not None else [],
    )

    def priced(s: ModelSpec, p: Plan) -> MemoryBreakdown:
        return estimate(s, p, "analytic", device)

    if engine == "analytic":
        prefetch(spec, plans)  # the blocks the plans' estimates measure, on every core
    headline = {p.method: p for p in reversed(plans)}  # most faithful plan of each method: full advice path
    for i, plan in enumerate(plans):
        if engine != "analytic":  # a replay (or a GPU run) per plan: seconds each
            show_progress("diagnose", f"pricing {plan.label()} with the {engine} engine", i + 1, len(plans))
        mem = estimate(spec, plan, engine, device)
        ok = budget.fits(mem) if budget is not None else None
        adv = None
        if advice and ok is False:
            adv = advise(
                spec, plan, budget, estimator=priced, with_path=headline.get(plan.method) == plan or len(plans) == 1
            )
        report.results.append(PlanResult(plan, mem, ok, adv))
    if fits_only and budget is None:
        raise BadInput(
            "--fits-only needs a capacity: no --gpu-mem given and no GPU found",
            f"pass --gpu-mem, e.g. `oomdoctor diagnose {spec.name} --gpu-mem 24GB --fits-only`",
        )
    rescued = any(r.advice and (r.advice.path_fits or any(c.fits for c in r.advice.single)) for r in report.results)
    if budget is not None and not report.fitting and advice and not rescued:
        # only when no change above makes a plan fit: the advice and this verdict never contradict each other
        report.smaller_model = smaller_model_that_fits(spec, plans[0], budget, estimator=priced)
    report.priced, report.fitting_count = len(report.results), len(report.fitting)
    if fits_only:
        report.results = [r for r in report.results if r.fits]
    if top is not None:
        report.results = report.results[:top]
    return report
