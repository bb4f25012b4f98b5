"""The OOM guard inside Hugging Face ``Trainer`` and TRL ``SFTTrainer``: split the micro-batch on OOM, lose no step.

``auto_find_batch_size`` restarts the training loop with a smaller batch and so changes the effective batch (and the
optimizer trajectory). This guard instead works inside ``training_step``, the per-micro-batch forward+backward:

- On an out-of-memory error (:func:`oomdoctor.execute.oom.is_oom`) it frees the failed attempt's memory and runs the
  micro-batch again as halves (recursively, down to one row; the package's one halve-and-retry loop,
  :meth:`oomdoctor.execute.oom.OOMGuard.run_rows`), each half with the *same* ``num_items_in_batch``.
  With ``num_items_in_batch`` (the transformers default for causal LMs: the loss is ``sum(token losses) /
  num_items_in_batch``, the token count of the whole optimizer step) the halves' gradients add up to the unsplit
  one: same gradient, same effective batch, same optimizer step. When the loss is instead a per-micro-batch mean
  (``loss_is_scaled_for_ga`` false, e.g. a model without ``**kwargs`` in ``forward``), each half's loss is weighted
  by its share of the micro-batch's target tokens (``labels != -100``, shifted for causal LMs; its share of rows when
  it has no labels), which is exact for token-mean losses.
- An OOM after some gradient of the failing micro-batch landed (mid-backward; seen by post-accumulate-grad hooks, as
  in :mod:`oomdoctor.execute.oom`) cannot be subtracted exactly: the step's gradients are zeroed and the micro-batches
  of the current optimizer step that already ran are replayed (their inputs are kept, a few KiB of token ids) at the
  smaller size, then the failing one. The losses the loop already counted are not returned again.
- The smaller size is remembered: later micro-batches are run in pieces of that many rows from the start. Each
  recovery is logged (logger ``oomdoctor.hf``) and kept in ``trainer.oom_guard.recoveries``; the Trainer's logs get
  ``oom_recoveries`` and ``oom_micro_batch``.
- If one row still does not fit, :class:`oomdoctor.execute.oom.OOMAtMicroBatchOne` is raised with what to change.

Side effects of a failed attempt on the trainer are undone: TRL's ``SFTTrainer`` appends entropy / token-accuracy
metrics and counts ``num_tokens`` inside ``compute_loss``; the guard restores ``_metrics`` and
``_total_train_tokens`` to their value before the attempt (before the step, on a replay). Split halves append their
own metric entries (TRL averages per entry, as it does over accumulation micro-batches).

Scope: one process, one device (the memory-limited case). Under DDP / FSDP / DeepSpeed / ``n_gpu > 1`` a split on
one rank would desynchronise the collective ops, so the guard steps aside and calls the Trainer's own
``training_step``. Packed / padding-free batches are a single row and cannot be split.

Use ``GuardedTrainer`` / ``GuardedSFTTrainer`` in place of ``Trainer`` / ``SFTTrainer``, mix
:class:`OOMGuardMixin` into your own subclass (first in the bases), or call :func:`guard_trainer` on a built trainer.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer

from oomdoctor.execute.oom import GradTouch, OOMAtMicroBatchOne, OOMGuard, Recovery, Replay

logger = logging.getLogger("oomdoctor.hf")


# ---------------------------------------------------------------------------------------------- batch slicing
def batch_rows(inputs: dict[str, Any]) -> int:
    """Rows of a micro-batch: the first dimension of ``input_ids`` (else of the first tensor with one)."""
    if isinstance(inputs.get("input_ids"), torch.Tensor) and inputs["input_ids"].dim() >= 1:
        return int(inputs["input_ids"].shape[0])
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    raise ValueError(f"cannot find the batch dimension of the inputs (keys: {', '.join(inputs)})")


def slice_rows(inputs: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``start:stop`` of a micro-batch: every tensor / list / tuple whose first dimension is the batch's is sliced
    (views, no copy); anything else (flags such as ``use_cache``, scalars) is passed as is."""
    n = batch_rows(inputs)
    out: dict[str, Any] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n:
            out[k] = v[start:stop]
        elif isinstance(v, (list, tuple)) and len(v) == n:
            out[k] = v[start:stop]
        else:
            out[k] = v
    return out


def target_tokens(inputs: dict[str, Any], shifted: bool) -> int | None:
    """Target tokens of a micro-batch, counted as transformers counts ``num_items_in_batch``: ``shift_labels`` if
    present, else ``labels[..., 1:]`` for a causal-LM loss (``shifted``), else ``labels``; None without labels."""
    if isinstance(inputs.get("shift_labels"), torch.Tensor):
        labels = inputs["shift_labels"]
    elif isinstance(inputs.get("labels"), torch.Tensor):
        labels = inputs["labels"][..., 1:] if shifted else inputs["labels"]
    else:
        return None
    return int(labels.ne(-100).sum())


