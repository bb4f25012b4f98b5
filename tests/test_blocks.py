"""Blocks the formulas do not know are measured by replaying them (oomdoctor.engines.blocks)."""

from __future__ import annotations

import json

import pytest

from oomdoctor.cache import CACHE_ENV
from oomdoctor.engines import blocks, estimate, kinds
from oomdoctor.errors import BadInput
from oomdoctor.memory.activations import layer_activations
from oomdoctor.memory.context import make_ctx
from oomdoctor.memory.saves import norm_saved
from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import Plan, validate

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=512,
)


def tiny(model_type: str, layers: int = 3, **kw) -> dict:
    """transformers' default config of ``model_type`` at a CPU test size."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type).to_dict()
    cfg.update(TINY, num_hidden_layers=layers, **kw)
    for k in ("layer_types", "layers_block_type"):
        if isinstance(cfg.get(k), list):
            cfg[k] = [cfg[k][i % len(cfg[k])] for i in range(layers)]
    return cfg


PLANS = {
    "lora bf16": dict(method="lora", precision="bf16"),
    "full bf16": dict(method="full", precision="bf16"),
    "full fp32": dict(method="full", precision="fp32"),
    "qlora bf16-mixed dropout": dict(method="qlora", precision="bf16-mixed", lora_dropout=0.1),
    # pure bf16 QLoRA without peft's k-bit upcast: bf16 norms and residual stream around the quantized linears
    "qlora nf4 bf16 no-upcast": dict(method="qlora", precision="bf16", kbit_upcast=False),
    # LLM.int8() keeps the output projection's input, which SDPA saved as its output already (+16 KiB per block
    # before: a bf16 input the fp32 adapter copies, or any input with dropout)
    "qlora int8 bf16 no-upcast": dict(method="qlora", quant="int8", precision="bf16", kbit_upcast=False),
    "qlora int8 bf16 dropout": dict(method="qlora", quant="int8", precision="bf16", lora_dropout=0.1),
}


@pytest.mark.parametrize("kw", PLANS.values(), ids=PLANS.keys())
def test_the_replay_measures_what_the_formulas_price_on_llama_blocks(tiny_config, kw):
    """Two independent mechanisms agree to the byte on the blocks the formulas were written for: the saved-tensor
    bytes of each replayed Llama block equal the formulas' ``saved`` (block 0: ``bottom``)."""
    spec = spec_from_config(dict(tiny_config, num_hidden_layers=3), name="tiny-llama")
    plan = validate(Plan(seq_len=128, **kw))
    measured = blocks.measure_block_bytes(spec, blocks.measured_plan(plan))
    c = make_ctx(spec, plan)
    la = layer_activations(c)
    assert measured.per_block == (la.bottom, la.saved, la.saved)
    assert measured.final == norm_saved(c, spec.hidden_size, plan.seq_len, c.rb)


#: Types without a hand builder: attention and residual dropout (seed_oss), the xIELU activation and QK-norms
#: (apertus, -6 % by the formulas at 1k tokens), parallel blocks with sliding windows (cohere2), hybrids with
#: convolution or state-space mixers (lfm2, mamba2: -69 % by the formulas).
NEW_TYPES = {
    "seed_oss": {},
    "apertus": {},
    "cohere2": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64},
    "lfm2": {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 16, "chunk_size": 64, "expand": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", NEW_TYPES)
@pytest.mark.parametrize("gc", [False, True], ids=["no-gc", "gc"])
def test_measured_blocks_put_the_analytic_engine_within_2_percent_of_simulate(model_type, gc):
    spec = spec_from_config(tiny(model_type, layers=4, **NEW_TYPES[model_type]), name=model_type)
    plan = validate(Plan(method="lora", precision="bf16", seq_len=256, micro_batch=2, gradient_checkpointing=gc))
    assert blocks.measures_blocks(spec, plan)
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.02 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)
    assert any("measured by replaying" in n for n in a.notes)


