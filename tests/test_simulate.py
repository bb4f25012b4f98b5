"""Simulated engine: the fake-tensor replay equals a real CPU step's counted bytes; extrapolation; breakdown contract."""

from __future__ import annotations

import pytest
from plans import Plan  # the settings these tolerances were measured with

from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import validate

SEQ = 32


def _spec(cfg, layers=None, **over):
    c = dict(cfg, **over)
    if layers is not None:
        c["num_hidden_layers"] = layers
    return spec_from_config(c, name="tiny-llama")


def _same(spec, plan, **kw):
    from oomdoctor.engines.simulate import real_cpu_run, simulate_run

    plan = validate(plan)
    fake = simulate_run(spec, plan, **kw)
    real = real_cpu_run(spec, plan, **kw)
    assert fake.phase_peaks == real.phase_peaks, (fake.phase_peaks, real.phase_peaks)
    assert fake.step_peaks == real.step_peaks
    assert fake.phase_categories == real.phase_categories
    assert fake.external == real.external
    return fake


@pytest.mark.parametrize(
    "plan",
    [
        Plan(method="full", seq_len=SEQ, micro_batch=2),
        pytest.param(
            Plan(method="full", seq_len=SEQ, gradient_checkpointing=True, attn="eager"), marks=pytest.mark.slow
        ),
        Plan(method="lora", seq_len=SEQ, micro_batch=2),
        pytest.param(
            Plan(method="lora", seq_len=SEQ, gradient_checkpointing=True, precision="fp16-mixed"),
            marks=pytest.mark.slow,
        ),
        Plan(method="qlora", quant="nf4", double_quant=True, seq_len=SEQ, gradient_checkpointing=True),
        pytest.param(Plan(method="qlora", quant="int8", seq_len=SEQ), marks=pytest.mark.slow),
        pytest.param(
            Plan(method="full", precision="bf16", optimizer="adamw-8bit", seq_len=SEQ), marks=pytest.mark.slow
        ),
        pytest.param(Plan(method="full", precision="fp32", optimizer="adafactor", seq_len=SEQ), marks=pytest.mark.slow),
        pytest.param(
            Plan(method="full", seq_len=SEQ, offload_optimizer=True, offload_activations=True), marks=pytest.mark.slow
        ),
        pytest.param(Plan(method="full", precision="fp32", seq_len=SEQ, grad_accum=2), marks=pytest.mark.slow),
        pytest.param(Plan(method="lora", seq_len=SEQ, grad_accum=4, offload_activations=True), marks=pytest.mark.slow),
    ],
    ids=lambda p: (
        (p.label() + (f" | accum {p.grad_accum}" if p.grad_accum > 1 else "")) if hasattr(p, "label") else str(p)
    ),
)
def test_fake_replay_equals_real_cpu_step(tiny_config, plan):
    """(a) the simulated step counts exactly the bytes the same step allocates on real CPU tensors."""
    r = _same(_spec(tiny_config), plan)
    assert r.peak > 0 and sum(r.peak_categories.values()) == r.peak


def test_tied_embeddings_stay_tied(tiny_config):
    """to_empty unties shared weights; the replay re-ties them (else the head is counted twice)."""
    r = _same(_spec(tiny_config, tie_word_embeddings=True), Plan(method="full", seq_len=SEQ))
    from oomdoctor.engines.simulate import simulate_run

    untied = simulate_run(_spec(tiny_config), validate(Plan(method="full", seq_len=SEQ)))
    assert r.param_bytes < untied.param_bytes


