"""Each analytic component formula against values computed by hand on a tiny spec.

Tiny Llama: hidden 64, 2 layers, intermediate 128, 4 heads x 16 (no GQA), vocab 256, untied head.
Linear weights per layer: q,k,v,o 64x64 = 4096 each; gate, up, down 64x128 = 8192 each.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from oomdoctor.memory import activations as act
from oomdoctor.memory import gradients as grads
from oomdoctor.memory import logits as lgt
from oomdoctor.memory import optimizer as optm
from oomdoctor.memory import parameters as prm
from oomdoctor.memory import runtime as rt
from oomdoctor.memory.analytic import estimate_analytic
from oomdoctor.memory.breakdown import TENSOR_COMPONENTS
from oomdoctor.memory.context import make_ctx
from oomdoctor.model.architectures import build_spec
from oomdoctor.plan import Plan, validate

H, L, I, NH, HD, V = 64, 2, 128, 4, 16, 256
TINY_CFG = dict(
    model_type="llama",
    hidden_size=H,
    num_hidden_layers=L,
    intermediate_size=I,
    num_attention_heads=NH,
    num_key_value_heads=NH,
    vocab_size=V,
    tie_word_embeddings=False,
)
#: numel: embed 16384 + per layer (4*4096 + 3*8192 + 2*64) * 2 + final norm 64 + head 16384
LINEAR_PER_LAYER = 4 * 4096 + 3 * 8192
NUMEL = 16384 + (LINEAR_PER_LAYER + 128) * L + 64 + 16384


@pytest.fixture(scope="module")
def spec():
    return build_spec(TINY_CFG, "tiny")


def ctx(spec, **kw):
    """A plan on ``spec``; the expectations below were written for bf16-mixed with foreach AdamW."""
    return make_ctx(spec, validate(Plan(**{"precision": "bf16-mixed", "optimizer_impl": "foreach", **kw})))


def test_spec_numel_is_what_the_hand_count_says(spec):
    assert spec.num_params == NUMEL


# ------------------------------------------------------------------ parameters / quantization


def test_nf4_bytes_are_packed_half_plus_fp32_absmax_per_64():
    n = 4096
    assert prm.nf4_weight_bytes(n) == n // 2 + (n // 64) * 4 + prm.NF4_CODE_BYTES


def test_double_quant_is_uint8_absmax_plus_fp32_per_256_blocks_and_saves_037_bit():
    n = 4096
    assert prm.nf4_weight_bytes(n, True) == n // 2 + n // 64 + 1 * 4 + prm.NF4_CODE_BYTES + prm.DQ_CODE_BYTES
    big = 2**24
    saved_bits = (prm.nf4_weight_bytes(big) - prm.nf4_weight_bytes(big, True)) * 8 / big
    assert 0.36 < saved_bits < 0.38  # QLoRA paper: 0.373 bit per parameter


def test_int8_is_one_byte_plus_fp32_row_scale():
    assert prm.int8_weight_bytes(64 * 128, 128) == 64 * 128 + 4 * 128


def test_weight_bytes_by_precision(spec):
    assert prm.parameter_bytes(ctx(spec, method="full", precision="fp32")) == 4 * NUMEL
    assert prm.parameter_bytes(ctx(spec, method="full", precision="bf16-mixed")) == 4 * NUMEL  # fp32 master
    assert prm.parameter_bytes(ctx(spec, method="full", precision="bf16")) == 2 * NUMEL


def test_qlora_quantizes_layer_linears_but_not_head_embeddings_norms(spec):
    c = ctx(spec, method="qlora", precision="bf16", lora_targets=("q_proj",), lora_r=8)
    quant = 2 * (4 * prm.nf4_weight_bytes(4096) + 3 * prm.nf4_weight_bytes(8192))
    rest = (16384 + 16384 + 2 * 128 + 64) * 4  # embed, head, norms: upcast to fp32 by prepare_model_for_kbit_training
    adapters = 8 * (64 + 64) * 2 * 4  # q_proj adapters in both layers, fp32
    assert prm.parameter_bytes(c) == quant + rest + adapters
    c8 = ctx(spec, method="qlora", quant="int8", precision="bf16", lora_targets=("q_proj",), lora_r=8)
    q8 = 2 * (4 * (4096 + 4 * 64) + 2 * (8192 + 4 * 128) + (8192 + 4 * 64))
    assert prm.parameter_bytes(c8) == q8 + rest + adapters


def test_amp_copies_only_under_autocast(spec):
    assert prm.amp_weight_copy_bytes(ctx(spec, method="full", precision="bf16")) == 0
    # full bf16-mixed: 2 bytes per linear weight incl. the head
    assert prm.amp_weight_copy_bytes(ctx(spec, method="full")) == 2 * (LINEAR_PER_LAYER * L + 16384)


# ------------------------------------------------------------------ LoRA


def test_lora_param_count_all_linear_vs_qv_vs_head(spec):
    r = 8
    per_layer_all = 4 * r * (64 + 64) + 3 * r * (64 + 128)
    assert ctx(spec, method="lora", lora_r=r).lora_numel == per_layer_all * L
    assert ctx(spec, method="lora", lora_r=r, lora_targets=("q_proj", "v_proj")).lora_numel == 2 * r * 128 * L
    on_head = ctx(spec, method="lora", lora_r=r, lora_on_head=True).lora_numel
    assert on_head == per_layer_all * L + r * (64 + V)


def test_lora_adapters_are_fp32_even_on_a_bf16_base(spec):
    c = ctx(spec, method="lora", precision="bf16", lora_r=8)
    assert grads.gradient_bytes(c) == c.lora_numel * 4


# ------------------------------------------------------------------ gradients / optimizer


def test_gradients_trainable_only(spec):
    assert grads.gradient_bytes(ctx(spec, method="full", precision="fp32")) == 4 * NUMEL
    assert grads.gradient_bytes(ctx(spec, method="full", precision="bf16")) == 2 * NUMEL
    c = ctx(spec, method="lora", lora_r=4)
    assert grads.gradient_bytes(c) == 4 * c.lora_numel


def test_adamw_two_states_in_param_dtype_and_foreach_vs_fused_temporaries(spec):
    foreach = optm.optimizer_memory(ctx(spec, method="full", precision="bf16"))
    assert foreach.device == 2 * 2 * NUMEL
    assert foreach.temporaries == 2 * NUMEL  # _foreach_sqrt(exp_avg_sqs): one copy of the group
    fused = optm.optimizer_memory(ctx(spec, method="full", precision="bf16", optimizer_impl="fused"))
    assert fused.temporaries == 0
    n_tensors = 1 + 9 * L + 1 + 1  # embed, 7 linears + 2 norms per layer, final norm, head
    assert fused.device == 2 * 2 * NUMEL + 4 * n_tensors  # + device step counters


def test_8bit_adam_uint8_states_plus_fp32_absmax_per_256(spec):
    om = optm.optimizer_memory(ctx(spec, method="full", precision="bf16", optimizer="adamw-8bit"))
    sizes = [16384, 16384] + [4096] * 4 * L + [8192] * 3 * L  # >= 4096 elements: 8-bit
    small = [64] * (2 * L + 1)  # norms: < min_8bit_size -> fp32 states
    expect = sum(2 * n + 2 * 4 * (-(-n // 256)) for n in sizes) + sum(2 * 4 * n for n in small)
    assert om.device == expect and om.paged == 0 and om.temporaries == 0


def test_adafactor_factored_row_and_column_second_moments(spec):
    om = optm.optimizer_memory(ctx(spec, method="full", precision="fp32", optimizer="adafactor"))
    fact = 2 * (64 + 256) + 4 * L * (64 + 64) + 3 * L * (128 + 64)  # embed/head, q/k/v/o, gate/up/down
    vec = (2 * L + 1) * 64  # norms: full second moment
    assert om.device == 4 * (fact + vec)


def test_lion_one_fp32_state_and_sgd_momentum(spec):
    assert optm.optimizer_memory(ctx(spec, method="full", precision="bf16", optimizer="lion")).device == 4 * NUMEL
    assert optm.optimizer_memory(ctx(spec, method="full", precision="bf16", optimizer="sgd")).device == 0
    sgdm = optm.optimizer_memory(ctx(spec, method="full", precision="bf16", optimizer="sgd", sgd_momentum=0.9))
    assert sgdm.device == 2 * NUMEL and sgdm.temporaries == 0


def test_paged_optimizer_goes_to_peak_device_not_peak_allocated():
    big = build_spec(dict(TINY_CFG, hidden_size=512, intermediate_size=1024, num_attention_heads=8), "big")
    plan = validate(Plan(method="full", precision="bf16", optimizer="paged-adamw-8bit", seq_len=64))
    plain = validate(Plan(method="full", precision="bf16", optimizer="adamw-8bit", seq_len=64))
    e, e0 = estimate_analytic(big, plan), estimate_analytic(big, plain)
    assert e.paged_optimizer > 0
    assert e.optimizer_states + e.paged_optimizer == e0.optimizer_states
    assert e.peak_allocated < e0.peak_allocated
    assert e.peak_device == e.peak_reserved + e.cuda_context + e.paged_optimizer


def test_offload_optimizer_moves_states_to_cpu(spec):
    e = estimate_analytic(
        spec, validate(Plan(method="full", precision="bf16", offload_optimizer=True, optimizer_impl="foreach"))
    )
    assert e.optimizer_states == 0 and e.cpu_offloaded == 2 * 2 * NUMEL


# ------------------------------------------------------------------ activations


def test_per_layer_activations_full_bf16_sdpa_by_hand(spec):
    c = ctx(spec, method="full", precision="bf16", micro_batch=2, seq_len=32)
    T = 64
    norms = 2 * (4 * H + 4 + 2 * H)  # fp32 input copy, rsqrt, bf16 normalized y (weight trains)
    attn = 2 * H + 2 * (3 * H) + 2 * H + 4 * NH  # normed input, q/k/v, output, fp32 logsumexp (per token)
    mlp = 2 * H + 3 * 2 * I + 2 * I  # normed input, gate/act/up, product
    assert act.layer_activations(c).saved == T * (norms + attn + mlp)


def test_eager_adds_seq_squared_probabilities(spec):
    for S in (32, 64):
        sd = act.layer_activations(ctx(spec, method="full", precision="bf16", micro_batch=2, seq_len=S)).saved
        ea = act.layer_activations(
            ctx(spec, method="full", precision="bf16", attn="eager", micro_batch=2, seq_len=S)
        ).saved
        # fp32 softmax + bf16 cast of B x heads x S x S, minus SDPA's logsumexp
        assert ea - sd == (4 + 2) * 2 * NH * S * S - 4 * 2 * NH * S
    e = lambda S, a: estimate_analytic(spec, validate(Plan(precision="bf16", attn=a, seq_len=S))).activations  # noqa: E731 - a one-line local helper
    growth_eager = (e(2048, "eager") - e(1024, "eager")) / (e(1024, "eager") - e(512, "eager"))
    growth_sdpa = (e(2048, "sdpa") - e(1024, "sdpa")) / (e(1024, "sdpa") - e(512, "sdpa"))
    assert growth_sdpa == pytest.approx(2.0, rel=0.02)  # linear in seq
    assert growth_eager > 3.0  # quadratic term dominates


def test_gradient_checkpointing_keeps_block_inputs_only(spec):
    c = ctx(spec, method="full", precision="bf16", gradient_checkpointing=True, seq_len=128)
    assert act.layer_activations(c).gc_saved == 2 * 128 * H
    plan = validate(Plan(method="lora", precision="bf16", seq_len=1024))
    no_gc = estimate_analytic(spec, plan)
    gc = estimate_analytic(spec, plan.with_(gradient_checkpointing=True))
    assert gc.peak_allocated < no_gc.peak_allocated
    assert gc.phases["forward"] < no_gc.phases["forward"]


def test_lora_dropout_costs_a_mask_and_a_copy_per_module(spec):
    p0 = act.layer_activations(ctx(spec, method="lora", precision="fp32", lora_dropout=0.0, lora_r=8, seq_len=16)).saved
    p1 = act.layer_activations(ctx(spec, method="lora", precision="fp32", lora_dropout=0.1, lora_r=8, seq_len=16)).saved
    T = 16
    # with dropout: each of q,k,v,o,gate,up (in=64) and down (in=128) keeps dropout(x) fp32 + a 1-byte mask;
    # without: lora_A saves x itself, shared by q/k/v (norm out), o (attention out, already saved), gate/up, down
    with_drop = 6 * T * H * 5 + T * I * 5
    without = 2 * T * H * 4 + T * I * 4
    assert p1 - p0 == with_drop - without


def test_moe_activations_scale_with_experts_per_token():
    cfg = dict(TINY_CFG, model_type="mixtral", num_local_experts=4, num_experts_per_tok=1)
    a1 = estimate_analytic(build_spec(cfg, "moe1"), validate(Plan(precision="bf16", seq_len=256))).activations
    a2 = estimate_analytic(
        build_spec(dict(cfg, num_experts_per_tok=2), "moe2"), validate(Plan(precision="bf16", seq_len=256))
    ).activations
    assert a2 > a1


# ------------------------------------------------------------------ logits


def test_logits_fp32_upcast_and_loss_scale_with_vocab(spec):
    c = ctx(spec, method="full", precision="bf16", seq_len=64)
    lm = lgt.logits_memory(c)
    assert lm.forward_peak == (2 + 4 + 4) * 64 * V  # bf16 logits + fp32 upcast + fp32 log-probs
    assert lm.backward_peak == 3 * 4 * 64 * V
    c32 = ctx(spec, method="full", precision="fp32", seq_len=64)
    assert lgt.logits_memory(c32).forward_peak == (4 + 4) * 64 * V  # .float() is a no-op on fp32
    big = build_spec(dict(TINY_CFG, vocab_size=4 * V), "bigvocab")
    assert lgt.logits_memory(make_ctx(big, c.plan)).backward_peak == 4 * lm.backward_peak


# ------------------------------------------------------------------ runtime / peaks


def test_allocator_rounding():
    assert rt.rounded(1) == 512 and rt.rounded(513) == 1024
    assert rt.rounded(11 * 2**20 + 1) == 12 * 2**20  # > 10 MiB: 2 MiB granularity


def test_components_sum_to_peak_and_peaks_are_ordered(spec):
    for plan in (
        Plan(),
        Plan(method="lora"),
        Plan(method="qlora", gradient_checkpointing=True),
        Plan(precision="bf16", attn="eager"),
        Plan(method="full", optimizer="paged-adamw", grad_accum=4),
        Plan(method="lora", offload_activations=True),
    ):
        e = estimate_analytic(spec, validate(plan))
        assert sum(getattr(e, k) for k in TENSOR_COMPONENTS) == e.peak_allocated
        assert e.peak_allocated == max(e.phases.values()) == e.phases[e.peak_phase]
        assert e.peak_reserved == e.peak_allocated + e.allocator_slack + e.cublas_workspace
        assert e.peak_device == e.peak_reserved + e.cuda_context + e.paged_optimizer
        assert set(e.phases) == {"forward", "backward", "optimizer-step"}


def test_every_bundled_model_prices_every_method():
    from oomdoctor.model.load import bundled_ids, load_spec

    ids = bundled_ids()
    if not ids:
        pytest.skip("no bundled configs")
    for mid in ids:
        s = load_spec(mid)
        for m in ("full", "lora", "qlora"):
            e = estimate_analytic(s, validate(Plan(method=m, seq_len=512)))
            assert e.peak_allocated > e.parameters > 0, mid


def test_analytic_path_is_torch_free():
    """192 analytic estimates of a 70B in a fresh interpreter never import torch (their speed: benchmarks/latency.py)."""
    code = (
        "import sys, itertools\n"
        "from oomdoctor.model.architectures import build_spec\n"
        "from oomdoctor.plan import Plan, validate\n"
        "from oomdoctor.memory.analytic import estimate_analytic\n"
        "s = build_spec(dict(model_type='llama', hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,"
        " num_key_value_heads=8, intermediate_size=28672, vocab_size=32000), '70b')\n"
        "plans = [validate(Plan(method=m, precision=p, optimizer=o, gradient_checkpointing=g, micro_batch=b))"
        " for m, p, o, g, b in itertools.product(('full','lora','qlora'), ('bf16-mixed','bf16'),"
        " ('adamw','adamw-8bit','paged-adamw-8bit','adafactor'), (False, True), (1, 2, 4, 8))]\n"
        "peaks = [estimate_analytic(s, p).peak_allocated for p in plans]\n"
        "assert 'torch' not in sys.modules, 'analytic path imported torch'\n"
        "print(len(peaks), min(peaks) > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["192", "True"]
