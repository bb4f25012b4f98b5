"""Memory engines behind one entry point.

``estimate(spec, plan, engine=...)``: ``analytic`` (formulas, sub-millisecond, no torch for the families they were
written for; for blocks the formulas do not know, what they save is measured by replaying them once per model and
knobs, seconds to minutes, then cached on disk: ``engines/blocks.py``), ``simulate`` (the real HF step
replayed on fake tensors — for ``trainer: trl|hf`` that trainer's own step, ``engines/trainers.py`` —; for
``world_size`` > 1 one rank: FSDP on a fake process group, DDP as the single step plus its gradient bucket, ZeRO and
parameter offload by the analytic formulas, with a note) and ``measure`` (the real step
on the local CUDA GPU). Multi-GPU numbers are per rank.
"""

from __future__ import annotations

from oomdoctor.memory.breakdown import MemoryBreakdown

ENGINES = ("analytic", "simulate", "measure")


#: Devices a plan is priced for: ``cuda`` (context, cuBLAS workspace, NCCL buffers, caching-allocator slack around
#: the tensors) or ``cpu`` (the tensors alone: ``oomdoctor.memory.runtime``).
DEVICES = ("cuda", "cpu")


def estimate(spec, plan, engine: str = "analytic", device: str = "cuda") -> MemoryBreakdown:
    """Memory breakdown of training ``spec`` with ``plan`` on ``device`` according to ``engine`` (BadInput for LoRA
    targets that adapt nothing, and for ``measure`` off CUDA)."""
    from oomdoctor.errors import BadInput
    from oomdoctor.model.execution import check_plan_for_model

    if device not in DEVICES:
        raise BadInput(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    check_plan_for_model(spec, plan)
    if engine == "analytic":
        from oomdoctor.engines.blocks import block_saves, measures_blocks
        from oomdoctor.memory.analytic import estimate_analytic

        blocks = block_saves(spec, plan) if measures_blocks(spec, plan) else None
        return estimate_analytic(spec, plan, device=device, blocks=blocks)
    if engine == "simulate" and plan.trainer != "oomdoctor":
        from oomdoctor.engines.trainers import estimate_trainer  # the trainer's own step (TRL, HF Trainer)

        return estimate_trainer(spec, plan, device)
    if engine == "simulate":
        from oomdoctor.engines.simulate import estimate_simulated

        return estimate_simulated(spec, plan, device)
    if engine == "measure":
        if device != "cuda":
            raise BadInput(
                "--engine measure runs the step on the local CUDA GPU; a CPU plan cannot be measured there",
                "use --engine analytic or simulate with --device cpu",
            )
        from oomdoctor.engines.measure import estimate_measured

        return estimate_measured(spec, plan)
    raise BadInput(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")


__all__ = ["MemoryBreakdown", "estimate", "ENGINES", "DEVICES"]
