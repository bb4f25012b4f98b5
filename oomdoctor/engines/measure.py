"""The measured engine: run the plan's real training step on the local CUDA GPU and read the allocator's peaks.

``estimate_measured(spec, plan)`` builds the model of the plan's real shape with random weights (memory does not
depend on values; ``model_path`` loads local weights instead), runs the same two steps as the simulated engine
(``oomdoctor.engines.replay.run_steps`` with ``target="gpu"``: real CUDA autocast, real bitsandbytes layers and optimizers)
and reports:

* ``peak_allocated`` = ``torch.cuda.max_memory_allocated()`` and ``peak_reserved`` = ``max_memory_reserved()``
  (allocator statistics reset after the model is built, so the peak includes the weights, as in training);
* tensor components from :class:`oomdoctor.execute.tracking.LiveBytes` (same classification as ``simulate``), scaled to the
  allocator: anything the allocator holds that no tracked tensor explains (cuBLAS workspace, kernel-internal buffers)
  is reported in ``temporaries``;
* ``peak_device`` from NVML: this process's device memory after the steps (the caching allocator keeps its peak
  reservation), plus other processes' usage in the notes; ``cuda_context`` = NVML process usage - reserved.

``strategy: fsdp`` plans of one rank (``offload_params`` on one GPU, or world size 1) run as ``train`` runs them: a
one-rank NCCL process group, the meta-built model wrapped by ``oomdoctor.execute.shard.apply_fsdp`` and materialized
on the GPU. Several ranks need several processes: the engine refuses them (``--engine simulate`` replays one rank).

Without a CUDA GPU it raises :class:`oomdoctor.errors.NoGPU` (exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oomdoctor.errors import BadInput, NoGPU
from oomdoctor.gpu import detect_gpu, process_bytes
from oomdoctor.memory.breakdown import TENSOR_COMPONENTS, MemoryBreakdown
from oomdoctor.memory.runtime import ALLOC_BLOCK

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan

NO_GPU_MESSAGE = "--engine measure needs a CUDA GPU; none found"
NO_GPU_HINT = "use --engine simulate (exact tensor bytes, no GPU) or --engine analytic"


@dataclass
class MeasureResult:
    """Raw measurements of one plan on the local GPU."""

    breakdown: MemoryBreakdown
    max_allocated: int
    """``torch.cuda.max_memory_allocated()`` over the two steps."""
    max_reserved: int
    """``torch.cuda.max_memory_reserved()`` over the two steps."""
    nvml_process_used: int | None
    """NVML's view of this process after the steps (None when NVML is unavailable)."""
    tracked_peak: int
    """LiveBytes' peak (tensor storages only)."""
    step_max_allocated: list[int] = field(default_factory=list)
    """``max_memory_allocated`` after each step."""
    gpu: dict = field(default_factory=dict)
    """``oomdoctor.gpu.detect_gpu()`` as a dict (name, total, free, used, used by other processes)."""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "memory": self.breakdown.to_dict(),
            "max_allocated_bytes": self.max_allocated,
            "max_reserved_bytes": self.max_reserved,
            "nvml_process_used_bytes": self.nvml_process_used,
            "tracked_peak_bytes": self.tracked_peak,
            "step_max_allocated_bytes": self.step_max_allocated,
            "gpu": self.gpu,
            "seconds": round(self.seconds, 2),
        }


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


def require_cuda() -> None:
    """Raise NoGPU (exit 2) unless a CUDA device is usable."""
    if not cuda_available():
        raise NoGPU(NO_GPU_MESSAGE, NO_GPU_HINT)


def _gpu_info() -> dict:
    g = detect_gpu()
    return g.to_dict() if g is not None else {}


def measure_plan(
    spec: "ModelSpec", plan: "Plan", *, model_path: str | None = None, steps: int = 2, seed: int = 0
) -> MeasureResult:
    """Run ``plan`` for real on the local CUDA GPU (see the module docstring)."""
    import time

    require_cuda()
    import torch

    from oomdoctor.plan import validate

    plan = validate(plan)
    if plan.strategy != "single" and (plan.world_size > 1 or plan.strategy != "fsdp" or model_path is not None):
        raise BadInput(
            f"--engine measure runs one process on this GPU; {plan.label()} needs "
            f"{plan.world_size} rank(s) of {plan.strategy}",
            "use --engine simulate (one rank replayed)",
        )
    t0 = time.perf_counter()
    gpu_before = _gpu_info()
    torch.manual_seed(seed)
    torch.cuda.init()
    with _one_rank_group(plan):
        return _measure(spec, plan, model_path, steps, t0, gpu_before, seed)


