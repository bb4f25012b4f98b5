"""MoE experts as transformers runs them: grouped matmul on bf16 expert weights, eager experts where the grouped
matmul needs bf16 (fp32 master weights); both replayed exactly (eager ones under a balanced router)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from oomdoctor.errors import BadInput
from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import Plan, validate

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MIXTRAL = dict(
    model_type="mixtral",
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=512,
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=1,
    topk_group=1,
    vocab_size=256,
)


@pytest.fixture(scope="module")
def moe_spec():
    return spec_from_config(dict(QWEN3_MOE), name="tiny-qwen3-moe")


@pytest.mark.parametrize(
    "method, precision, upcast, kernel",
    [
        ("lora", "bf16", True, "grouped_mm"),
        ("lora", "fp32", True, "eager"),
        ("lora", "bf16-mixed", True, "eager"),
        # peft's k-bit upcast makes a quantized base's experts fp32; without it they stay bf16
        ("qlora", "bf16", True, "eager"),
        ("qlora", "bf16", False, "grouped_mm"),
    ],
)
def test_the_executor_picks_the_experts_kernel_that_runs(moe_spec, method, precision, upcast, kernel):
    import torch

    from oomdoctor.execute.build import build_model

    plan = validate(Plan(method=method, precision=precision, seq_len=32, kbit_upcast=upcast))
    built = build_model(moe_spec, plan, device="meta")
    assert built.model.get_base_model().config._experts_implementation == kernel
    experts = {p.dtype for n, p in built.model.named_parameters() if ".experts." in n and "lora" not in n}
    assert experts == {torch.bfloat16 if kernel == "grouped_mm" else torch.float32}


def test_bf16_experts_replay_equals_the_real_cpu_step(moe_spec):
    from oomdoctor.engines.simulate import real_cpu_run, simulate_run

    plan = validate(Plan(method="lora", precision="bf16", seq_len=64, micro_batch=2))
    assert simulate_run(moe_spec, plan, round_to=1).peak == real_cpu_run(moe_spec, plan, round_to=1).peak


@contextmanager
def balanced_router(experts: int, top_k: int):
    """Real routers as a balanced one: token t picks experts (t·k + j) mod E (torch.topk's values kept, so every
    tensor the router makes has its shape and dtype) — the routing the replay assumes (engines/routing)."""
    import torch

    topk = torch.topk

    def balanced_topk(x, k=None, *args, **kwargs):
        k = kwargs.pop("k") if k is None else k
        values, indices = topk(x, k, *args, **kwargs)
        if k == top_k and x.shape[-1] == experts:
            tokens = x.numel() // experts
            slots = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % experts
            indices = slots.reshape(indices.shape).to(indices.device)
        return torch.return_types.topk((values, indices))

    torch.topk = balanced_topk
    try:
        yield
    finally:
        torch.topk = topk


@pytest.mark.parametrize("cfg", [QWEN3_MOE, MIXTRAL], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize(
    "method, precision, gc",
    [("lora", "fp32", False), ("lora", "bf16-mixed", True), ("qlora", "bf16-mixed", False), ("full", "fp32", True)],
)
def test_eager_experts_replay_equals_the_real_cpu_step_under_a_balanced_router(cfg, method, precision, gc):
    """The eager experts' data-dependent token picks are sized as a balanced router sends them: the replay then
    equals a real CPU step whose router is balanced, to the byte."""
    from oomdoctor.engines.simulate import real_cpu_run, simulate_run
    from oomdoctor.execute.build import runs_eager_experts

    spec = spec_from_config(dict(cfg), name="tiny-moe")
    plan = validate(
        Plan(method=method, precision=precision, seq_len=64, micro_batch=2, gradient_checkpointing=gc, lora_dropout=0.0)
    )
    assert runs_eager_experts(spec, plan)
    replayed = simulate_run(spec, plan, round_to=1).peak
    with balanced_router(spec.num_experts, spec.experts_per_token):
        assert replayed == real_cpu_run(spec, plan, round_to=1).peak


def test_the_replay_names_a_data_dependent_op_it_cannot_size():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.engines.routing import _mode_cls, expert_token_counts

    assert expert_token_counts(10, 4) == [3, 3, 2, 2] and sum(expert_token_counts(4096, 60)) == 4096
    with FakeTensorMode(), _mode_cls()(8, 2):
        assert torch.zeros(2, 64, dtype=torch.bool).nonzero().shape == (16, 2)  # one expert's (slot, token) pairs
        with pytest.raises(BadInput, match="data-dependent nonzero") as ei:
            torch.zeros(5, 7, dtype=torch.bool).nonzero()
    assert "--engine analytic" in ei.value.hint


# --- LoRA as peft applies it to MoE blocks (issue 12): all-linear -> router + fused-expert ParamWrapper adapters
#: shapes where no attention linear looks like an MLP input (2·moe_intermediate != hidden)
QWEN3_MOE_LORA = dict(QWEN3_MOE, moe_intermediate_size=96)


@pytest.mark.parametrize("cfg", [QWEN3_MOE_LORA, MIXTRAL, DEEPSEEK_V3], ids=lambda c: c["model_type"])
@pytest.mark.parametrize("targets, on_head", [(("all-linear",), False), (("all-linear",), True)])
def test_adapters_counted_as_peft_creates_them(cfg, targets, on_head):
    from oomdoctor.execute.build import build_model
    from oomdoctor.memory.context import make_ctx

    spec = spec_from_config(dict(cfg), name=cfg["model_type"])
    plan = validate(Plan(method="lora", precision="bf16", seq_len=32, lora_targets=targets, lora_on_head=on_head))
    model = build_model(spec, plan, device="meta").model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert make_ctx(spec, plan).lora_numel == trainable
    if not on_head:  # peft's own all-linear: every MoE block's router and both expert stacks carry lora_A/lora_B
        adapted = [n for n, p in model.named_parameters() if p.requires_grad]
        routers = [n for n in adapted if ".mlp.gate.lora_" in n]
        assert routers and sum(".mlp.experts." in n for n in adapted) == 2 * len(routers)


def test_all_linear_reaches_peft_as_the_string(moe_spec):
    from oomdoctor.model.lora_targets import target_modules

    assert target_modules(moe_spec, validate(Plan(method="lora"))) == "all-linear"


@pytest.mark.parametrize("cfg", [QWEN3_MOE_LORA, MIXTRAL], ids=lambda c: c["model_type"])
def test_lora_dropout_on_expert_adapters_is_refused_with_the_fix(cfg):
    from oomdoctor.model.execution import check_plan_for_model

    spec = spec_from_config(dict(cfg), name=cfg["model_type"])
    with pytest.raises(BadInput, match="ParamWrapper") as ei:
        check_plan_for_model(spec, validate(Plan(method="lora", lora_dropout=0.05)))
    assert "lora_dropout: 0" in ei.value.hint and "q_proj" in ei.value.hint
    check_plan_for_model(spec, validate(Plan(method="lora", lora_dropout=0.05, lora_targets=("q_proj", "v_proj"))))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [QWEN3_MOE_LORA, MIXTRAL], ids=lambda c: c["model_type"])
@pytest.mark.parametrize("gc", [False, True], ids=["no-gc", "gc"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide-experts"])
def test_analytic_within_2_percent_of_simulate_for_moe_lora(cfg, gc, wide):
    """bf16 LoRA with peft's all-linear on fused experts (replayed exactly by simulate): tokens dominate the narrow
    shapes, the materialized W' and its gradient the wide ones (32 experts of 256)."""
    from oomdoctor.engines import estimate

    if wide:
        cfg = dict(
            cfg,
            **(
                {"moe_intermediate_size": 256, "num_experts": 32}
                if "num_experts" in cfg
                else {"intermediate_size": 256, "num_local_experts": 32}
            ),
        )
    spec = spec_from_config(dict(cfg), name=cfg["model_type"])
    plan = validate(Plan(method="lora", precision="bf16", seq_len=512 if wide else 1024, gradient_checkpointing=gc))
    sim = estimate(spec, plan, "simulate").peak_allocated
    ana = estimate(spec, plan, "analytic").peak_allocated
    assert abs(ana - sim) / sim <= 0.02, (ana, sim)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [QWEN3_MOE_LORA, MIXTRAL], ids=lambda c: c["model_type"])
