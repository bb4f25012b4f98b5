"""Per-rank pricing of the strategies (``oomdoctor.memory.sharding``): DeepSpeed's own estimator figures for
Llama-2-7B on 8 GPUs, and the laws measured in ``shared/research/multi-gpu.md`` §1 and §3."""

from __future__ import annotations

import json

import pytest

from oomdoctor.memory.analytic import estimate_analytic
from oomdoctor.memory.context import make_ctx
from oomdoctor.memory.sharding import deepspeed_view, rank_states, single_terms
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan

GiB = 2**30
LLAMA7B = "meta-llama/Llama-2-7b-hf"


@pytest.fixture(scope="module")
def llama7b():
    return load_spec(LLAMA7B)


def _ds(spec, strategy, **kw):
    plan = Plan(
        method="full",
        precision="bf16-mixed",
        optimizer="adamw",
        optimizer_impl="foreach",
        world_size=8,
        strategy=strategy,
        **kw,
    )
    return deepspeed_view(make_ctx(spec, plan), gpus_per_node=8)


def _deepspeed_reference(strategy, total, largest, gpus, offload_opt, offload_params):
    """DeepSpeed's own estimators, transcribed (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py,
    ``estimate_zero2_model_states_mem_needs`` after PR 5099 / ``estimate_zero3_model_states_mem_needs`` with
    zero_init=True, one node, additional_buffer_factor=1.5): (per GPU, per CPU) bytes."""
    if strategy == "zero2":
        if offload_opt:
            return 2 * total, int(total * max(4 * gpus, 16) * 1.5)
        return 2 * total + int(18 * total / gpus), int(total * 4 * gpus * 1.5)
    layer = 4 * largest
    if offload_params:
        return layer, int(total * 18 * 1.5)
    if offload_opt:
        return layer + int(2 * total / gpus), int(total * 16 * 1.5)
    return layer + int(18 * total / gpus), int(largest * 4 * gpus * 1.5)


CASES = [
    # DeepSpeed 0.19.8 estimate_zero{2,3}_model_states_mem_needs_all_cold, 1 node x 8 GPUs (multi-gpu.md §3; GiB)
    ("zero2", {}, 26.68, 301.30),
    ("zero2", {"offload_optimizer": True}, 12.55, 301.30),
    ("zero3", {}, 14.61, 5.86),
    ("zero3", {"offload_optimizer": True}, 2.06, 150.65),
    ("zero3", {"offload_optimizer": True, "offload_params": True}, 0.49, 169.48),
]


@pytest.mark.parametrize("strategy, kw, per_gpu, per_cpu", CASES)
def test_deepspeed_estimator_figures_llama2_7b(llama7b, strategy, kw, per_gpu, per_cpu):
    """The printed figures were computed with total_params = 6.74e9 (§3), ours from the exact inventory
    (6,738,415,616): equal to DeepSpeed's formulas to the byte, and to the printed GiB within that rounding."""
    assert llama7b.num_params == 6_738_415_616
    view = _ds(llama7b, strategy, **kw)
    ref = _deepspeed_reference(
        strategy,
        llama7b.num_params,
        32000 * 4096,
        8,
        kw.get("offload_optimizer", False),
        kw.get("offload_params", False),
    )
    assert (view.per_gpu, view.per_cpu) == ref
    assert view.per_gpu / GiB == pytest.approx(per_gpu, abs=0.01)
    assert view.per_cpu / GiB == pytest.approx(per_cpu, rel=3e-4)


def _tiny_spec(tmp_path, **over):
    """The research model of multi-gpu.md §1: tiny Llama whose embedding and head are 97 % of the parameters."""
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        hidden_act="silu",
    )
    cfg.update(over)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return load_spec(str(path))


def _states(spec, plan):
    rs = rank_states(make_ctx(spec, plan), single_terms(make_ctx(spec, plan)))
    return rs.parameters + rs.optimizer_states


def test_tiny_model_matches_research_param_count(tmp_path):
    assert _tiny_spec(tmp_path).num_params == 4_227_392


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_fsdp_states_are_12psi_over_n_fp32_adamw(tmp_path, n):
    spec = _tiny_spec(tmp_path)
    plan = Plan(
        method="full", precision="fp32", optimizer="adamw", optimizer_impl="foreach", world_size=n, strategy="fsdp"
    )
    assert _states(spec, plan) == pytest.approx(12 * spec.num_params / n, abs=n)


