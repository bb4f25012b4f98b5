"""Memory of the eval phase of a run: a forward without gradients between optimizer steps.

HF Trainer evaluates inside the training loop (``evaluation_strategy``/``eval_steps``), so everything resident
between steps stays: the weights and the optimizer state (gradients are gone: ``zero_grad(set_to_none=True)``).
On top, one forward at ``per_device_eval_batch_size`` under ``torch.no_grad()``:

* nothing is saved for backward, so each tensor dies when its consumer has run; the peak is the larger of two
  moments: inside a block (residual stream and its normed copy, then the widest of the attention's q/k/v + output
  and the MLP's gate/up/activation, plus eager attention's seq x seq scores and probabilities), or at the loss
  (the final hidden states and ``logits_memory(...).forward_peak``: logits, fp32 upcast, log-probabilities) —
  with a larger eval batch than the train micro-batch the loss is where eval OOMs (field notes: "OOM at the first
  evaluation");
* under ``*-mixed`` autocast still caches the low-precision casts of trainable leaf weights for the forward
  (``cached_cast`` checks ``requires_grad``, not grad mode): every weight for a full fine-tune, the adapters for
  LoRA.

Device overheads (CUDA context, cuBLAS workspace, allocator slack) are those of the training step: a CUDA
assumption carried over from the training estimate, not measured separately.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.memory import logits as lgt
from oomdoctor.memory import parameters as prm
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.memory.context import make_ctx
from oomdoctor.model.execution import num_tiles
from oomdoctor.model.quirks import effective_attn
from oomdoctor.model.roles import layer_roles
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan


@dataclass(frozen=True)
class EvalMemory:
    """The eval forward's peak, by part."""

    states: int
    """Resident between steps: weights (quantization constants, adapters) and device optimizer state."""
    amp_copies: int
    """Autocast's cached low-precision copies of the trainable weights (``*-mixed``)."""
    activations: int
    """At the peak: one block's forward working set, or the final hidden states when the loss is the peak."""
    logits: int
    """At the peak: logits, fp32 upcast and log-probabilities of the eval micro-batch (0 when a block is)."""
    overheads: int
    """Device bytes beyond tensors (context, workspace, allocator slack), as in the training estimate."""

    @property
    def peak_allocated(self) -> int:
        return self.states + self.amp_copies + self.activations + self.logits

    @property
    def peak_device(self) -> int:
        return self.peak_allocated + self.overheads

    @property
    def resident_device(self) -> int:
        """What the fits rule compares on a GPU (paged optimizer state is not in :attr:`states`)."""
        return self.peak_device

    def to_dict(self) -> dict:
        return {
            "states_bytes": self.states,
            "amp_copies_bytes": self.amp_copies,
            "activations_bytes": self.activations,
            "logits_bytes": self.logits,
            "peak_allocated_bytes": self.peak_allocated,
            "peak_device_bytes": self.peak_device,
        }


def eval_memory(spec: ModelSpec, plan: Plan, eval_batch: int, train: MemoryBreakdown) -> EvalMemory:
    """The eval phase of ``plan`` on ``spec`` at ``eval_batch`` sequences of ``plan.seq_len`` tokens, next to the
    training step's breakdown ``train`` (its resident states and device overheads)."""
    c = make_ctx(spec, plan.with_(micro_batch=eval_batch, grad_accum=1))
    amp = 0
    if c.mixed:
        amp = prm.amp_weight_copy_bytes(c) if c.full else 2 * c.cast_lora_numel
    block = block_forward_peak(c)
    at_loss = c.rb * c.T * spec.hidden_size
    logits = lgt.logits_memory(c).forward_peak
    if block >= at_loss + logits:
        acts, logits = block, 0
    else:
        acts = at_loss
    return EvalMemory(
        states=train.parameters + train.optimizer_states,
        amp_copies=amp,
        activations=acts,
        logits=logits,
        overheads=max(0, train.peak_device - train.peak_allocated),
    )


def block_forward_peak(c) -> int:
    """Live bytes inside one block's forward without autograd: the residual stream and its normed copy (``rb``),
    plus the widest stage in the compute dtype: attention (q, k, v and the output; eager: fp32 scores and the
    probabilities in ``ab``) or the MLP (input, gate, up and the activation of a gated MLP; input, up and the
    activation of a plain one), for the tokens each expert sees in MoE blocks."""
    spec = c.spec
    roles = layer_roles(spec)
    T, h, I = c.T, spec.hidden_size, spec.intermediate_size
    qd, kvd = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attn = c.ab * T * (2 * qd + 2 * kvd)
    if effective_attn(spec, c.plan.attn) == "eager":
        attn += (4 + c.ab) * c.B * spec.num_heads * c.S * c.S
    width = (3 if spec.mlp_kind == "gated" else 2) * I * roles.mlp_tokens
    if c.plan.tiled_mlp:
        # execute/tiled runs eval's MLP tile by tile too: its input and output, one tile's intermediates
        tile = -(-T // num_tiles(T, h))
        mlp = c.ab * (2 * T * h + tile * width)
    else:
        mlp = c.ab * T * (h + width)
    return int(2 * c.rb * T * h + max(attn, mlp))


__all__ = ["EvalMemory", "eval_memory"]
