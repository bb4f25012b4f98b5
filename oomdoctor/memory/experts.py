"""MoE experts' terms of the block formulas: the routing weights' dtype, the parameters peft wraps with a
``ParamWrapper`` and the W' it materializes, the expert-weight gradients of the eager experts loop.
"""

from __future__ import annotations

from oomdoctor.memory.context import Ctx
from oomdoctor.model.lora_targets import PARAM_WRAPPER
from oomdoctor.model.quirks import FP32_ROUTING_WEIGHTS


def routing_weight_bytes(c: Ctx) -> int:
    """Bytes per element of the routing weights the experts multiply their outputs by (FP32_ROUTING_WEIGHTS)."""
    return 4 if c.spec.model_type in FP32_ROUTING_WEIGHTS else c.ab


def param_wrapped(c: Ctx) -> dict[str, int]:
    """The MoE parameters of one block carrying a peft ``ParamWrapper`` adapter (``model/lora_targets.lora_groups_of``):
    ``gate`` (router), ``gate_up_proj``, ``down_proj`` -> their base weight's elements in one block."""
    L = max(c.spec.num_layers, 1)
    out = {}
    for g in c.lora_groups:
        if g.module == PARAM_WRAPPER and g.per_layer:
            base = next(b for b in c.spec.groups if b.path == g.path and b.kind != "linear")
            out[g.name.split(".")[-1]] = base.numel_each * g.count // L
    return out


def eager_expert_grads(c: Ctx, w_gu: int, w_d: int) -> int:
    """Bytes of one block's expert-weight gradients in flight in the backward of transformers' eager experts, from
    the fused stacks' elements (``w_gu`` gate_up, ``w_d`` down). The eager loop indexes ``W[e]`` per expert
    (``MixtralExperts.forward``); each index backward makes a zero-filled full-size gradient that autograd sums into
    the parameter's running sum (``InputBuffer``): two full-size gate_up gradients alive at once besides its running
    sum, while down's sum is complete and waits (for its ``AccumulateGrad`` in a full fine-tune, for the
    parametrization backward of a ``ParamWrapper`` adapter). Measured with real_cpu_run (fp32 LoRA) and the simulated
    engine (full fine-tunes, balanced routing: engines/routing)."""
    return c.wb * (3 * w_gu + w_d)


def param_wrapper_weights(c: Ctx) -> int:
    """Bytes one block's forward materializes for its ``ParamWrapper`` adapters and saves for backward.

    peft 0.21 ``ParamWrapper._activate_lora`` (``tuners/lora/layer.py``) registers a ``torch.nn.utils.parametrize``
    parametrization on each adapted parameter: reading it inside the forward builds W' = W + scale·B@A for the whole
    stack of experts, which the expert matmuls (and the router's ``F.linear``) save for the input gradient, once per
    block (recomputed per block under gradient checkpointing). For an expert stack with one adapter
    (``_LoraFactorsProxy``) W' is one ``baddbmm`` in the parameter's dtype, whose factors — the fp32 adapter
    weights cast to a bf16/fp16 parameter's dtype (``get_delta_factors``) — it saves as well; the router (2-D,
    ``get_delta_weight``) adds its delta cast to the weight's dtype. Measured with the simulate engine on tiny
    Qwen3-MoE / Mixtral shapes (tests/test_moe.py)."""
    # under autocast the matmuls save their compute-dtype casts of W' (per expert slice, eager experts), not W'
    total = sum(param_wrapped(c).values()) * (c.ab if c.mixed else c.wb)
    if c.wb != 4:
        L = max(c.spec.num_layers, 1)
        total += sum(
            c.plan.lora_r * (g.in_features + g.out_features) * g.count // L * c.wb
            for g in c.lora_groups
            if g.module == PARAM_WRAPPER and g.per_layer and not g.name.endswith(".gate")
        )
    return total