def test_hsdp_divides_by_the_shard_group(tmp_path):
    spec = _tiny_spec(tmp_path)
    hsdp = Plan(method="full", precision="fp32", world_size=4, strategy="fsdp", shard_group=2)
    fsdp2 = Plan(method="full", precision="fp32", world_size=2, strategy="fsdp")
    assert _states(spec, hsdp) == _states(spec, fsdp2)
    assert (
        estimate_analytic(spec, hsdp, device="cpu").peak_allocated
        == estimate_analytic(spec, fsdp2, device="cpu").peak_allocated
    )


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_is_single_plus_one_gradient_bucket(tmp_path, n):
    spec = _tiny_spec(tmp_path)
    single = estimate_analytic(spec, Plan(method="full", precision="fp32", optimizer_impl="foreach"), device="cpu")
    ddp = estimate_analytic(
        spec,
        Plan(method="full", precision="fp32", optimizer_impl="foreach", world_size=n, strategy="ddp"),
        device="cpu",
    )
    assert ddp.peak_allocated - single.peak_allocated == 4 * spec.num_params  # §1: +16.91 MB = 4Ψ
    assert ddp.comm_buffers == 4 * spec.num_params


def test_lora_under_fsdp_costs_more_than_ddp_at_two_ranks(tmp_path):
    """§1: the frozen base is only 4Ψ, the gathered root unit adds a copy: 92.5 MB (FSDP2) against 84.5 MB (DDP)."""
    spec = _tiny_spec(tmp_path)
    base = dict(method="lora", precision="fp32", world_size=2)
    ddp = estimate_analytic(spec, Plan(strategy="ddp", **base), device="cpu")
    fsdp = estimate_analytic(spec, Plan(strategy="fsdp", **base), device="cpu")
    assert fsdp.peak_allocated > ddp.peak_allocated
    full_ddp = estimate_analytic(
        spec, Plan(method="full", precision="fp32", world_size=2, strategy="ddp"), device="cpu"
    )
    full_fsdp = estimate_analytic(
        spec, Plan(method="full", precision="fp32", world_size=2, strategy="fsdp"), device="cpu"
    )
    assert full_fsdp.peak_allocated < full_ddp.peak_allocated  # full fine-tuning: sharding pays


def test_fsdp_on_one_gpu_gathers_a_root_copy(tmp_path):
    spec = _tiny_spec(tmp_path)
    single = estimate_analytic(spec, Plan(method="full", precision="fp32"), device="cpu")
    fsdp1 = estimate_analytic(spec, Plan(method="full", precision="fp32", strategy="fsdp"), device="cpu")
    root = (2 * 32000 * 64 + 64) * 4
    assert fsdp1.peak_allocated - single.peak_allocated >= root


def test_keeping_units_gathered_costs_more(tmp_path):
    spec = _tiny_spec(tmp_path, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=4096)
    base = dict(method="full", precision="fp32", world_size=4, strategy="fsdp")
    keep = estimate_analytic(spec, Plan(reshard_after_forward=False, **base), device="cpu")
    reshard = estimate_analytic(spec, Plan(**base), device="cpu")
    assert keep.peak_allocated > reshard.peak_allocated


def test_llama7b_full_ft_on_8_gpus_fsdp_vs_ddp(llama7b):
    """§4: the fake-PG simulation of FSDP2 N=8, bf16-mixed, GC, micro 1 x 2048, foreach AdamW peaks at 16.977 GB in
    the optimizer step (20Ψ/N); DDP needs the single-GPU 16Ψ of states and more."""
    base = dict(
        method="full", precision="bf16-mixed", gradient_checkpointing=True, optimizer_impl="foreach", world_size=8
    )
    fsdp = estimate_analytic(llama7b, Plan(strategy="fsdp", **base))
    assert fsdp.peak_phase == "optimizer-step"
    assert fsdp.peak_allocated == pytest.approx(16.977e9, rel=0.02)
    ddp = estimate_analytic(llama7b, Plan(strategy="ddp", **base))
    assert ddp.peak_allocated > 16 * llama7b.num_params
    assert ddp.phases["load"] == 4 * llama7b.num_params  # from_pretrained: a full fp32 copy per rank
    assert fsdp.phases["load"] < ddp.phases["load"] / 7  # meta init, sharded materialization
    assert fsdp.nccl_buffers > 0 and fsdp.peak_device > fsdp.peak_reserved + fsdp.cuda_context


