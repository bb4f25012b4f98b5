"""One LoRA target rule: the names ``build_model`` takes from the spec equal those ``execute/load`` reads off a loaded
model's module tree, for every way a plan names its targets."""

from __future__ import annotations

import pytest

from oomdoctor.execute.build import hf_config, lora_targets_of_model
from oomdoctor.model.load import load_spec, spec_from_config
from oomdoctor.model.lora_targets import target_modules
from oomdoctor.plan import Plan, validate

PLANS = [
    Plan(method="lora"),
    Plan(method="lora", lora_on_head=True),
    Plan(method="lora", lora_targets=("q_proj", "v_proj")),
    Plan(method="lora", lora_targets=("all-linear", "q_proj"), lora_on_head=True),
]


def _meta_model(spec):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(spec, validate(Plan()), num_layers=1))


def _id(plan: Plan) -> str:
    return ",".join(plan.lora_targets) + ("+head" if plan.lora_on_head else "")


@pytest.mark.parametrize("plan", PLANS, ids=_id)
def test_spec_and_module_tree_give_the_same_targets(tiny_config, plan):
    spec = spec_from_config(tiny_config, name="tiny-llama")
    plan = validate(plan)
    assert lora_targets_of_model(_meta_model(spec), plan) == target_modules(spec, plan)


@pytest.mark.parametrize("model", ["openai-community/gpt2", "tiiuae/falcon-7b", "microsoft/Phi-3-mini-4k-instruct"])
def test_same_targets_on_other_architectures(model):
    """GPT-2's ``Conv1D`` and Falcon's ``FalconLinear`` are linears to peft's all-linear, and to both sides."""
    spec = load_spec(model)
    plan = validate(Plan(method="lora", lora_on_head=True))
    targets = target_modules(spec, plan)
    assert "lm_head" in targets and len(targets) > 2
    assert lora_targets_of_model(_meta_model(spec), plan) == targets