# ---------------------------------------------------------------------------------------------- guard state
@dataclass
class _SideEffects:
    """Trainer attributes that ``compute_loss`` mutates (TRL's metric lists and token count), saved to be restored."""

    metrics: dict[str, dict[str, list]] | None
    """Copy of ``trainer._metrics`` (mode -> metric -> values), None when the trainer has none."""
    total_train_tokens: Any
    """``trainer._total_train_tokens`` (None when the trainer has none)."""


def _save_side_effects(trainer: Trainer) -> _SideEffects:
    metrics = getattr(trainer, "_metrics", None)
    copied = None
    if isinstance(metrics, dict):
        copied = {mode: {k: list(v) for k, v in per.items()} for mode, per in metrics.items()}
    return _SideEffects(metrics=copied, total_train_tokens=getattr(trainer, "_total_train_tokens", None))


def _restore_side_effects(trainer: Trainer, saved: _SideEffects) -> None:
    if saved.metrics is not None:
        for mode, per in trainer._metrics.items():
            kept = saved.metrics.get(mode, {})
            for k in list(per):
                if k in kept:
                    per[k][:] = kept[k]
                else:
                    per[k].clear()
    if saved.total_train_tokens is not None:
        trainer._total_train_tokens = saved.total_train_tokens


@dataclass
class OOMGuardState(OOMGuard):
    """The guard (:class:`oomdoctor.execute.oom.OOMGuard`: ``micro_batch``, ``recoveries``) and what it remembers
    across ``training_step`` calls (``trainer.oom_guard``)."""

    micro_batch: int | None = None
    """Rows per forward+backward since the last recovery; None: the micro-batch the Trainer hands over, unsplit."""
    max_retries: int | None = None
    """No cap: halving bounds the recoveries (each one shrinks ``micro_batch``)."""
    touch: GradTouch = field(default_factory=GradTouch)
    """Set when a gradient lands (post-accumulate-grad hooks) / when the attempt's forward has returned."""
    hooked: set[int] = field(default_factory=set)
    """``id`` of the parameters that carry the guard's post-accumulate-grad hook."""
    step: int = -1
    """``global_step`` of the optimizer step whose micro-batches ``done`` holds."""
    done: list[tuple[dict, Any]] = field(default_factory=list)
    """(inputs, num_items_in_batch) of the micro-batches of the current optimizer step that already ran."""
    step_start: _SideEffects | None = None
    """The trainer's side-effect attributes before the current optimizer step's first micro-batch."""
    weight: float = 1.0
    """Factor ``compute_loss`` applies to the loss of the running piece (1 unless a per-micro-batch mean is split)."""


def _log_recovery(rec: Recovery) -> None:
    logger.warning(
        "OOM at step %d (%s) with %d rows: continuing at %d rows per forward/backward, same effective batch%s",
        rec.step,
        rec.phase,
        rec.failed_micro_batch,
        rec.new_micro_batch,
        "; replaying this step's micro-batches (a partial gradient had landed)" if rec.replayed else "",
    )


def _advice(exc: OOMAtMicroBatchOne, step: int) -> OOMAtMicroBatchOne:
    """The guard's give-up (one row does not fit) with what to change."""
    return OOMAtMicroBatchOne(
        f"out of memory at micro-batch 1 (optimizer step {step}, {exc.phase}): a single row does not fit even "
        f"after splitting. Shorten the sequences (max_length), enable gradient_checkpointing, train an "
        f"adapter (LoRA/QLoRA) or use a larger GPU; `oomdoctor diagnose` prices each option.\n"
        f"original error: {exc.message.splitlines()[0] if exc.message else 'out of memory'}",
        exc.phase,
        exc.reason,
    )