def _one_rank_group(plan: "Plan"):
    """A one-rank NCCL process group for an FSDP plan (a null context otherwise), destroyed on exit."""
    import contextlib
    import tempfile

    import torch.distributed as dist

    if plan.strategy != "fsdp" or dist.is_initialized():
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def group():
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group("nccl", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
            try:
                yield
            finally:
                dist.destroy_process_group()

    return group()


def _measure(spec, plan, model_path, steps: int, t0: float, gpu_before: dict, seed: int = 0) -> MeasureResult:
    import time

    import torch

    from oomdoctor.engines.replay import run_steps
    from oomdoctor.execute.build import build_model, make_batch
    from oomdoctor.execute.step import PHASES
    from oomdoctor.execute.tracking import LiveBytes

    if model_path is not None:
        model, head = _load_local(plan, model_path)
    elif plan.strategy == "fsdp":
        from oomdoctor.engines.simulate import random_sharded_model

        built = random_sharded_model(spec, plan, "cuda")
        model, head = built.model, built.head_module
    else:
        if plan.quant is not None:
            built = build_model(spec, plan, device="meta", real_quant_device="cuda", seed=seed)
        else:
            built = build_model(spec, plan, device="cuda", seed=seed)
        model, head = built.model, built.head_module
    batch = make_batch(spec, plan, "cuda", fake_ok=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    lb = LiveBytes(round_to=ALLOC_BLOCK, param_copy_category="master_weights", device_type="cuda")
    if plan.quant is not None:
        from oomdoctor.execute.bnb_standin import quant_state_tensors

        lb.track_existing(quant_state_tensors(model), "parameters")
    step_max: list[int] = []

    def on_step(_i):
        torch.cuda.synchronize()
        step_max.append(int(torch.cuda.max_memory_allocated()))

    stats = run_steps(model, plan, batch, lb, steps=steps, target="gpu", head=head, on_step=on_step)
    torch.cuda.synchronize()
    max_alloc = int(torch.cuda.max_memory_allocated())
    max_res = int(torch.cuda.max_memory_reserved())
    nvml_used = process_bytes()
    cats = dict(stats.peak_categories)
    unexplained = max_alloc - sum(cats.values())
    if unexplained > 0:
        cats["temporaries"] += unexplained
    paged = 0  # unified memory shows in NVML's process usage, not in the allocator
    ctx = max((nvml_used or 0) - int(torch.cuda.memory_reserved()), 0) if nvml_used else 0
    notes = [
        f"measured on {gpu_before.get('name', 'CUDA GPU')}: max_memory_allocated {max_alloc}, "
        f"max_memory_reserved {max_res}, NVML process usage {nvml_used}"
    ]
    if gpu_before.get("used_by_others_bytes"):
        notes.append(f"other processes held {gpu_before['used_by_others_bytes']} bytes on the device")
    if unexplained > 0:
        notes.append(f"{unexplained} allocator bytes not held by any tracked tensor (cuBLAS workspace, kernels)")
    bd = MemoryBreakdown(
        **{c: cats[c] for c in TENSOR_COMPONENTS},
        adapters=min(stats.adapter_bytes, cats["parameters"]),
        allocator_slack=max_res - max_alloc,
        cuda_context=ctx,
        cublas_workspace=0,
        paged_optimizer=paged,
        cpu_offloaded=stats.external.get("cpu_offloaded", 0),
        peak_allocated=max_alloc,
        peak_reserved=max_res,
        peak_device=max(nvml_used or 0, max_res),
        peak_phase=stats.peak_phase,
        phases={ph: int(stats.phase_peaks.get(ph, 0)) for ph in PHASES},
        engine="measure",
        notes=tuple(notes),
    )
    if unexplained < 0:  # LiveBytes rounding above the allocator's: keep the sum invariant
        bd = _rebalance(bd, max_alloc)
    res = MeasureResult(
        breakdown=bd,
        max_allocated=max_alloc,
        max_reserved=max_res,
        nvml_process_used=nvml_used,
        tracked_peak=stats.peak,
        step_max_allocated=step_max,
        gpu=gpu_before,
        seconds=time.perf_counter() - t0,
    )
    del model, batch, lb
    torch.cuda.empty_cache()
    return res


def _rebalance(bd: MemoryBreakdown, total: int) -> MemoryBreakdown:
    from dataclasses import replace

    excess = bd.tensor_sum() - total
    changes = {}
    for c in ("temporaries", "activations", "logits", "master_weights"):
        if excess <= 0:
            break
        take = min(getattr(bd, c), excess)
        changes[c] = getattr(bd, c) - take
        excess -= take
    return replace(bd, **changes)


def _load_local(plan, path: str):
    """Local weights, loaded and prepared as ``oomdoctor train`` loads them (``oomdoctor.execute.load``)."""
    import torch

    from oomdoctor.execute.load import ModelSource, load_model

    model = load_model(ModelSource(path=path), plan, torch.device("cuda")).model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model, base.get_output_embeddings()


def estimate_measured(spec: "ModelSpec", plan: "Plan", *, model_path: str | None = None) -> MemoryBreakdown:
    """Entry point of ``oomdoctor.memory.estimate(spec, plan, "measure")``; raises NoGPU without CUDA."""
    return measure_plan(spec, plan, model_path=model_path).breakdown


__all__ = ["estimate_measured", "measure_plan", "MeasureResult", "require_cuda", "cuda_available", "NO_GPU_MESSAGE"]
