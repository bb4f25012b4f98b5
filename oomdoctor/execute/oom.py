"""The OOM guard: run one optimizer step's samples in micro-batches, splitting a micro-batch that runs out of memory.

Contract (what the tests check): the optimizer step sees the same samples and the same gradient as without OOM.

- The loss is **token-weighted over the whole optimizer step**: every micro-batch returns
  ``sum(token losses) / N`` where ``N`` is the number of target tokens of *all* the step's samples (transformers'
  ``num_items_in_batch``). Splitting a micro-batch into halves therefore changes nothing but float rounding: the
  halves' gradients add up to the whole's. (Averaging per micro-batch and dividing by the accumulation count —
  sample-weighted — would change the gradient whenever the halves hold different token counts.)
- An OOM **before any gradient was accumulated** by the failing micro-batch (forward, or backward before the first
  parameter's gradient landed) leaves the accumulated gradients of the earlier micro-batches intact: the failing
  micro-batch is split in two and both halves run.
- An OOM **after some gradients of the failing micro-batch were accumulated** (mid-backward) leaves a partial
  gradient that cannot be subtracted exactly: the step's gradients are zeroed and the step's micro-batches are
  replayed from the first, at the smaller size (same data, same result; costs the recompute).
- The smaller micro-batch is remembered for later steps (accumulation grows so the effective batch stays).
- Retries are capped (``max_retries`` recoveries per run); if a micro-batch of 1 sample still runs out of memory,
  :class:`OOMAtMicroBatchOne` is raised (the trainer saves a checkpoint and exits 4 with a diagnosis).

Freeing: the exception's traceback holds the frames (and so the activations and autograd graph) of the failed
attempt; the handler drops it, runs ``gc.collect()`` and ``torch.cuda.empty_cache()`` before retrying.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable

import torch


def is_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a RuntimeError carrying an out-of-memory message (cuBLAS/cuDNN/CPU allocator
    report OOM as plain RuntimeError; accelerate's ``should_reduce_batch_size`` matches the same texts)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc)
        return any(s in msg for s in ("out of memory", "CUDNN_STATUS_NOT_SUPPORTED",
                                      "DefaultCPUAllocator: can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED"))
    return False


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OOMAtMicroBatchOne(Exception):
    """A single sample does not fit (or the retry cap was reached)."""

    def __init__(self, message: str, phase: str, reason: str):
        super().__init__(message)
        self.message, self.phase, self.reason = message, phase, reason


@dataclass
class Recovery:
    """One recovered OOM."""

    step: int
    """Optimizer step (1-based) during which it happened."""
    failed_micro_batch: int
    new_micro_batch: int
    phase: str
    """``forward`` or ``backward``."""
    replayed: bool
    """True when the step's earlier micro-batches were replayed (partial gradients had been accumulated)."""
    message: str

    def to_dict(self) -> dict:
        return {"step": self.step, "failed_micro_batch": self.failed_micro_batch,
                "new_micro_batch": self.new_micro_batch, "phase": self.phase, "replayed": self.replayed,
                "message": self.message.splitlines()[0][:300]}


@dataclass
class GradTouch:
    """Set by post-accumulate-grad hooks when a gradient lands during the current attempt."""

    touched: bool = False
    in_backward: bool = False


@dataclass
class OOMGuard:
    """Runs a step's samples in micro-batches of at most ``micro_batch`` samples, recovering from OOM."""

    micro_batch: int
    max_retries: int = 8
    recoveries: list[Recovery] = field(default_factory=list)
    on_recovery: Callable[[Recovery], None] | None = None

    def run_step(self, step: int, samples: list, run_chunk: Callable[[list], float], zero_grads: Callable[[], None],
                 touch: GradTouch) -> tuple[float, int]:
        """Forward+backward every sample of the step; returns (loss of the step, micro-batches run)."""
        pos, loss, chunks = 0, 0.0, 0
        while pos < len(samples):
            chunk = samples[pos: pos + self.micro_batch]
            touch.touched = False
            touch.in_backward = False
            failure: str | None = None
            try:
                loss += run_chunk(chunk)
                chunks += 1
                pos += len(chunk)
                continue
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not is_oom(exc):
                    raise
                failure = str(exc)
            # the exception (and with it the failed attempt's frames and tensors) is released here
            free_memory()
            phase = "backward" if touch.in_backward else "forward"
            n = len(chunk)
            if n <= 1 or len(self.recoveries) >= self.max_retries:
                reason = "micro-batch 1" if n <= 1 else f"retry cap ({self.max_retries}) reached"
                raise OOMAtMicroBatchOne(failure or "out of memory", phase, reason)
            new = (n + 1) // 2
            replay = touch.touched
            rec = Recovery(step=step, failed_micro_batch=n, new_micro_batch=new, phase=phase, replayed=replay,
                           message=failure or "")
            self.recoveries.append(rec)
            self.micro_batch = min(self.micro_batch, new)
            if replay:
                zero_grads()
                pos, loss, chunks = 0, 0.0, 0
            if self.on_recovery:
                self.on_recovery(rec)
        return loss, chunks


__all__ = ["OOMGuard", "OOMAtMicroBatchOne", "Recovery", "GradTouch", "is_oom", "free_memory"]