def test_the_k_bit_upcast_keys_a_measurement_where_it_changes_the_blocks():
    """peft's k-bit upcast makes a pure-bf16 quantized base's norms (and so its residual stream) fp32: two
    measurements; an fp32-loaded base (``*-mixed``, ``fp32``) has nothing to cast: one."""
    qlora = validate(Plan(method="qlora", precision="bf16", seq_len=100))
    assert blocks.measured_plan(qlora.with_(kbit_upcast=False)).kbit_upcast is False
    assert blocks.measured_plan(qlora).kbit_upcast is True
    mixed = qlora.with_(precision="bf16-mixed")
    assert blocks.measured_plan(mixed.with_(kbit_upcast=False)) == blocks.measured_plan(mixed)


def test_types_with_formulas_are_not_measured(tiny_config):
    llama = spec_from_config(dict(tiny_config), name="tiny-llama")
    bf16 = validate(Plan(method="lora", precision="bf16"))
    assert not blocks.measures_blocks(llama, bf16)  # hand builder
    moe = spec_from_config(tiny("olmoe", num_experts=4, num_experts_per_tok=2), name="olmoe")
    assert blocks.measures_blocks(moe, bf16)  # its experts replay in every precision (engines/routing)
    assert blocks.measures_blocks(moe, bf16.with_(precision="fp32"))
    assert blocks.measures_blocks(llama, bf16.with_(adapter_dtype="bf16"))  # the formulas follow fp32 adapters


def test_measurements_are_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    spec = spec_from_config(tiny("seed_oss"), name="seed_oss")
    plan = validate(Plan(method="lora", precision="bf16", seq_len=128))
    first = blocks.block_saves(spec, plan)
    [entry] = (tmp_path / "blocks").glob("*.json")
    doc = json.loads(entry.read_text())
    assert (doc["one"]["per_block"], doc["two"]["final"]) == (list(first.one.per_block), first.two.final)
    blocks._cached.cache_clear()

    def no_replay(*_a):
        raise AssertionError("replayed again")

    monkeypatch.setattr(blocks, "measure_saves", no_replay)
    monkeypatch.setattr(blocks, "measure_block_bytes", no_replay)
    # what does not change what a block saves shares the entry: batch, accumulation, optimizer
    assert blocks.block_saves(spec, plan.with_(micro_batch=4, grad_accum=2, optimizer="sgd")) == first
    # sequence lengths share the measurement at the next power of two (tune --seq-len max bisects over them)
    assert blocks.measured_seq_len(100) == 128 and blocks.measured_seq_len(128) == 128
    assert blocks.block_saves(spec, plan.with_(seq_len=100)) == first
    blocks._cached.cache_clear()
    entry.write_text("{not json")  # a damaged entry is measured again, never trusted
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert blocks.block_saves(spec, plan) == first
    blocks._cached.cache_clear()


def test_how_blocks_repeat_is_read_from_transformers_config():
    """Only block 0, what precedes the repetition and one repeating unit are replayed."""
    bf16 = validate(Plan(method="lora", precision="bf16"))
    jamba = spec_from_config(
        tiny(
            "jamba",
            layers=16,
            attn_layer_period=8,
            attn_layer_offset=4,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
        ),
        name="jamba",
    )
    assert kinds.replay_depth(jamba, bf16) == (0, 8)
    deepseek = spec_from_config(
        tiny(
            "deepseek_v3",
            layers=8,
            first_k_dense_replace=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        name="deepseek_v3",
    )
    assert kinds.replay_depth(deepseek, bf16) == (2, 1)  # three dense blocks, then MoE blocks
    cohere = spec_from_config(tiny("cohere2", layers=8, sliding_window_pattern=4), name="cohere2")
    assert kinds.replay_depth(cohere, bf16) == (0, 4)
    assert kinds.replay_plan([("a",), ("b",), ("c",)]) == (3, 0)  # nothing repeats: every block
    assert blocks.extend((1, 2, 3), 0, 2, 6) == (1, 2, 3, 2, 3, 2)
    assert blocks.extend((1, 1, 1, 5), 2, 1, 6) == (1, 1, 1, 5, 5, 5)


def _all_linear_leaves_out(spec, plan, name: str) -> None:
    """The adapters peft puts on the executor's model are the ones priced, and none is on ``name``."""
    from oomdoctor.execute.build import build_model
    from oomdoctor.model.lora_targets import lora_groups_of

    priced = {g.name for g in lora_groups_of(spec, plan)}
    assert priced and name not in priced
    model = build_model(spec, plan, device="meta").model
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if n.endswith("lora_A.default.weight")}
    assert adapted == priced


