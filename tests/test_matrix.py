"""The technique matrix: pins fix dimensions, the rest is spanned; all pinned -> exactly one plan."""

import pytest

from oomdoctor.diagnose.matrix import enumerate_plans
from oomdoctor.errors import BadInput


def test_unpinned_matrix_spans_methods_precisions_gc_optimizers_offload():
    plans = enumerate_plans({})
    methods = {p.method for p in plans}
    assert methods == {"full", "lora", "qlora"}
    full = [p for p in plans if p.method == "full"]
    assert {p.precision for p in full} == {"fp32", "bf16-mixed", "bf16"}
    assert {p.gradient_checkpointing for p in plans} == {False, True}
    assert {"adamw", "adamw-8bit", "adafactor", "sgd", "lion"} <= {p.optimizer for p in full}
    assert any(p.offload_optimizer for p in full)
    assert {p.quant for p in plans if p.method == "qlora"} == {"nf4", "int8"}
    assert len(plans) == len(set(plans))


def test_every_technique_pinned_gives_one_plan():
    pins = dict(
        method="lora",
        precision="bf16-mixed",
        optimizer="adamw",
        attn="sdpa",
        gradient_checkpointing=True,
        lora_r=8,
        lora_targets=("q_proj", "v_proj"),
    )
    (plan,) = enumerate_plans(pins)
    assert plan.lora_r == 8 and plan.lora_targets == ("q_proj", "v_proj") and plan.gradient_checkpointing
    pins = dict(
        method="qlora",
        precision="bf16-mixed",
        optimizer="paged-adamw-8bit",
        attn="sdpa",
        gradient_checkpointing=False,
        quant="nf4",
        double_quant=True,
    )
    assert len(enumerate_plans(pins)) == 1
    pins = dict(method="full", precision="fp32", optimizer="sgd", attn="eager", gradient_checkpointing=False)
    assert len(enumerate_plans(pins)) == 1


def test_quant_flag_restricts_to_qlora_and_lora_flags_to_adapters():
    assert {p.method for p in enumerate_plans({"quant": "nf4"})} == {"qlora"}
    assert {p.method for p in enumerate_plans({"lora_r": 64})} == {"lora", "qlora"}
    assert all(p.micro_batch == 4 for p in enumerate_plans({"micro_batch": 4}))


def test_kbit_upcast_is_spanned_only_when_pinned():
    """diagnose's table keeps peft's k-bit upcast on (one QLoRA row per stack); --no-kbit-upcast shows the QLoRA
    plans without it, and only them (the knob means nothing without a quantized base)."""
    assert all(p.kbit_upcast for p in enumerate_plans({}))
    off = enumerate_plans({"kbit_upcast": False})
    assert off and {p.method for p in off} == {"qlora"} and not any(p.kbit_upcast for p in off)
    assert {p.method for p in enumerate_plans({"kbit_upcast": True})} == {"full", "lora", "qlora"}


def test_impossible_pins_raise():
    with pytest.raises(BadInput, match="--method full"):
        enumerate_plans({"method": "full", "quant": "nf4"})
    with pytest.raises(BadInput):
        enumerate_plans({"optimizer": "adam"})
    with pytest.raises(BadInput):
        enumerate_plans({"not_a_knob": 1})
