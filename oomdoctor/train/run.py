"""What a set-up run holds (:class:`Run`, built by :func:`oomdoctor.train.setup.setup`) and what its ranks agree on.

Everything the loop, the checkpoints, the outputs and the OOM path read about a run lives here, typed: the config,
the device, the data, the plan and its prediction, the model, the step, the schedule and the meter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomdoctor.execute import dist
from oomdoctor.plan import Plan
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.train.config import TrainConfig

#: A progress event for the CLI (``{"type": "step" | "info" | "oom" | ..., ...}``).
Event = Callable[[dict], None]


@dataclass
class Run:
    """Everything a run set up before its first step."""

    cfg: TrainConfig
    """The config as this job runs it (topology resolved, ``output_dir`` expanded)."""
    device: Any
    """torch device the run trains on."""
    cap: int | None
    """Capacity enforced on the process (``--gpu-mem`` / ``gpu_mem``), None when uncapped."""
    data: Any
    """Tokenized samples (``oomdoctor.train.data.TokenizedData``)."""
    effective_batch: int
    """Samples per optimizer step."""
    plan: Plan
    """The plan priced and run."""
    memory: dict | None
    """Predicted breakdown (diagnose's keys), None when it could not be priced."""
    loaded: Any
    """``oomdoctor.execute.load.LoadedModel``."""
    step: Any
    """``oomdoctor.execute.step.TrainStep`` (model, optimizer, scaler)."""
    scheduler: Any
    """LR scheduler."""
    order: Any
    """``oomdoctor.train.data.SampleOrder``: seeded, a function of the data position (a resume continues it)."""
    dist: Any = None
    """``oomdoctor.execute.dist.DistInfo``: this process's rank in a torchrun job (world size 1 alone)."""
    total_steps: int = 1
    """Optimizer steps of the run: ``max_steps``, else ``ceil(num_train_epochs x samples / effective batch)``."""
    eval_samples: list = field(default_factory=list)
    """Held-back / separate eval samples (empty: no eval)."""
    tokenizer: Any = None
    """The tokenizer (saved next to the final model)."""
    meter: Any = None
    """CPU: the LiveBytes meter — on for the whole run with a cap, else for the first
    :data:`oomdoctor.train.loop.METER_STEPS` steps; CUDA: None (the allocator's statistics)."""
    notes: list[str] = field(default_factory=list)
    """What the run has to say besides its figures (truncated samples, skipped updates, ...; in the summary)."""
    command: str = "oomdoctor train CONFIG"
    """How the user started the run (named in hints)."""

    @property
    def sharded(self) -> bool:
        """FSDP2: sharded model, DCP checkpoints."""
        return self.plan.strategy == "fsdp"

    @property
    def zero(self) -> bool:
        """DeepSpeed ZeRO-2/3: ``step.model`` is the engine, ``oomdoctor.execute.zero``."""
        return self.plan.strategy in DEEPSPEED

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine of a ZeRO run (None otherwise)."""
        return self.step.model if self.zero else None

    @property
    def averages_grads(self) -> bool:
        """FSDP2 and DeepSpeed average the gradients over the ranks in backward (DDP here sums them after it)."""
        return self.sharded or self.zero

    @property
    def restarts_on_oom(self) -> bool:
        """FSDP2 / ZeRO on several ranks: an OOM restarts the job (one rank alone splits the micro-batch in-process;
        a ZeRO rank alone cannot undo DeepSpeed's partial gradients, so its OOM is not recovered)."""
        return self.averages_grads and self.dist.enabled

    @property
    def rank_batch(self) -> int:
        """Samples each process runs per optimizer step (the effective batch over the world size)."""
        return self.effective_batch // self.dist.world_size if self.dist else self.effective_batch

    def peak_bytes(self) -> int:
        """Peak live tensor bytes so far (CUDA: ``max_memory_allocated``; CPU: the meter's, 0 without one)."""
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self.meter.peak) if self.meter is not None else 0

    def epoch(self, samples_seen: int) -> float:
        """Passes over the training data after ``samples_seen`` samples (HF's ``epoch``)."""
        return round(samples_seen / max(1, len(self.data)), 4)

    def checkpoint_bytes(self) -> int:
        """About one checkpoint on disk: the saved weights (all of them, or the adapters) and fp32 optimizer state."""
        trainable = sum(p.numel() for p in self.loaded.trainable)
        weights = (
            trainable * 4
            if self.loaded.is_peft
            else sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())
        )
        return weights + 2 * 4 * trainable


def any_rank(flag: bool, info: Any) -> bool:
    """Whether ``flag`` holds on any rank of the job (a tiny all-reduce; the flag itself alone)."""
    if info is None or not info.enabled:
        return flag
    import torch

    return int(dist.all_reduce_sum(torch.tensor(int(flag)), info)) > 0


__all__ = ["Run", "Event", "any_rank"]