def test_mamba_all_linear_leaves_out_what_peft_refuses():
    """peft refuses LoRA on the Mamba mixers' out_proj/conv1d (``_check_lora_target_modules_mamba``), also through
    all-linear: the executor leaves them out and prices what it runs; naming them is one message."""
    spec = spec_from_config(tiny("mamba2", layers=2, **NEW_TYPES["mamba2"]), name="mamba2")
    plan = validate(Plan(method="lora", precision="bf16", seq_len=64))
    _all_linear_leaves_out(spec, plan, "out_proj")
    with pytest.raises(BadInput, match="out_proj"):
        estimate(spec, plan.with_(lora_targets=("in_proj", "out_proj")))


def test_llama4_all_linear_leaves_out_its_tuple_returning_router():
    """Llama 4's router is an nn.Linear subclass returning a tuple, which peft's LoRA forward cannot add to: the
    executor's all-linear leaves it out (and prices what it runs); its own experts code takes no kernel choice."""
    spec = spec_from_config(
        tiny("llama4_text", layers=2, num_local_experts=4, intermediate_size_mlp=128, moe_layers=[0, 1]),
        name="llama4_text",
    )
    plan = validate(Plan(method="lora", precision="bf16", seq_len=64))
    _all_linear_leaves_out(spec, plan, "router")
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.02 * s.peak_allocated


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch, seq_len", [(4, 256), (1, 300)])
def test_weight_sized_bytes_do_not_scale_with_the_tokens(micro_batch, seq_len):
    """Measured at micro-batch 1 and 2: peft's merged expert weights W' (and a full fine-tune's block gradients)
    are the same for any batch; the tokens' share scales (OLMoE-shaped LoRA on 32 wide experts: +29 % at
    micro-batch 4 and -14 % at 300 tokens when everything was scaled)."""
    spec = spec_from_config(
        tiny("olmoe", layers=4, num_experts=32, num_experts_per_tok=2, intermediate_size=256), name="olmoe"
    )
    plan = validate(Plan(method="lora", precision="bf16", seq_len=seq_len, micro_batch=micro_batch))
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.003 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, precision, gc",
    [("lora", "bf16", False), ("lora", "fp32", True), ("qlora", "bf16-mixed", True), ("qlora", "bf16", False)],
)
def test_bf16_adapters_are_priced_from_a_measurement(tiny_config, method, precision, gc):
    """``adapter_dtype: bf16`` (TRL's QLoRA recipe): bf16 adapters, gradients and AdamW states (2 B each), and the
    blocks measured (the formulas follow peft's fp32 adapters and their input copies)."""
    from oomdoctor.memory.context import make_ctx

    spec = spec_from_config(dict(tiny_config, num_hidden_layers=4), name="tiny-llama")
    plan = validate(
        Plan(
            method=method,
            precision=precision,
            seq_len=256,
            micro_batch=2,
            gradient_checkpointing=gc,
            adapter_dtype="bf16",
        )
    )
    assert blocks.measures_blocks(spec, plan) and not blocks.measures_blocks(spec, plan.with_(adapter_dtype="fp32"))
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert a.adapters == 2 * make_ctx(spec, plan).lora_numel <= s.adapters  # the replay rounds to 512-byte blocks
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.015 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)


def test_bf16_adapters_replay_equals_the_real_cpu_step(tiny_config):
    from oomdoctor.engines.simulate import real_cpu_run, simulate_run

    spec = spec_from_config(dict(tiny_config), name="tiny-llama")
    plan = validate(Plan(method="lora", precision="bf16", seq_len=64, micro_batch=2, adapter_dtype="bf16"))
    assert simulate_run(spec, plan, round_to=1).peak == real_cpu_run(spec, plan, round_to=1).peak


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, precision, gc", [("lora", "fp32", True), ("full", "bf16-mixed", True), ("qlora", "bf16-mixed", False)]
)
def test_eager_experts_of_a_measured_type_are_measured(method, precision, gc):
    """OLMoE's eager experts (fp32 weights, autocast, QLoRA) replay under a balanced router (engines/routing)."""
    spec = spec_from_config(tiny("olmoe", layers=4, num_experts=8, num_experts_per_tok=2), name="olmoe")
    plan = validate(Plan(method=method, precision=precision, seq_len=512, gradient_checkpointing=gc))
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert any("measured by replaying" in n for n in a.notes)
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.02 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)