# ---------------------------------------------------------------------------------------------- the mixin
class OOMGuardMixin:
    """Mix into a ``Trainer`` subclass, first in the bases: ``class T(OOMGuardMixin, Trainer)``."""

    @property
    def oom_guard(self) -> OOMGuardState:
        state = self.__dict__.get("_oom_guard_state")
        if state is None:
            state = self.__dict__["_oom_guard_state"] = OOMGuardState(on_recovery=_log_recovery)
        return state

    # -- Trainer hooks -------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        g = self.oom_guard
        g.step, g.done = -1, []  # global_step restarts at 0 (or a checkpoint's step): no step of a former run
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._oom_guard_applies():
            return super().training_step(model, inputs, num_items_in_batch)
        g = self.oom_guard
        self._hook_gradients(model)
        if g.step != self.state.global_step:
            g.step, g.done, g.step_start = self.state.global_step, [], _save_side_effects(self)
        replay = False
        while True:
            try:
                if replay:
                    for earlier, items in g.done:
                        self._guarded_batch(model, earlier, items)  # their losses were counted already
                loss = self._guarded_batch(model, inputs, num_items_in_batch)
                break
            except Replay:
                model.zero_grad(set_to_none=True)
                _restore_side_effects(self, g.step_start)
                replay = True
        g.done.append((inputs, num_items_in_batch))
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        g = self.oom_guard
        g.touch.in_backward = True  # the forward returned; an OOM from here on is in backward
        if g.weight != 1.0:
            if return_outputs:
                return result[0] * g.weight, result[1]
            return result * g.weight
        return result

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        g = self.oom_guard
        if g.recoveries:
            logs["oom_recoveries"] = len(g.recoveries)
            logs["oom_micro_batch"] = g.micro_batch
        super().log(logs, *args, **kwargs)

    # -- internals -----------------------------------------------------------------------------------------------
    def _oom_guard_applies(self) -> bool:
        """One process on one device: a split on one rank would desynchronise DDP/FSDP/DeepSpeed collectives."""
        acc = self.accelerator
        return acc.num_processes == 1 and acc.distributed_type != DistributedType.DEEPSPEED and self.args.n_gpu <= 1

    def _hook_gradients(self, model) -> None:
        g = self.oom_guard

        def landed(_p) -> None:
            g.touch.touched = True

        for p in model.parameters():
            if p.requires_grad and id(p) not in g.hooked:
                p.register_post_accumulate_grad_hook(landed)
                g.hooked.add(id(p))

    def _loss_is_scaled(self, num_items_in_batch) -> bool:
        """The Trainer's own rule (``training_step``): is the loss normalised over the whole optimizer step?"""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def _piece_weight(self, inputs, a: int, b: int, num_items_in_batch) -> float:
        """Loss factor of rows ``a:b`` so that the pieces' losses add up to the unsplit micro-batch's loss: 1 when the
        loss is normalised over the optimizer step, else the piece's share of target tokens (of rows without
        labels)."""
        n = batch_rows(inputs)
        if (a, b) == (0, n) or self._loss_is_scaled(num_items_in_batch):
            return 1.0
        shifted = getattr(self, "_loss_shifts_labels", True)
        total = target_tokens(inputs, shifted)
        if total:
            return target_tokens(slice_rows(inputs, a, b), shifted) / total
        return (b - a) / n

    def _guarded_batch(self, model, inputs, num_items_in_batch):
        """Forward+backward of one micro-batch in pieces of at most ``micro_batch`` rows, halving the piece on OOM
        (:meth:`OOMGuard.run_rows`). Returns the micro-batch's loss (detached); raises :class:`Replay` when a partial
        gradient landed."""
        g = self.oom_guard
        step = super().training_step

        def piece(a: int, b: int):
            saved = _save_side_effects(self)
            g.weight = self._piece_weight(inputs, a, b, num_items_in_batch)
            try:
                return step(model, slice_rows(inputs, a, b), num_items_in_batch)
            except BaseException:
                _restore_side_effects(self, saved)  # a failed attempt leaves no metric, no token count
                raise
            finally:
                g.weight = 1.0

        try:
            losses = g.run_rows(self.state.global_step + 1, batch_rows(inputs), piece, g.touch)
        except OOMAtMicroBatchOne as exc:
            raise _advice(exc, self.state.global_step + 1) from None
        return functools.reduce(operator.add, losses)


# ---------------------------------------------------------------------------------------------- ready-made classes
@functools.cache
def guarded_class(trainer_cls: type) -> type:
    """``trainer_cls`` with the guard mixed in first (cached: one class per trainer class)."""
    if issubclass(trainer_cls, OOMGuardMixin):
        return trainer_cls
    return type(
        f"Guarded{trainer_cls.__name__}",
        (OOMGuardMixin, trainer_cls),
        {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} with the oomdoctor OOM guard."},
    )


def guard_trainer(trainer: Trainer) -> Trainer:
    """Give an already built trainer (``Trainer``, ``SFTTrainer`` or any subclass) the guard, in place; returns it."""
    trainer.__class__ = guarded_class(type(trainer))
    return trainer


#: ``transformers.Trainer`` with the OOM guard.
GuardedTrainer = guarded_class(Trainer)


def __getattr__(name: str) -> type:
    # GuardedSFTTrainer needs TRL, an optional dependency: built on first access
    if name == "GuardedSFTTrainer":
        from trl import SFTTrainer

        return guarded_class(SFTTrainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# GuardedSFTTrainer is left out: `import *` must not need TRL
__all__ = [
    "OOMGuardMixin",
    "OOMGuardState",
    "GuardedTrainer",
    "guard_trainer",
    "guarded_class",
    "batch_rows",
    "slice_rows",
    "target_tokens",
    "OOMAtMicroBatchOne",
]