def test_offload_reports_host_ram_per_node(llama7b):
    plan = Plan(method="full", precision="bf16-mixed", world_size=8, strategy="zero3", offload_optimizer=True)
    m = estimate_analytic(llama7b, plan)
    assert m.host_per_node == pytest.approx(1.5 * 16 * llama7b.num_params, rel=1e-6)
    assert m.cpu_offloaded == pytest.approx(16 * llama7b.num_params / 8, rel=1e-6)
    fsdp = estimate_analytic(llama7b, plan.with_(strategy="fsdp", offload_params=True))
    assert fsdp.host_per_node == pytest.approx(16 * llama7b.num_params + 0, rel=0.01)
    assert fsdp.parameters < 2e9  # only the units in flight on the device


def test_single_gpu_has_no_rank_terms(llama7b):
    m = estimate_analytic(llama7b, Plan(method="lora", precision="bf16-mixed"))
    assert m.comm_buffers == m.nccl_buffers == 0
    assert set(m.phases) == {"forward", "backward", "optimizer-step"}
    assert not any("world_size" in n for n in m.notes)


# ---------------------------------------------------------------------------------------------- analytic vs replay
SMALL = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=8192,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="full", precision="fp32", gradient_checkpointing=False, world_size=4),
        dict(method="full", precision="bf16-mixed", gradient_checkpointing=True, world_size=8),
        dict(
            method="full",
            precision="bf16-mixed",
            gradient_checkpointing=True,
            world_size=8,
            reshard_after_forward=False,
        ),
        dict(method="lora", precision="bf16-mixed", gradient_checkpointing=True, world_size=2),
        dict(method="full", precision="bf16", gradient_checkpointing=False, world_size=8, shard_group=4),
        dict(method="lora", precision="bf16-mixed", gradient_checkpointing=False, world_size=2, lora_dropout=0.1),
    ],
    ids=["fp32-n4", "bf16mixed-gc-n8", "keep-gathered", "lora-n2", "hsdp", "lora-dropout-no-gc"],
)
def test_fsdp_analytic_follows_the_fake_process_group_replay(kw):
    """The per-rank formulas (moments: the loss with root + one layer gathered, the layers with root + two, every
    layer until its backward with reshard_after_forward=False; bf16 gathered weights make the step compute like a
    pure bf16 one) against the exact FSDP2 replay of the same plan: within 1 % (measured: 0.02-0.08 %)."""
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import spec_from_config
    from oomdoctor.plan import validate

    spec = spec_from_config(dict(SMALL), name="small-llama")
    plan = validate(Plan(strategy="fsdp", seq_len=512, micro_batch=1, optimizer="adamw", **kw))
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.01 * s.peak_allocated, (
        plan.label(),
        a.peak_allocated,
        s.peak_allocated,
    )


def test_one_host_ram_rule_for_tune_and_train(monkeypatch):
    """The breakdown's host_per_node (every rank on one node) scaled to the ranks sharing the node: tune's ladder
    and train's pre-load check use the same function."""
    import oomdoctor.gpu
    from oomdoctor.errors import DoesNotFit
    from oomdoctor.memory.sharding import node_host_bytes
    from oomdoctor.plan import validate
    from oomdoctor.train.sizing import check_host_ram

    plan = validate(Plan(world_size=8, strategy="zero3", offload_optimizer=True, offload_params=True))
    assert node_host_bytes(800, plan) == 800 and node_host_bytes(800, plan, 2) == 200
    memory = {"host_per_node_bytes": 8 * 10**9}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(oomdoctor.gpu, "host_ram_bytes", lambda: 5 * 10**9)
    check_host_ram(plan, memory, [])  # 4 of 8 ranks here: 4 GB <= 5 GB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(DoesNotFit, match="8 rank"):
        check_host_ram(plan, memory, [])
    # offloaded activations (tune searches them) are held to the same RAM before the model loads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(DoesNotFit, match="1 rank"):
        check_host_ram(validate(Plan(gradient_checkpointing=True, offload_activations=True)), memory, [])
