"""DeepSpeed ZeRO-2/3 (the optional ``oomdoctor[deepspeed]`` extra): the one plan -> DeepSpeed config function
(``tune --emit hf|accelerate`` writes it with HF's ``auto`` values, ``train`` runs it with concrete ones), and the
engine ``train`` steps through.

Recipes and pitfalls measured in multi-gpu.md §3 and §7.4 (DeepSpeed 0.19.8, torch 2.13, CPU/gloo under torchrun):

- Buckets always explicit: DeepSpeed's default 5e8-element reduce/all-gather buckets cost ~1 GB bf16 per rank (§3).
  ``Plan.bucket_elems``: ``bucket_size`` or hidden² (Hugging Face's ``auto``, what the memory model prices).
- ``train`` keeps the torch optimizer of ``oomdoctor.execute.optim`` (DeepSpeed wraps it); with an offloaded
  optimizer ``zero_force_ds_cpu_optimizer: false`` keeps it instead of a JIT-compiled DeepSpeedCPUAdam (~95 s).
- ``managed_gradient_accumulation: false``: ``engine.backward`` only accumulates (stage 2/3 reduce-scatter every
  backward) and ``engine.step()`` is the optimizer step, so the OOM guard may run any number of micro-batches per
  step; ``backward(scale_wrt_gas=False)``: the loss is already divided by the step's global target count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomdoctor.errors import BadInput

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.plan import Plan


@dataclass(frozen=True)
class ZeroRun:
    """The values ``train`` fills where an emitted config says ``auto`` (HF Trainer fills them there)."""

    micro_batch: int
    """``train_micro_batch_size_per_gpu``."""
    grad_accum: int
    """``gradient_accumulation_steps`` (only bookkeeping: the loop decides the step, see the module docstring)."""
    max_grad_norm: float | None
    """``gradient_clipping`` (0: none)."""
    device_type: str
    """``cuda`` pins offloaded host memory; on a CPU-only host pinning needs an accelerator and fails (§1)."""


def zero_config(plan: "Plan", hidden_size: int, run: ZeroRun | None = None) -> dict[str, Any]:
    """The DeepSpeed config of the plan's ZeRO stage with explicit buckets. Without ``run`` (an emitted config):
    batch, precision and clipping ``auto``, offload memory pinned (GPUs). With ``run`` (``train``): concrete values,
    bf16 for ``bf16``/``bf16-mixed`` (DeepSpeed's bf16: bf16 weights, fp32 master weights and optimizer states),
    fp32 otherwise (``train`` refuses fp16), the caller's optimizer kept."""
    b = plan.bucket_elems(hidden_size)
    pin = run is None or run.device_type == "cuda"
    zero: dict[str, Any] = {
        "stage": 3 if plan.strategy == "zero3" else 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": b,
        "allgather_bucket_size": b,
    }
    if plan.strategy == "zero3":
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * b),
            stage3_param_persistence_threshold=10 * hidden_size,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if plan.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if plan.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if run is None:
        return {
            "zero_optimization": zero,
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision in ("bf16", "bf16-mixed")},
        "train_micro_batch_size_per_gpu": run.micro_batch,
        "gradient_accumulation_steps": run.grad_accum,
        "gradient_clipping": float(run.max_grad_norm or 0.0),
        "managed_gradient_accumulation": False,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def require_deepspeed() -> Any:
    """The ``deepspeed`` module, or BadInput (one message) when the extra is not installed."""
    try:
        import deepspeed
    except ImportError as exc:
        raise BadInput(
            f"strategy zero2/zero3 runs DeepSpeed, which is not importable ({exc})",
            "pip install 'oomdoctor[deepspeed]' (or use strategy fsdp, torch's own sharding)",
        ) from None
    return deepspeed


def initialize(model: Any, optimizer: Any, config: dict[str, Any]) -> Any:
    """``deepspeed.initialize`` on the process group ``oomdoctor.execute.dist`` made; returns the engine. ZeRO-3
    partitions the already-built model (rank 0's weights are broadcast first, as DDP does), so no ``zero.Init``:
    each rank briefly holds the whole model while loading."""
    import contextlib
    import io
    import logging
    import os

    deepspeed = require_deepspeed()
    os.environ.setdefault("LOCAL_RANK", "0")  # one process without torchrun: DeepSpeed asserts it is set
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed prints "... shm_comm_op built successfully" on stdout (JIT-built once, ~45 s, then cached in
    # ~/.cache/torch_extensions; §3): stdout is train's --json output
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


class EngineOptimizer:
    """The optimizer interface :class:`oomdoctor.execute.step.TrainStep` drives, over a DeepSpeed engine:
    ``step()`` is ``engine.step()`` (clipping from the config, the step, zeroing the gradients)."""

    def __init__(self, engine: Any):
        self.engine = engine

    @property
    def param_groups(self) -> list:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The wrapped torch optimizer's state (this rank's partitions; what the memory meter tracks)."""
        return getattr(self.engine.optimizer, "optimizer", self.engine.optimizer).state

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # torch protocol
        """Nothing: ``engine.step()`` zeroed them (and a ZeRO rank never replays a step in-process)."""


def full_state_dict(engine: Any, stage: int) -> dict | None:
    """Collective: what rank 0 passes to ``save_pretrained(state_dict=...)``; None: the module's own weights, whole
    on every ZeRO-2 rank (updated after each step). ZeRO-3 gathers the partitions (``_zero3_consolidated_16bit_state_dict``: the
    module's own dtype, fp32 for an fp32 run)."""
    import torch.distributed as tdist

    if stage == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()  # what save_16bit_model uses
        return {k: v.cpu() for k, v in sd.items()} if tdist.get_rank() == 0 else None
    return None


__all__ = ["EngineOptimizer", "ZeroRun", "full_state_dict", "initialize", "require_deepspeed", "zero_config"]
