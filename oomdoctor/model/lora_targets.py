"""LoRA targets: which modules (and, on MoE models, which raw parameters) peft puts an adapter on for a plan, as the
executor hands them to peft and as peft 0.21 resolves them — the one rule the executor (``execute/build``,
``execute/trainers``) and the pricing (``memory/context``) both read. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable

from oomdoctor.errors import BadInput
from oomdoctor.model.spec import HEAD_NAMES, ModelSpec, ParamGroup
from oomdoctor.plan import Plan
from oomdoctor.plan.techniques import ALL_LINEAR


def lora_targets_match(name: str, targets: tuple[str, ...]) -> bool:
    """peft ``target_modules`` matching by module-name suffix; ``all-linear`` = every linear but the head."""
    if "all-linear" in targets:
        return name not in HEAD_NAMES
    return name in targets


#: peft 0.21 ``utils/transformers_weight_conversion.py`` ``_MOE_TARGET_MODULE_MAPPING``: per conversion pattern,
#: the (transformers v4) target names peft moves to ``target_parameters`` -> the v5 parameter they adapt.
PEFT_MOE_TARGETS: dict[str, dict[str, str]] = {
    "mixtral": {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {
        "gate": "gate.weight",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
        "down_proj": "down_proj",
    },
}


#: Module class recorded on the synthetic groups of :func:`lora_groups_of` that stand for a ``ParamWrapper``.
PARAM_WRAPPER = "ParamWrapper"


_MAMBA_MIXER = frozenset({"out_proj", "conv1d"})


#: Linear modules peft cannot adapt with LoRA, by model type, also when they come from the string ``all-linear``:
#: the Mamba mixers' ``out_proj``/``conv1d`` (peft 0.21 ``tuners/tuners_utils._check_lora_target_modules_mamba``
#: raises); Llama 4's ``router``, an nn.Linear subclass returning a tuple, which peft's LoRA forward cannot add to
#: (``'tuple' object has no attribute 'dtype'``, found replaying it).
PEFT_LORA_REFUSED: dict[str, frozenset[str]] = {
    **dict.fromkeys(("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"), _MAMBA_MIXER),
    **dict.fromkeys(("llama4", "llama4_text"), frozenset({"router"})),
}


def lora_refused_names(model_type: str) -> frozenset[str]:
    """Module names peft cannot adapt with LoRA on ``model_type`` (:data:`PEFT_LORA_REFUSED`): the executor's
    ``all-linear`` leaves them out, explicit targets naming them are refused."""
    return PEFT_LORA_REFUSED.get(model_type, frozenset())


def all_linear_string(plan: Plan, model_type: str) -> bool:
    """Whether peft gets the string ``all-linear`` (it resolves it, MoE conversion included): the plan targets
    all-linear alone, not the head, on a model where peft adapts every linear."""
    return plan.lora_targets == ("all-linear",) and not plan.lora_on_head and not lora_refused_names(model_type)


def all_linear_names(spec: ModelSpec) -> set[str]:
    """Leaf names of the linears peft's ``all-linear`` adapts on ``spec`` as the executor runs it: every linear but
    the head, the towers' (frozen, kept out by ``exclude_modules``) and those peft refuses."""
    refused = lora_refused_names(spec.model_type)
    return {
        g.name
        for g in spec.groups
        if g.kind == "linear" and not g.tower and g.name not in HEAD_NAMES and g.name not in refused
    }


def peft_target_modules(plan: Plan, model_type: str, linears: Iterable[str], heads: Iterable[str]) -> str | list[str]:
    """peft ``target_modules`` for ``plan``, the one rule: the string ``all-linear`` where peft resolves it itself
    (:func:`all_linear_string`; MoE conversion included), else the sorted leaf names — the plan's explicit names,
    ``all-linear`` expanded to ``linears`` (leaf names of the model's linear modules outside its towers) but the
    output ``heads`` and what peft refuses on ``model_type`` (:func:`lora_refused_names`), the heads added with
    ``lora_on_head`` (``lm_head`` when the model names none)."""
    if all_linear_string(plan, model_type):
        return ALL_LINEAR
    heads = set(heads)
    names = {t for t in plan.lora_targets if t != ALL_LINEAR}
    if ALL_LINEAR in plan.lora_targets:
        names |= set(linears) - heads - lora_refused_names(model_type)
    if plan.lora_on_head:
        names |= heads or {"lm_head"}
    return sorted(names)


def target_modules(spec: ModelSpec, plan: Plan) -> str | list[str]:
    """peft ``target_modules`` for ``plan`` on ``spec`` (:func:`peft_target_modules` over the spec's linears): what
    the executor hands peft (``execute/build``), what the trainers' files name (``execute/trainers``) and what
    :func:`lora_groups_of` prices."""
    linears = {g.name for g in spec.groups if g.kind == "linear" and not g.tower}
    return peft_target_modules(plan, spec.model_type, linears, linears & set(HEAD_NAMES))