@pytest.mark.slow
def test_qlora_real_bitsandbytes_model_step_matches_standin(tiny_config, tmp_path):
    """A real bnb 4-bit model (loaded on CPU) trained one LoRA step counts the same bytes as the stand-in replay
    (with bnb's fused op, as on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from oomdoctor.engines.simulate import real_cpu_run, simulate_run
    from oomdoctor.execute.build import apply_plan_techniques, hf_config, lora_targets_of_model

    spec = _spec(tiny_config)
    plan = validate(Plan(method="qlora", quant="nf4", double_quant=True, seq_len=SEQ, lora_dropout=0.0))
    src = AutoModelForCausalLM.from_config(hf_config(spec, plan), dtype=torch.float32)
    src.save_pretrained(tmp_path)
    q = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.uint8,
        ),
        device_map="cpu",
        dtype=torch.float32,
    )
    # bnb keeps quant_state.dtype = load dtype (fp32 here); the stand-in uses the compute dtype: align them
    for m in q.modules():
        w = getattr(m, "weight", None)
        if getattr(w, "quant_state", None) is not None:
            w.quant_state.dtype = torch.bfloat16
    model = apply_plan_techniques(q, plan, lora_targets_of_model(q, plan))
    # the real model's quant_state tensors are not module buffers: register them like parameters
    extra = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            extra += [qs.absmax, qs.code, qs.offset]
            if qs.state2 is not None:
                extra += [qs.state2.absmax, qs.state2.code]
    from oomdoctor.engines import simulate as sim
    from oomdoctor.execute.tracking import LiveBytes

    orig = LiveBytes.track_module

    def track_module(self, mdl, optimizer=None, **kw):
        orig(self, mdl, optimizer, **kw)
        self.track_existing([t for t in extra if t is not None], "parameters")

    LiveBytes.track_module = track_module
    try:
        real = real_cpu_run(spec, plan, model=model, head=q.lm_head, bnb_decompose=False)
    finally:
        LiveBytes.track_module = orig
    fake = simulate_run(spec, plan, bnb_decompose=False)
    assert fake.param_bytes == real.param_bytes
    assert fake.phase_peaks == real.phase_peaks
    assert fake.phase_categories == real.phase_categories
    _ = sim


def test_decomposed_4bit_counts_the_cuda_dequantize_temporary():
    """Above 1536 rows bnb's CUDA gemm_4bit dequantizes the weight to the compute dtype inside the op: the default
    stand-in issues it as its own op, so the dequantized weight is counted; the fused path (as on CPU) hides it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.execute.bnb_standin import standin_classes
    from oomdoctor.execute.tracking import LiveBytes

    L4, _ = standin_classes()
    peaks = {}
    for decompose in (True, False):
        lin = L4(
            1024,
            512,
            False,
            compute_dtype=torch.bfloat16,
            quant_type="nf4",
            double_quant=False,
            quant_dtype=torch.bfloat16,
            decompose=decompose,
        )
        with FakeTensorMode(allow_non_fake_inputs=True):
            lin.to_empty(device="cpu")
            x = torch.empty(1600, 1024, dtype=torch.bfloat16, requires_grad=True)
            with LiveBytes(round_to=1) as lb:
                lin(x)
            peaks[decompose] = lb.peak
    assert peaks[True] - peaks[False] == 512 * 1024 * 2  # the bf16 dequantized weight


@pytest.mark.slow
def test_extrapolation_matches_full_simulation(tiny_config):
    """Simulating 2 and 3 blocks and extrapolating equals simulating all blocks."""
    from oomdoctor.engines.simulate import simulate_plan

    spec = _spec(tiny_config, layers=5)
    for plan in (
        Plan(method="full", seq_len=SEQ),
        Plan(method="qlora", seq_len=SEQ, optimizer="paged-adamw-8bit", gradient_checkpointing=True),
    ):
        ex = simulate_plan(spec, plan)
        full = simulate_plan(spec, plan, layers="full")
        assert ex.extrapolated and not full.extrapolated
        assert ex.layers_simulated == (2, 3) and full.layers_simulated == (5,)
        assert ex.breakdown.peak_allocated == full.breakdown.peak_allocated
        assert ex.phase_peaks == full.phase_peaks
        assert ex.breakdown.to_dict() == full.breakdown.to_dict() | {"notes": ex.breakdown.to_dict()["notes"]}


@pytest.mark.slow
def test_extrapolation_finds_the_tied_gradient_sum_at_the_end_of_backward(tiny_config):
    """A head tied to a large embedding: at 2 and 3 blocks the loss sets the backward peak, at 8 the end of backward
    does (every gradient, the shared weight's two gradients and their sum): the tail of backward, from the input
    embedding's backward on, is a moment of its own in the extrapolation (Llama-3.2-1B full bf16 + GC was -1.8 %)."""
    from oomdoctor.engines.simulate import simulate_plan

    spec = _spec(
        dict(
            tiny_config,
            hidden_size=512,
            intermediate_size=2048,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=8192,
            tie_word_embeddings=True,
        ),
        layers=8,
    )
    plan = Plan(method="full", precision="bf16", seq_len=512, gradient_checkpointing=True)
    ex, full = simulate_plan(spec, plan), simulate_plan(spec, plan, layers="full")
    assert ex.extrapolated
    assert ex.phase_peaks["backward"] == full.phase_peaks["backward"]
    assert ex.breakdown.peak_allocated == full.breakdown.peak_allocated


def test_breakdown_contract_and_estimate_entry_point(tiny_spec):
    from oomdoctor.engines import estimate
    from oomdoctor.memory.breakdown import TENSOR_COMPONENTS

    bd = estimate(tiny_spec, validate(Plan(method="lora", seq_len=SEQ)), "simulate")
    assert bd.engine == "simulate"
    assert sum(getattr(bd, c) for c in TENSOR_COMPONENTS) == bd.peak_allocated
    assert bd.peak_reserved >= bd.peak_allocated and bd.peak_device > bd.peak_reserved
    assert set(bd.phases) == {"forward", "backward", "optimizer-step"}
    assert bd.phases[bd.peak_phase] == bd.peak_allocated
    assert 0 < bd.adapters < bd.parameters
    d = bd.to_dict()
    assert d["peak_allocated_bytes"] == bd.peak_allocated


