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

from oomdoctor.memory.context import Ctx, adapter_numel


def trainable_numel(c: Ctx) -> int:
    if c.full:
        s = c.sums
        return s.linear_numel + s.head_numel + s.embed_numel + s.other_numel - s.tower_numel
    return c.lora_numel


def param_bytes_per_trainable(c: Ctx) -> int:
    """Bytes per element of trainable parameters (and so of their gradients)."""
    return c.wb if c.full else c.adapter_b


def gradient_bytes(c: Ctx) -> int:
    return trainable_numel(c) * param_bytes_per_trainable(c)


def embedding_gradient_bytes(c: Ctx) -> int:
    """Gradient of the input embedding (computed last in backward). 0 when frozen."""
    return c.sums.embed_numel * c.wb if c.full else 0


def tied_weight_gradient_bytes(c: Ctx) -> int:
    """Full fine-tuning with the head tied to the input embedding: the head's gradient of the shared weight
    (vocab x hidden). Autograd holds it in the shared weight's input buffer from the head's backward (first) until
    the embedding's gradient arrives (last), then sums the two out of place (torch/csrc/autograd/input_buffer.cpp
    ``InputBuffer::add``: ``old + new``, the buffer is not reused in place) before ``AccumulateGrad`` takes the sum:
    one copy through the whole backward and three at its end. Measured tensor by tensor on a real CPU step
    (``aten.mm``, ``aten.embedding_dense_backward``, ``aten.add.Tensor``) and by the simulated engine."""
    if not (c.full and c.spec.tie_word_embeddings and c.spec.arch_kind != "encoder"):
        return 0
    return c.spec.vocab_size * c.spec.hidden_size * c.wb


def head_gradient_bytes(c: Ctx) -> int:
    """Gradient of the output head and final norm (computed first in backward)."""
    if c.full:
        return (c.sums.head_numel + c.spec.hidden_size) * c.wb + tied_weight_gradient_bytes(c)
    if c.plan.lora_on_head:
        for g in c.lora_groups:
            if not g.per_layer:
                return c.plan.lora_r * (g.in_features + g.out_features) * c.adapter_b
    return 0


def per_layer_gradient_bytes(c: Ctx) -> int:
    """Gradients of one transformer block."""
    L = max(c.spec.num_layers, 1)
    if c.full:
        return c.sums.per_layer_numel * c.wb
    return adapter_numel(c.plan, [g for g in c.lora_groups if g.per_layer]) * c.adapter_b // L