@pytest.mark.heavy  # Jamba's measurement itself: test_blocks_that_loop_over_the_tokens_are_measured...
def test_a_measured_blocks_own_gradients_are_not_counted_twice():
    """Jamba: a measured block's backward transient holds the weight gradients it makes, which the bottom moment
    counted as made too — an MoE block's far more than the average block's (+0.93 % here, a Mamba + MLP and a
    Mamba + MoE block; +3.2 % at the default config's width: scripts/blocks_vs_simulate.py)."""
    spec = spec_from_config(tiny("jamba", layers=2), name="jamba")
    plan = validate(Plan(method="full", precision="bf16", seq_len=256, micro_batch=2, gradient_checkpointing=True))
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert any("measured by replaying" in n for n in a.notes)
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.005 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)


def test_a_wide_block_low_in_the_stack_peaks_with_fewer_saves_alive():
    """DeepSeek-style dense first blocks: block 0's forward peak holds only block 0's saves."""
    assert blocks.forward_over_saves((10, 20, 20), (100, 5, 5)) == 60  # block 0: 10 + 100 - 50
    assert blocks.forward_over_saves((10, 20, 20), (1, 5, 7)) == 7  # the last block: every save + its transient
    assert blocks.forward_over_saves((10, 20, 20), (0, 0, 0)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("model_type, gc", [("seed_oss", False), ("exaone4", True)])
def test_int8_inputs_kept_on_the_autograd_context_are_measured(model_type, gc):
    """bitsandbytes' int8 matmul keeps its input as ``ctx`` state, not through save_for_backward, so saved-tensor
    hooks miss it (Seed-OSS int8 QLoRA without GC: -14.9 % before); in post-norm blocks (EXAONE 4, OLMo 2/3) the
    attention's input is the block input, which checkpointing keeps anyway (+7 % before)."""
    spec = spec_from_config(tiny(model_type, layers=4), name=model_type)
    plan = validate(
        Plan(
            method="qlora", quant="int8", precision="bf16-mixed", seq_len=256, micro_batch=2, gradient_checkpointing=gc
        )
    )
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.01 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)


@pytest.mark.parametrize(
    "model_type, layers, kw",
    [
        ("cohere2", 8, {"layer_types": ["sliding_attention"] * 3 + ["full_attention"], "sliding_window": 64}),
        ("gemma3_text", 13, {"sliding_window": 64}),
    ],
)
def test_one_block_of_each_kind_measures_what_every_block_measures(model_type, layers, kw):
    """Only block 0 and the first block of each kind run (the others pass their input through): the bytes are
    those of replaying every block, to the byte (cohere2 replays 5 blocks, 3 run; Gemma 3 7, 3 run)."""
    spec = spec_from_config(tiny(model_type, layers=layers, **kw), name=model_type)
    plan = blocks.measured_plan(validate(Plan(method="lora", precision="bf16", seq_len=128)))
    kinds_ = kinds.layer_kinds(spec, plan)
    q, p = kinds.replay_plan(kinds_)
    assert p and len(set(blocks.representatives(kinds_, q + p + 1))) == 3
    saves = blocks.measure_saves(spec, plan)
    assert saves.one == blocks.measure_block_bytes(spec, plan)
    assert saves.two == blocks.measure_block_bytes(spec, plan.with_(micro_batch=2))


#: A Jamba cut to its 9 replayed blocks: Mamba mixers (with MoE every other block) and one attention block.
JAMBA = dict(
    layers=9, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1, num_experts=4
)


