"""One training step, the way every engine and ``oomdoctor train`` run it.

A step is what ``transformers.Trainer`` (with accelerate) does per optimizer step, for any number of micro-batches:

1. per micro-batch (:meth:`TrainStep.forward_backward`): forward with labels under autocast for ``*-mixed`` plans
   (``loss: chunked``: the decoder, then the LM head and loss chunk by chunk, ``oomdoctor.execute.loss``)
   (``torch.autocast`` on the tensors' device), saved tensors moved to host memory when the plan offloads
   activations; the loss is token-weighted over the whole optimizer step when ``num_items_in_batch`` is given
   (transformers' ``num_items_in_batch``: ``sum(token losses) / N``, so splitting a micro-batch changes nothing but
   rounding), else the mean divided by ``loss_divisor`` (Trainer: ``/ gradient_accumulation_steps``). Under mixed
   precision accelerate's ``convert_outputs_to_fp32`` makes an fp32 copy of the logits; the step makes and drops the
   same copy, so it is priced where HF users pay it. fp16: the loss is scaled (``GradScaler``) before backward.
2. :meth:`TrainStep.optimizer_step`: unscale (fp16), gradient clipping (``clip_grad_norm_``, foreach unless the plan
   says ``for-loop``), optimizer step, ``zero_grad(set_to_none=True)``. Returns False when fp16 found inf/NaN
   gradients and the scaler skipped the update.

:class:`StepHooks` are the instrumentation points: the simulated engine counts memory per phase through them
(``phase`` contexts, ``forward_done``, ``backward_start``/``backward_done``, ``optimizer_stepped``), ``train``'s OOM
guard learns through ``backward_start`` whether gradients may have landed. A step owns no loop: the caller decides
how many micro-batches and steps run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.plan import Plan

#: Phase names, in the order a step runs them.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer-step")
#: The phase of :meth:`TrainStep.eval_loss` (between steps).
EVAL_PHASE = "eval"


class StepHooks:
    """No-op instrumentation; subclasses override what they observe."""

    def phase(self, name: str) -> AbstractContextManager:
        """Context around each phase (``forward``, ``backward``, ``optimizer-step``)."""
        return contextlib.nullcontext()

    def forward_done(self) -> None:
        """After the forward pass and the loss, before backward."""

    def backward_start(self) -> None:
        """Right before ``loss.backward()``."""

    def backward_done(self) -> None:
        """Right after ``loss.backward()``."""

    def optimizer_stepped(self, optimizer: Any, step_index: int) -> None:
        """After ``optimizer.step()`` (``step_index`` 0 = the step that created the optimizer state)."""


class StaticLossScale:
    """``GradScaler``'s interface with a constant scale and no inf check, for replays on tensors without data (the
    simulated engine: fake tensors have no values to check). Allocates what the scale multiply allocates."""

    scale_value: float = 65536.0

    def scale(self, loss):
        return loss * self.scale_value

    def unscale_(self, optimizer) -> None:  # GradScaler protocol
        return None

    def step(self, optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        return None

    def get_scale(self) -> float:
        return self.scale_value


@dataclass
class TrainStep:
    """The step of one model + optimizer under one plan (see the module docstring)."""

    model: Any
    """The torch module (a ``PeftModel`` for LoRA/QLoRA)."""
    optimizer: Any
    """What :func:`oomdoctor.execute.optim.make_optimizer` returned."""
    plan: "Plan"
    """Precision, optimizer implementation and offload settings come from here."""
    device_type: str = "cpu"
    """Where the tensors live: ``cpu`` (real or fake tensors) or ``cuda``; autocast runs there."""
    max_grad_norm: float | None = 1.0
    """Gradient clipping threshold (HF default 1.0); None or 0 disables clipping."""
    scaler: Any = None
    """fp16 loss scaler (``torch.amp.GradScaler`` or :class:`StaticLossScale`); made for ``fp16-mixed`` when None."""
    hooks: StepHooks = field(default_factory=StepHooks)
    """Instrumentation points."""
    offload: Callable[[], AbstractContextManager] | None = None
    """Context for the forward pass that moves saved activations off the device; default
    :func:`oomdoctor.execute.optim.activation_offload` when the plan offloads activations."""
    fp32_outputs: bool = True
    """Mixed precision: make (and drop) accelerate's fp32 copy of the logits, as HF Trainer does."""
    steps_done: int = 0
    """Optimizer steps taken through :meth:`optimizer_step` (including skipped fp16 steps)."""
    clip: Callable[[list, float], Any] | None = None
    """Gradient clipping ``clip(params, max_norm)``; None: ``torch.nn.utils.clip_grad_norm_`` (foreach unless the
    plan says ``for-loop``). Sharded runs pass :func:`oomdoctor.execute.shard.clip_grad_norm`."""
    backward: Callable[[Any], Any] | None = None
    """Backward of a (scaled) loss; None: ``loss.backward()``. DeepSpeed runs pass ``engine.backward``."""

    def __post_init__(self) -> None:
        import torch

        if self.scaler is None and self.plan.precision == "fp16-mixed":
            self.scaler = torch.amp.GradScaler(self.device_type)
        if self.offload is None:
            from oomdoctor.execute.optim import activation_offload

            enabled, dev = self.plan.offload_activations, self.device_type
            self.offload = lambda: activation_offload(enabled, dev)

    # ------------------------------------------------------------------ micro-batch
    def _autocast(self) -> AbstractContextManager:
        import torch

        from oomdoctor.execute.dtypes import autocast_dtype

        amp = autocast_dtype(self.plan)
        if amp is None:
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(self.device_type, dtype=amp)

    def forward_backward(self, batch: dict, *, num_items_in_batch: int | None = None, loss_divisor: int = 1):
        """Forward + backward of one micro-batch; returns the (detached) loss this micro-batch contributed."""
        with self.hooks.phase("forward"):
            kwargs = dict(batch)
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            with self._autocast(), self.offload():
                if self.plan.loss == "chunked":
                    from oomdoctor.execute.loss import chunked_causal_lm_loss

                    loss = chunked_causal_lm_loss(self.model, batch, num_items_in_batch)
                else:
                    out = self.model(**kwargs)
                    loss = out["loss"] if isinstance(out, dict) else out.loss
                    if self.plan.is_mixed and self.fp32_outputs:
                        self._fp32_logits_copy(out)
                    del out
            if loss_divisor > 1:
                loss = loss / loss_divisor
            scaled = self.scaler.scale(loss) if self.scaler is not None else loss
            self.hooks.forward_done()
        with self.hooks.phase("backward"):
            self.hooks.backward_start()
            if self.backward is not None:
                self.backward(scaled)
            else:
                scaled.backward()
            self.hooks.backward_done()
            del scaled
        return loss.detach()

    def eval_loss(self, batch: dict):
        """Forward of one eval micro-batch, no gradients (HF Trainer's ``prediction_step`` with
        ``prediction_loss_only``): the summed token loss, as a tensor (the caller divides by the token count).
        The model is put in eval mode (no dropout) for the call and back in train mode after."""
        import torch

        was_training = self.model.training
        self.model.eval()
        try:
            with self.hooks.phase(EVAL_PHASE), torch.no_grad(), self._autocast():
                if self.plan.loss == "chunked":
                    from oomdoctor.execute.loss import chunked_causal_lm_loss

                    return chunked_causal_lm_loss(self.model, batch, 1).float()
                out = self.model(**batch, num_items_in_batch=1)  # sum over tokens: ForCausalLMLoss divides by 1
                loss = (out["loss"] if isinstance(out, dict) else out.loss).float()
                del out
        finally:
            self.model.train(was_training)
        return loss

    @staticmethod
    def _fp32_logits_copy(out) -> None:
        """accelerate's ``convert_outputs_to_fp32``: every fp16/bf16 output gets an fp32 copy (allocated, dropped)."""
        import torch

        logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", None)
        if logits is not None and logits.dtype in (torch.float16, torch.bfloat16):
            logits.float()

    # ------------------------------------------------------------------ optimizer step
    def clip_params(self) -> list:
        return [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]

    def optimizer_step(self) -> bool:
        """Unscale, clip, step, zero the gradients. Returns False when the fp16 scaler skipped the update."""
        import torch

        with self.hooks.phase("optimizer-step"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.max_grad_norm:
                params = self.clip_params()
                if self.clip is not None:
                    self.clip(params, self.max_grad_norm)
                else:
                    torch.nn.utils.clip_grad_norm_(
                        params, self.max_grad_norm, foreach=self.plan.optimizer_impl != "for-loop"
                    )
                del params
            applied = True
            if self.scaler is not None:
                before = self.scaler.get_scale()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                applied = not (self.scaler.get_scale() < before)  # GradScaler backs off only on inf/NaN
            else:
                self.optimizer.step()
            self.hooks.optimizer_stepped(self.optimizer, self.steps_done)
            self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return applied


__all__ = ["EVAL_PHASE", "PHASES", "StepHooks", "StaticLossScale", "TrainStep"]
