"""MoE experts as transformers runs them: grouped matmul on bf16 expert weights (replayed exactly), eager experts
where the grouped matmul needs bf16 (fp32 master weights), which the fake-tensor replay refuses by name."""

from __future__ import annotations

import pytest

from oomdoctor.errors import BadInput
from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import Plan, validate

QWEN3_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=128, intermediate_size=256,
                 moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, num_experts=8, num_experts_per_tok=2, vocab_size=512, max_position_embeddings=512,
                 tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe_spec():
    return spec_from_config(dict(QWEN3_MOE), name="tiny-qwen3-moe")


@pytest.mark.parametrize("precision, kernel", [("bf16", "grouped_mm"), ("fp32", "eager"), ("bf16-mixed", "eager")])
def test_the_executor_picks_the_experts_kernel_that_runs(moe_spec, precision, kernel):
    from oomdoctor.execute.build import build_model

    built = build_model(moe_spec, validate(Plan(method="lora", precision=precision, seq_len=32)), device="meta")
    assert built.model.get_base_model().config._experts_implementation == kernel


def test_bf16_experts_replay_equals_the_real_cpu_step(moe_spec):
    from oomdoctor.engines.simulate import real_cpu_run, simulate_run

    plan = validate(Plan(method="lora", precision="bf16", seq_len=64, micro_batch=2))
    assert simulate_run(moe_spec, plan, round_to=1).peak == real_cpu_run(moe_spec, plan, round_to=1).peak


def test_eager_experts_run_for_real_and_the_replay_refuses_them_by_name(moe_spec):
    from oomdoctor.engines.simulate import real_cpu_run, simulate_run

    plan = validate(Plan(method="lora", precision="fp32", seq_len=64, micro_batch=2))
    assert real_cpu_run(moe_spec, plan, round_to=1).peak > 0
    with pytest.raises(BadInput, match="eager experts") as ei:
        simulate_run(moe_spec, plan)
    assert "--engine analytic" in ei.value.hint