def test_jambas_block_kinds_are_transformers_layer_types():
    """Jamba's periods mark the attention and MoE blocks ``i % period == offset`` (JambaConfig.layers_block_type,
    layers_num_experts): four kinds run of the nine replayed blocks."""
    spec = spec_from_config(tiny("jamba", **JAMBA), name="jamba")
    plan = validate(Plan(method="lora", precision="bf16"))
    kinds_ = kinds.layer_kinds(spec, plan)
    assert len(set(kinds_)) == 3  # Mamba + MLP, Mamba + MoE, attention + MLP
    assert blocks.representatives(kinds_, 9) == (0, 1, 2, 1, 4, 1, 2, 1, 2)


#: The same at a wider width: a Mamba step's per-token state dwarfs the tensors under the allocator's 512 bytes.
WIDE = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=64)
#: Jamba's three kinds (Mamba + MLP, Mamba + MoE, attention + MLP) in three blocks: the reference replays its two
#: Mamba blocks token by token.
JAMBA_3 = dict(
    layers=3, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=4
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, kw, plan_kw",
    [
        ("jamba", dict(JAMBA_3, mamba_dt_rank=64, **WIDE), dict(method="lora", precision="bf16", seq_len=256)),
        (
            "jamba",
            dict(JAMBA_3, mamba_dt_rank=64, **WIDE),
            dict(method="qlora", quant="int8", precision="bf16-mixed", gradient_checkpointing=True, seq_len=256),
        ),
        (
            "jamba",
            dict(JAMBA, mamba_dt_rank=64, **dict(WIDE, layers=2)),
            dict(method="qlora", quant="nf4", precision="bf16-mixed", seq_len=1024),
        ),
    ],
)
def test_blocks_that_loop_over_the_tokens_are_measured_on_short_sequences(model_type, kw, plan_kw):
    """Mamba mixers loop over the tokens in Python: run on the plan's tokens cut into sequences of 8 and 16 tokens
    (and on twice as many sequences of 8), what they hold at the plan's length is what replaying them token by token
    measures — what they save and their backward peak within 0.1 %, their forward peak within 2 % (int8 with
    checkpointing at micro-batch 2: -1.6 %, the per-sequence scan state of many short sequences peaking where the
    plan's two long ones peak elsewhere; the QLoRA plan's 2 x 1,024 tokens cross bitsandbytes' 1,536-row kernel
    switch as the plan's do) — in a fraction of the time (benchmarks/cold_diagnose.py)."""
    spec = spec_from_config(tiny(model_type, **kw), name=model_type)
    plan = blocks.measured_plan(validate(Plan(**plan_kw)))
    fast = blocks.measure_saves(spec, plan)
    ref = (blocks.measure_block_bytes(spec, plan), blocks.measure_block_bytes(spec, plan.with_(micro_batch=2)))
    assert blocks._LOOPING[json.dumps([spec.config, spec.num_layers, True], sort_keys=True, default=str)]
    for got, want in zip((fast.one, fast.two), ref):
        for a, b, tolerance in [
            (sum(got.per_block), sum(want.per_block), 0.001),
            (got.final, want.final, 0.001),
            (got.forward_transient, want.forward_transient, 0.02),
            (got.backward_transient, want.backward_transient, 0.001),
            (got.backward_over_gradients, want.backward_over_gradients, 0.001),
        ]:
            assert abs(a - b) <= tolerance * b, (got, want)


def test_a_measurement_reports_its_runs_once():
    """Each replay run of a cold measurement is reported (``oomdoctor.progress``, task ``blocks``: the CLI draws it on
    stderr), numbered against the runs it makes; a cached measurement is silent."""
    from oomdoctor.progress import listening

    spec = spec_from_config(tiny("seed_oss", layers=2), name="seed_oss")
    plan = validate(Plan(method="lora", precision="bf16", seq_len=64, lora_r=4))
    heard: list = []
    with listening(heard.append):
        estimate(spec, plan)
        estimate(spec, plan.with_(micro_batch=2))
    assert {(p.task, p.message) for p in heard} == {
        ("blocks", "measuring what seed_oss blocks save under lora bf16 at 64 tokens (once: cached)")
    }
    assert [(p.step, p.steps) for p in heard] == [(1, 2), (2, 2)]
