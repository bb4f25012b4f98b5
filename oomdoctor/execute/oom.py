"""The OOM guard: run one optimizer step's samples in micro-batches, splitting a micro-batch that runs out of memory.

The one halve-and-retry loop of the package: ``oomdoctor train`` runs a step's samples through
:meth:`OOMGuard.run_step`; the Hugging Face trainers of :mod:`oomdoctor.hf` run each micro-batch's rows through
:meth:`OOMGuard.run_rows` (and replay the step themselves on :class:`Replay`).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def is_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a RuntimeError carrying an out-of-memory message (cuBLAS/cuDNN/CPU allocator
    report OOM as plain RuntimeError; accelerate's ``should_reduce_batch_size`` matches the same texts)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc)
        return any(
            s in msg
            for s in (
                "out of memory",
                "CUDNN_STATUS_NOT_SUPPORTED",
                "DefaultCPUAllocator: can't allocate memory",
                "CUBLAS_STATUS_ALLOC_FAILED",
            )
        )
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
        return {
            "step": self.step,
            "failed_micro_batch": self.failed_micro_batch,
            "new_micro_batch": self.new_micro_batch,
            "phase": self.phase,
            "replayed": self.replayed,
            "message": self.message.splitlines()[0][:300],
        }


@dataclass
class GradTouch:
    """Set by post-accumulate-grad hooks when a gradient lands during the current attempt."""

    touched: bool = False
    in_backward: bool = False


class Replay(Exception):
    """Raised by :meth:`OOMGuard.run_rows` when a partial gradient of the failed piece landed: the caller zeroes the
    gradients and runs the optimizer step's pieces again from the first (at the smaller size the guard now holds)."""


@dataclass
class OOMGuard:
    """Runs a step's samples in micro-batches of at most ``micro_batch`` samples, recovering from OOM: the one
    halve-and-retry loop of the package (``oomdoctor train`` through :meth:`run_step`, the Hugging Face trainers of
    :mod:`oomdoctor.hf` through :meth:`run_rows`)."""

    micro_batch: int | None
    """Rows per forward+backward; None: whatever a call hands over, unsplit (until the first recovery)."""
    max_retries: int | None = 8
    """Recoveries allowed over the guard's life; None: no cap (halving alone bounds them)."""
    recoveries: list[Recovery] = field(default_factory=list)
    """Every recovered OOM, in order."""
    on_recovery: Callable[[Recovery], None] | None = None
    """Called with each recovery, before the retry (or the :class:`Replay`)."""

    def run_step(
        self,
        step: int,
        samples: list,
        run_chunk: Callable[[list], float],
        zero_grads: Callable[[], None],
        touch: GradTouch,
    ) -> tuple[float, int]:
        """Forward+backward every sample of the step; returns (loss of the step, micro-batches run). A partial
        gradient replays the step's micro-batches from the first after ``zero_grads``."""
        while True:
            try:
                losses = self.run_rows(step, len(samples), lambda a, b: run_chunk(samples[a:b]), touch)
            except Replay:
                zero_grads()
                continue
            return sum(losses, 0.0), len(losses)

    def run_rows(self, step: int, n: int, run_piece: Callable[[int, int], Any], touch: GradTouch) -> list:
        """Rows ``0:n`` in pieces ``run_piece(start, stop)`` of at most ``micro_batch`` rows, halving a piece that runs
        out of memory; returns the pieces' results. Raises :class:`Replay` when the failed piece had accumulated some
        gradient, :class:`OOMAtMicroBatchOne` when one row does not fit or the retry cap is reached."""
        start, results = 0, []
        while start < n:
            stop = min(start + (self.micro_batch or n), n)
            touch.touched = False
            touch.in_backward = False
            failure: str | None = None
            try:
                results.append(run_piece(start, stop))
                start = stop
                continue
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not is_oom(exc):
                    raise
                failure = str(exc)
            # the exception (and with it the failed attempt's frames and tensors) is released here
            free_memory()
            self._recover(step, stop - start, failure or "", touch)
        return results

    def _recover(self, step: int, rows: int, failure: str, touch: GradTouch) -> None:
        """Record the recovery and halve the piece size; raise when nothing is left to split or a gradient landed."""
        phase = "backward" if touch.in_backward else "forward"
        capped = self.max_retries is not None and len(self.recoveries) >= self.max_retries
        if rows <= 1 or capped:
            reason = "micro-batch 1" if rows <= 1 else f"retry cap ({self.max_retries}) reached"
            raise OOMAtMicroBatchOne(failure or "out of memory", phase, reason)
        new = (rows + 1) // 2
        rec = Recovery(
            step=step,
            failed_micro_batch=rows,
            new_micro_batch=new,
            phase=phase,
            replayed=touch.touched,
            message=failure,
        )
        self.recoveries.append(rec)
        self.micro_batch = new if self.micro_batch is None else min(self.micro_batch, new)
        if self.on_recovery:
            self.on_recovery(rec)
        if rec.replayed:
            raise Replay()


__all__ = ["OOMGuard", "Replay", "OOMAtMicroBatchOne", "Recovery", "GradTouch", "is_oom", "free_memory"]