@pytest.mark.parametrize(
    "method, precision, gc",
    [("lora", "fp32", True), ("qlora", "bf16-mixed", False), ("full", "bf16-mixed", True), ("full", "fp32", False)],
)
def test_analytic_within_1_percent_of_simulate_for_wide_eager_experts(cfg, method, precision, gc):
    """Plans that run the eager experts (fp32 weights, autocast, QLoRA), with weight-dominated experts as released
    MoE models have them (32 experts of 256 here): the per-expert loop's index-backward gradient sums, per-slice
    autocast casts and ``index_add_`` source are priced by the formulas."""
    from oomdoctor.engines import estimate

    cfg = dict(
        cfg,
        **(
            {"moe_intermediate_size": 256, "num_experts": 32}
            if "num_experts" in cfg
            else {"intermediate_size": 256, "num_local_experts": 32}
        ),
    )
    spec = spec_from_config(dict(cfg), name=cfg["model_type"])
    plan = validate(Plan(method=method, precision=precision, seq_len=512, lora_dropout=0.0, gradient_checkpointing=gc))
    sim = estimate(spec, plan, "simulate").peak_allocated
    ana = estimate(spec, plan, "analytic").peak_allocated
    assert abs(ana - sim) / sim <= 0.01, (ana, sim)  # README: within 1 % with wide experts