@pytest.mark.slow
def test_optimizer_state_bytes(tiny_spec):
    """Optimizer state at steady state, per optimizer, for a LoRA plan (trainable numel known)."""
    from oomdoctor.engines.simulate import simulate_plan

    base = Plan(method="lora", seq_len=SEQ, lora_dropout=0.0)
    got = {}
    for opt in ("adamw", "sgd", "lion", "adafactor", "adamw-8bit"):
        r = simulate_plan(tiny_spec, base.with_(optimizer=opt))
        got[opt] = r.phase_categories["optimizer-step"]["optimizer_states"]
    got["sgd-momentum"] = simulate_plan(tiny_spec, base.with_(optimizer="sgd", sgd_momentum=0.9)).phase_categories[
        "optimizer-step"
    ]["optimizer_states"]
    assert got["sgd"] == 0
    assert got["adamw"] == 2 * got["sgd-momentum"] == 2 * got["lion"]
    assert 0 < got["adafactor"] < got["lion"]


def test_offloaded_optimizer_state_is_host_memory(tiny_spec):
    from oomdoctor.engines.simulate import simulate_plan

    on = simulate_plan(tiny_spec, validate(Plan(seq_len=SEQ)))
    off = simulate_plan(tiny_spec, validate(Plan(seq_len=SEQ, offload_optimizer=True)))
    assert off.breakdown.optimizer_states == 0
    # host bytes are not rounded to allocator blocks
    assert off.breakdown.cpu_offloaded >= 0.99 * on.phase_categories["optimizer-step"]["optimizer_states"]
    assert off.breakdown.peak_allocated < on.breakdown.peak_allocated


def test_paged_optimizer_state_is_device_not_allocated(tiny_config):
    from oomdoctor.engines.simulate import simulate_plan

    spec = _spec(tiny_config, hidden_size=512, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8)
    plain = simulate_plan(spec, validate(Plan(seq_len=SEQ, optimizer="adamw", optimizer_impl="for-loop")))
    paged = simulate_plan(spec, validate(Plan(seq_len=SEQ, optimizer="paged-adamw")))
    assert paged.breakdown.paged_optimizer > 0
    assert paged.breakdown.optimizer_states < plain.breakdown.optimizer_states
    assert paged.breakdown.peak_device - paged.breakdown.peak_reserved >= paged.breakdown.paged_optimizer


def test_timeline_for_plots(tiny_spec):
    from oomdoctor.engines.simulate import simulate_plan

    r = simulate_plan(tiny_spec, validate(Plan(seq_len=SEQ)), timeline=True)
    assert r.timeline
    ev, phase, cats = r.timeline[0]
    assert isinstance(ev, int) and isinstance(cats, dict)
    assert {p for _, p, _ in r.timeline} >= {"forward", "backward", "optimizer-step"}
    assert max(sum(c.values()) for _, _, c in r.timeline) == r.breakdown.peak_allocated


@pytest.mark.heavy  # extrapolation itself: test_extrapolation_matches_full_simulation
def test_periodic_blocks_extrapolate_by_period():
    """Gemma 2 alternates sliding-window and global attention: extrapolate in whole periods (2 blocks)."""
    from oomdoctor.engines.kinds import layer_period
    from oomdoctor.engines.simulate import simulate_plan

    cfg = {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "sliding_window": 16,
        "query_pre_attn_scalar": 16,
    }
    spec = spec_from_config(cfg, name="tiny-gemma2")
    plan = validate(Plan(method="lora", seq_len=SEQ))
    assert layer_period(spec, plan) == 2
    ex = simulate_plan(spec, plan)
    full = simulate_plan(spec, plan, layers="full")
    assert ex.layers_simulated == (4, 6) and full.layers_simulated == (10,)
    assert ex.phase_peaks == full.phase_peaks


def test_grad_accum_runs_micro_batches_with_gradients_alive(tiny_spec):
    """grad_accum >= 2: the 2nd micro-batch's forward runs with every gradient allocated (accumulated in place);
    later micro-batches are identical, so grad_accum 2 and 8 price the same step."""
    from oomdoctor.engines.simulate import simulate_plan

    plan = Plan(method="full", precision="fp32", seq_len=SEQ)
    one = simulate_plan(tiny_spec, validate(plan))
    two = simulate_plan(tiny_spec, validate(plan.with_(grad_accum=2)))
    eight = simulate_plan(tiny_spec, validate(plan.with_(grad_accum=8)))
    grads = one.phase_categories["optimizer-step"]["gradients"]
    assert grads > 0
    assert one.phase_categories["forward"]["gradients"] == 0
    assert two.phase_categories["forward"]["gradients"] == grads
    assert two.phase_peaks["forward"] >= one.phase_peaks["forward"] + grads
    assert eight.phase_peaks == two.phase_peaks


def test_attention_dropout_replays_as_the_cuda_kernel_keeping_every_other_argument():
    """SDPA with dropout runs without it in the replay (CUDA's kernels drop inside, saving no scores); arguments after
    dropout_p, positional or not, still apply (a causal call stays causal)."""
    import torch

    from oomdoctor.engines.replay import cuda_policy_mode_cls

    q = torch.randn(1, 2, 8, 4)
    causal = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with cuda_policy_mode_cls()():
        positional = torch.nn.functional.scaled_dot_product_attention(q, q, q, None, 0.5, True)
        keywords = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5, is_causal=True)
    assert torch.equal(positional, causal) and torch.equal(keywords, causal)
