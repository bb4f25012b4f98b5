"""How big a run is before it starts: its budget, its micro-batch, its predicted memory, its steps, its host RAM.

The same rules the dry run applies (``oomdoctor.train.dryrun``): the budget is ``oomdoctor.plan.budget``'s, the
prediction is the engines' (``oomdoctor.engines.estimate``) of ``cfg.to_plan``, and ``micro_batch_size: auto`` is
the largest micro-batch that prediction fits.
"""

from __future__ import annotations

import math
import os

from oomdoctor.errors import BadInput
from oomdoctor.gpu import detect_gpu
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import DEFAULT_MICRO_LIMIT, choose_micro_batch, max_fitting
from oomdoctor.plan.budget import Budget, resolve_budget
from oomdoctor.train.config import TrainConfig
from oomdoctor.units import format_bytes


def predict_memory(cfg: TrainConfig, micro_batch: int, engine: str = "analytic", device: str = "cuda"):
    """(spec, plan, MemoryBreakdown or None, note) for the config at ``micro_batch`` on ``device``."""
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec

    spec = load_spec(cfg.model_ref)
    plan = cfg.to_plan(micro_batch=micro_batch)
    try:
        return spec, plan, estimate(spec, plan, engine, device), None
    except (ImportError, ModuleNotFoundError) as exc:
        return spec, plan, None, f"memory engine {engine!r} unavailable: {exc}"


def predict_for_run(
    cfg: TrainConfig, micro: int, engine: str, notes: list[str], device: str
) -> tuple[Plan, dict | None]:
    """The plan at ``micro`` and its predicted breakdown on ``device`` (never stops a run: failures become notes)."""
    plan = cfg.to_plan(micro_batch=micro)
    try:
        _, _, mem, note = predict_memory(cfg, micro, engine, device)
        if note:
            notes.append(note)
        return plan, (mem.to_dict() if mem is not None else None)
    except Exception as exc:  # noqa: BLE001 - the prediction must never stop a training run
        notes.append(f"memory prediction failed: {type(exc).__name__}: {exc}")
        return plan, None


def run_budget(cfg: TrainConfig, gpu_mem: int | None, *, on_cpu: bool) -> Budget | None:
    """The budget of a run and of its dry run (``oomdoctor.plan.budget``, the rule every verb uses): ``--gpu-mem``,
    else the config's ``gpu_mem``, else the GPU's free memory (NVML; not for a CPU run), else None. On the CPU the
    capacity caps live tensor bytes, so the rule counts ``peak_allocated``."""
    if gpu_mem is not None:
        return resolve_budget(gpu_mem, None, None, on_cpu=on_cpu)
    if cfg.gpu_mem is not None:
        return resolve_budget(cfg.gpu_mem, None, None, gpu_mem_source="config gpu_mem", on_cpu=on_cpu)
    return None if on_cpu else resolve_budget(None, None, detect_gpu())


def auto_micro_batch(cfg: TrainConfig, budget: Budget | None, engine: str = "analytic", device: str = "cuda") -> int:
    """``micro_batch_size: auto``: the largest micro-batch whose predicted memory on ``device`` fits ``budget``
    (``Budget.fits``, priced as the dry run prices the config: ``cfg.to_plan(micro_batch=b)``, accumulation
    included), by :func:`oomdoctor.plan.batch.max_fitting`; with a ``global_batch_size`` the largest divisor of it,
    so the effective batch stays exact."""
    from oomdoctor.engines import estimate
    from oomdoctor.errors import DoesNotFit
    from oomdoctor.model.load import load_spec

    if budget is None:
        raise BadInput(
            "micro_batch_size: auto needs a memory budget",
            "pass --gpu-mem SIZE (or gpu_mem: in the config), or run on a GPU",
        )
    spec = load_spec(cfg.model_ref)
    gbs = cfg.global_batch_size
    cache: dict[int, int] = {}

    def needed(b: int) -> int:
        if b not in cache:
            cache[b] = budget.needed(estimate(spec, cfg.to_plan(micro_batch=b), engine, device))
        return cache[b]

    upper = min(DEFAULT_MICRO_LIMIT, gbs) if gbs else DEFAULT_MICRO_LIMIT
    best = max_fitting(lambda b: needed(b) <= budget.limit_bytes, upper)
    if best < 1:
        cap = format_bytes(budget.capacity_bytes, binary=False).replace(" ", "")
        raise DoesNotFit(
            f"micro_batch_size: auto: not even micro-batch 1 fits {budget.describe()} (predicted "
            f"{format_bytes(needed(1))})",
            f"run `oomdoctor train CONFIG --dry-run --gpu-mem {cap}` for the changes that fit",
        )
    return choose_micro_batch(best, gbs).micro_batch


def total_steps(cfg: TrainConfig, n_samples: int, effective_batch: int) -> int:
    """Optimizer steps of a run: ``max_steps`` when set (it overrides epochs, as in HF; -1 is HF's unset), else
    enough steps for ``num_train_epochs`` passes over ``n_samples`` (at least one)."""
    if cfg.max_steps not in (None, -1):
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * n_samples / effective_batch))


def check_host_ram(plan: Plan, memory: dict | None, notes: list[str]) -> None:
    """Offloaded states and activations (FSDP2 ``offload_params``, ZeRO offload, ``save_on_cpu``): this node's host
    RAM must hold what its ranks (``LOCAL_WORLD_SIZE``) offload, by the rule tune applies
    (``memory.sharding.node_host_bytes``); checked before the model is loaded."""
    from oomdoctor.errors import DoesNotFit
    from oomdoctor.gpu import host_ram_bytes
    from oomdoctor.memory.sharding import node_host_bytes

    if not (plan.offload_params or plan.offload_optimizer or plan.offload_activations):
        return
    per_node = int((memory or {}).get("host_per_node_bytes") or 0)
    ram = host_ram_bytes()
    if not per_node or ram is None:
        notes.append("offload: host RAM not checked (no prediction of the offloaded bytes)")
        return
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    need = node_host_bytes(per_node, plan, ranks)
    if need > ram:
        raise DoesNotFit(
            f"offload: {ranks} rank(s) on this node offload {format_bytes(need)} > this host's "
            f"{format_bytes(ram)} of RAM",
            "shard over more ranks/nodes, use LoRA, or a host with more memory",
        )


__all__ = ["predict_memory", "predict_for_run", "run_budget", "auto_micro_batch", "total_steps", "check_host_ram"]
