"""LoRA adapters (Hu et al. 2021, arXiv 2106.09685): parameter count and bytes.

Each adapted ``nn.Linear(in, out)`` gets ``lora_A: (r, in)`` and ``lora_B: (out, r)`` without bias
(peft ``tuners/lora/layer.py``), so r*(in+out) trainable parameters per module. ``all-linear`` adapts every linear
but the output head (peft ``_maybe_include_all_linear_layers``); ``lora_on_head`` adds the head. On MoE models peft
converts the expert/router names to ``target_parameters`` (``ParamWrapper`` adapters on the router and the fused
expert stacks, per-expert factors): ``model/lora_targets.lora_groups_of`` lists them as equivalent linear groups.
Adapters are fp32 whatever the base dtype: ``get_peft_model(autocast_adapter_dtype=True)`` (the default) upcasts
fp16/bf16 adapter weights to fp32 (peft ``tuners/tuners_utils.py: cast_adapter_dtype``); the plan's
``adapter_dtype: bf16`` casts them to bf16 afterwards (TRL's SFTTrainer on a quantized model): ``Ctx.adapter_b``.
Limit: LoRA variants (DoRA's magnitude vector, rsLoRA) and ``modules_to_save`` copies are not priced.
"""

from __future__ import annotations

from oomdoctor.memory.context import Ctx


def adapter_numel(c: Ctx) -> int:
    """Trainable LoRA parameters: sum over adapted modules of r*(in+out)."""
    return c.lora_numel


def adapter_bytes(c: Ctx) -> int:
    return c.lora_numel * c.adapter_b


def adapted_layer_modules(c: Ctx) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of the adapted modules inside one transformer block."""
    return [(g.name, g.in_features, g.out_features) for g in c.lora_groups if g.per_layer]
