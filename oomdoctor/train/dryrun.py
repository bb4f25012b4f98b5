"""``oomdoctor train CONFIG --dry-run``: validate the config and price it without training (CI gate).

The plan is the config's :meth:`TrainConfig.to_plan`; the breakdown comes from ``oomdoctor.memory.estimate`` with
the chosen engine. Budget (``oomdoctor.train.sizing.run_budget``, the rule every verb uses): ``--gpu-mem``, else the
config's ``gpu_mem``, else the local GPU's free memory (NVML), else none (no verdict, exit 0). The device priced is
the config's: ``device: cpu`` is priced as a CPU run (no CUDA context, cuBLAS workspace or allocator slack) and its
predicted ``peak_allocated`` must fit, because on the CPU ``--gpu-mem`` caps live tensor bytes; ``cuda`` and ``auto``
(the GPU the run takes when there is one) are priced for a GPU, whose predicted resident device peak (those overheads
included, evictable paged optimizer state not) must fit. When it does not fit, ``oomdoctor.diagnose.advice.advise``
ranks the one-knob changes that would (exit 3). Before pricing, ``oomdoctor.train.preflight`` checks the config
against its model and data (every problem at once, exit 2), as the run does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oomdoctor.train.config import TrainConfig
from oomdoctor.units import format_bytes


@dataclass
class DryRun:
    """Result of a dry run."""

    spec: Any
    """The :class:`oomdoctor.model.spec.ModelSpec` priced."""
    plan: Any
    """The :class:`oomdoctor.plan.Plan` of the config."""
    memory: Any
    """The predicted :class:`oomdoctor.memory.MemoryBreakdown`."""
    budget: Any
    """The :class:`oomdoctor.plan.budget.Budget` (None: unknown, no verdict)."""
    fits: bool | None
    advice: Any = None
    """:class:`oomdoctor.diagnose.advice.Advice` when it does not fit."""
    engine: str = "analytic"
    notes: list[str] = field(default_factory=list)
    device: str = "cuda"
    """The device priced: ``cpu`` for ``device: cpu``, else ``cuda``."""
    eval_memory: Any = None
    """:class:`oomdoctor.memory.evaluation.EvalMemory` of the eval phase (None: the config has no eval set)."""
    train_fits: bool | None = None
    """The training step's own verdict (``fits`` also requires the eval phase to fit)."""

    @property
    def capacity(self) -> int | None:
        return self.budget.capacity_bytes if self.budget is not None else None

    @property
    def capacity_source(self) -> str:
        return self.budget.source if self.budget is not None else "none"

    @property
    def compared(self) -> str:
        """``resident_device`` (GPU) or ``peak_allocated`` (CPU run with a simulated cap)."""
        if self.budget is not None:
            return self.budget.counted
        return "peak_allocated" if self.device == "cpu" else "resident_device"

    @property
    def needed(self) -> int:
        return int(getattr(self.memory, self.compared))

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "capacity_bytes": self.capacity,
            "capacity_source": self.capacity_source,
            "budget": self.budget.to_dict() if self.budget is not None else None,
            "compared": self.compared,
            "needed_bytes": self.needed,
            "engine": self.engine,
            "device": self.device,
            "model": self.spec.name,
            "plan": self.plan.label(),
            "settings": self.plan.settings(),
            "micro_batch_size": self.plan.micro_batch,
            "gradient_accumulation_steps": self.plan.grad_accum,
            "effective_batch_size": self.plan.effective_batch,
            "memory": self.memory.to_dict(),
            "advice": self.advice.to_dict() if self.advice is not None else None,
            "eval": None
            if self.eval_memory is None
            else {
                **self.eval_memory.to_dict(),
                "needed_bytes": int(getattr(self.eval_memory, self.compared)),
                "fits": None if self.budget is None else self.budget.fits(self.eval_memory),
            },
            "notes": list(self.notes),
        }


def dry_run(
    cfg: TrainConfig, *, gpu_mem: int | None = None, engine: str = "analytic", source: str = "train config"
) -> DryRun:
    """Check ``cfg`` (named ``source`` in its problem list) and price it on the device it names."""
    from oomdoctor.engines import estimate
    from oomdoctor.gpu import detect_gpu
    from oomdoctor.model.load import load_spec
    from oomdoctor.train.preflight import check
    from oomdoctor.train.sizing import auto_micro_batch, run_budget

    notes = check(cfg, source=source)
    device = "cpu" if cfg.device == "cpu" else "cuda"
    if cfg.device == "auto" and detect_gpu() is None:
        notes.append(
            "device: auto is priced for a GPU (the run takes one when there is one); this machine has none "
            "and would train on the CPU: set device: cpu to price that run"
        )
    budget = run_budget(cfg, gpu_mem, on_cpu=device == "cpu")
    if budget is None:
        notes.append("no memory budget: pass --gpu-mem SIZE (or gpu_mem: in the config) for a fit verdict")
    else:
        notes.extend(budget.notes)
    micro = cfg.micro_batch_size
    if micro == "auto":
        micro = auto_micro_batch(cfg, budget, engine, device)
        notes.append(f"micro_batch_size auto -> {micro}")
    spec = load_spec(cfg.model_ref)
    plan = cfg.to_plan(micro_batch=int(micro))
    try:
        memory = estimate(spec, plan, engine, device)
    except ModuleNotFoundError as exc:
        from oomdoctor.errors import BadInput

        raise BadInput(
            f"--engine {engine}: the memory engine is not available in this build ({exc})", "try --engine analytic"
        ) from None
    train_fits = None if budget is None else budget.fits(memory)
    evm = None
    if cfg.dataset.eval_split or cfg.dataset.eval_path:
        from oomdoctor.memory.evaluation import eval_memory

        evm = eval_memory(spec, plan, cfg.per_device_eval_batch_size, memory)
        if budget is not None and not budget.fits(evm):
            notes.append(
                f"the eval phase does not fit: per_device_eval_batch_size {cfg.per_device_eval_batch_size} "
                f"needs {format_bytes(budget.needed(evm))} (logits {format_bytes(evm.logits)}); lower it"
            )
    fits = None if budget is None else train_fits and (evm is None or budget.fits(evm))
    advice = None
    if train_fits is False:
        try:
            from oomdoctor.diagnose.advice import advise

            advice = advise(spec, plan, budget, estimator=lambda s, p: estimate(s, p, "analytic", device))
        except Exception as exc:  # noqa: BLE001 - advice is a bonus; the verdict stands without it
            notes.append(f"advice unavailable: {type(exc).__name__}: {exc}")
    return DryRun(
        spec=spec,
        plan=plan,
        memory=memory,
        budget=budget,
        fits=fits,
        advice=advice,
        engine=engine,
        notes=notes,
        device=device,
        eval_memory=evm,
        train_fits=train_fits,
    )


__all__ = ["dry_run", "DryRun"]
