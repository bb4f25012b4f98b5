"""Gradients: one per trainable parameter, in the parameter's dtype (torch ``AccumulateGrad`` steals the computed
gradient as ``.grad``). Source: ZeRO paper (Rajbhandari et al. 2020, arXiv 1910.02054) §3.1: model states =
parameters + gradients + optimizer states; 2 bytes/param for fp16 gradients, 4 for fp32.

* full fine-tune: every parameter, in the weight dtype (fp32 for fp32 and ``*-mixed``: AMP gradients land on the
  fp32 master weights; bf16 for pure bf16);
* LoRA / QLoRA: the adapters only, fp32 (peft upcasts adapters, see ``lora.py``).

Limit: gradients are freed by ``zero_grad(set_to_none=True)`` after each optimizer step; with ``grad_accum > 1``
they stay allocated across micro-batches (priced in the forward/backward phases by ``analytic.py``).
"""

from __future__ import annotations

from oomdoctor.memory.context import Ctx
from oomdoctor.memory.lora import ADAPTER_BYTES


def trainable_numel(c: Ctx) -> int:
    if c.full:
        s = c.sums
        return s.linear_numel + s.head_numel + s.embed_numel + s.other_numel
    return c.lora_numel


def param_bytes_per_trainable(c: Ctx) -> int:
    """Bytes per element of trainable parameters (and so of their gradients)."""
    return c.wb if c.full else ADAPTER_BYTES


def gradient_bytes(c: Ctx) -> int:
    return trainable_numel(c) * param_bytes_per_trainable(c)


def embedding_gradient_bytes(c: Ctx) -> int:
    """Gradient of the input embedding (computed last in backward). 0 when frozen."""
    return c.sums.embed_numel * c.wb if c.full else 0


def head_gradient_bytes(c: Ctx) -> int:
    """Gradient of the output head and final norm (computed first in backward)."""
    if c.full:
        return (c.sums.head_numel + c.spec.hidden_size) * c.wb
    if c.plan.lora_on_head:
        for g in c.lora_groups:
            if not g.per_layer:
                return c.plan.lora_r * (g.in_features + g.out_features) * ADAPTER_BYTES
    return 0


def per_layer_gradient_bytes(c: Ctx) -> int:
    """Gradients of one transformer block."""
    L = max(c.spec.num_layers, 1)
    if c.full:
        return c.sums.per_layer_numel * c.wb
    per_layer_lora = sum(c.plan.lora_r * (g.in_features + g.out_features) * g.count for g in c.lora_groups if g.per_layer)
    return per_layer_lora * ADAPTER_BYTES // L