def lora_groups_of(spec: ModelSpec, plan: Plan) -> tuple[ParamGroup, ...]:
    """The groups peft 0.21 puts a LoRA adapter on, as ``get_peft_model`` resolves the executor's targets.

    Dense models: the matching linear groups. On a model with ``spec.peft_moe_conversion`` peft first converts the
    targets (``_convert_peft_config_moe``): a string ``all-linear`` resolves to every non-head linear leaf name plus
    the conversion's v4 names; those names then leave ``target_modules`` (an nn.Linear named ``gate_proj`` —
    DeepSeek's dense layers, shared experts — gets no adapter) and become ``target_parameters``, each wrapped by a
    ``ParamWrapper`` (peft ``tuners/lora/layer.py``) whose factors are per expert, stacked:

    * router ``gate.weight`` (E, h): lora_A (r, h), lora_B (E, r);
    * ``gate_up_proj`` (E, 2I, h), rank 2r and alpha x2 (``rank_pattern``/``alpha_pattern``, two fused names):
      lora_A (2r·E, h), lora_B (2I, 2r·E);
    * ``down_proj`` (E, h, I): lora_A (r·E, I), lora_B (h, r·E).

    Each becomes a synthetic ``linear`` group (``module`` :data:`PARAM_WRAPPER`, ``name`` its parameter path's last
    two parts) whose r·(in+out) is the adapter's trainable count and r·in / out·r the element counts of lora_A /
    lora_B."""
    targets = target_modules(spec, plan)
    conv = PEFT_MOE_TARGETS.get(spec.peft_moe_conversion, {})
    names = set(targets) if targets != ALL_LINEAR else all_linear_names(spec) | set(conv)
    params = {conv[n] for n in names if n in conv}
    modules = names - set(conv)
    out = [
        g
        for g in spec.groups
        if g.kind == "linear" and not g.tower and g.name in modules and (plan.lora_on_head or g.name not in HEAD_NAMES)
    ]
    E, h = max(spec.num_experts, 1), spec.hidden_size
    for g in spec.groups:
        if g.kind == "linear" or not params:
            continue
        path = g.path or g.name
        if "gate.weight" in params and path.endswith(".gate") and g.numel_each == E * h:
            io = (h, E)
        elif "gate_up_proj" in params and path.endswith("experts.gate_up_proj"):
            io = (2 * E * h, 2 * g.numel_each // h)  # out = 2E·2I
        elif "down_proj" in params and path.endswith("experts.down_proj"):
            io = (g.numel_each // h, E * h)  # in = E·I
        else:
            continue
        out.append(
            ParamGroup(
                name=".".join(path.split(".")[-2:]),
                kind="linear",
                in_features=io[0],
                out_features=io[1],
                count=g.count,
                per_layer=g.per_layer,
                path=path,
                module=PARAM_WRAPPER,
            )
        )
    return tuple(out)


def check_param_wrapper(spec: ModelSpec, plan: Plan) -> None:
    """Refuse what peft refuses on adapters of raw parameters (:func:`lora_groups_of`): ``ParamWrapper`` raises
    with ``lora_dropout != 0`` (peft 0.21 ``tuners/lora/layer.py``), and ``_convert_peft_config_moe`` raises when
    only one of two names fused into one parameter is targeted (``gate_proj`` without ``up_proj``)."""
    if not plan.uses_lora or not spec.peft_moe_conversion:
        return
    targets = target_modules(spec, plan)
    names = set() if targets == ALL_LINEAR else set(targets)
    conv = PEFT_MOE_TARGETS[spec.peft_moe_conversion]
    fused = sorted(n for n, p in conv.items() if p == "gate_up_proj")
    if 0 < len(names & set(fused)) < len(fused):
        raise BadInput(
            f"LoRA targets of {spec.name}: {' and '.join(fused)} are fused into one expert parameter "
            "(gate_up_proj); peft cannot adapt one without the other",
            f"target both {' and '.join(fused)}, or neither",
        )
    if plan.lora_dropout and any(g.module == PARAM_WRAPPER for g in lora_groups_of(spec, plan)):
        raise BadInput(
            f"lora_dropout {plan.lora_dropout:g}: on {spec.name} the LoRA targets include MoE router/expert "
            "parameters, which peft adapts with a ParamWrapper that does not support dropout",
            "set lora_dropout: 0, or target attention only "
            "(--lora-targets / target_modules: q_proj,k_proj,v_proj,o_proj)",
        )


def check_lora_targets(spec: ModelSpec, plan: Plan) -> None:
    """Refuse LoRA targets that adapt nothing (peft raises on them too): BadInput listing the model's linears."""
    if not plan.uses_lora:
        return
    refused = sorted(lora_refused_names(spec.model_type) & set(plan.lora_targets))
    if refused:
        raise BadInput(
            f"LoRA targets {','.join(refused)}: peft cannot adapt them in {spec.model_type} models",
            "leave them out; all-linear adapts every other linear",
        )
    if plan.lora_on_head:
        return
    names = sorted({g.name for g in spec.groups if g.kind == "linear"})
    if not any(lora_targets_match(n, plan.lora_targets) for n in names):
        raise BadInput(
            f"LoRA targets {','.join(plan.lora_targets)} match no linear module of {spec.name}",
            f"use all-linear or some of: {', '.join(names)}",
        )
