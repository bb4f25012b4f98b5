"""Plan search: micro-batch bisection and exact divisors (oomdoctor.plan.batch), the batch search against a budget,
ranking, throughput, verify-and-refine (oomdoctor.tune.*)."""

from __future__ import annotations

import pytest

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import SearchTrace, choose_micro_batch, divisors, max_fitting
from oomdoctor.plan.budget import Budget, resolve_budget
from oomdoctor.tune.batch_search import micro_batch_search, verify_and_refine
from oomdoctor.tune.ranking import fidelity_key
from oomdoctor.tune.search import enumerate_candidates, search
from oomdoctor.tune.throughput import REFERENCE_PROFILE, estimate_throughput, profile_for, trainable_params


def analytic(spec, plan):
    return estimate(spec, plan, "analytic")


def card(capacity: int, margin=None) -> Budget:
    return resolve_budget(capacity, margin, None)


# ------------------------------------------------------------------------------------------- bisection


@pytest.mark.parametrize("true_max", [0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 100, 1023, 1024])
def test_max_fitting_finds_exact_boundary(true_max):
    trace = SearchTrace()
    got = max_fitting(lambda b: b <= true_max, 1024, trace)
    assert got == min(true_max, 1024)
    n = len(trace.evaluations)
    assert n <= 2 * 11 + 1  # doubling + bisection: O(log2 limit)
    assert len({b for b, _ in trace.evaluations}) == n  # no size evaluated twice


def test_max_fitting_respects_limit_and_rejects_bad_limit():
    assert max_fitting(lambda b: True, 37) == 37
    with pytest.raises(BadInput):
        max_fitting(lambda b: True, 0)


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(32) == [1, 2, 4, 8, 16, 32]
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(13) == [1, 13]


# ------------------------------------------------------------------------------------------- divisibility


def test_choose_micro_batch_exact_when_max_divides():
    c = choose_micro_batch(8, 32)
    assert (c.micro_batch, c.grad_accum, c.exact, c.note) == (8, 4, True, None)


def test_choose_micro_batch_says_when_divisibility_costs_size():
    c = choose_micro_batch(7, 32)
    assert (c.micro_batch, c.grad_accum) == (4, 8)
    assert c.micro_batch * c.grad_accum == 32
    assert c.note and "7" in c.note and "4 x 8" in c.note
    assert "--global-batch 28" in c.note and "--global-batch 35" in c.note


def test_choose_micro_batch_global_smaller_than_max():
    c = choose_micro_batch(40, 12)
    assert (c.micro_batch, c.grad_accum, c.note) == (12, 1, None)


def test_choose_micro_batch_prime_global():
    c = choose_micro_batch(5, 7)
    assert (c.micro_batch, c.grad_accum) == (1, 7) and c.exact and c.note


def test_choose_micro_batch_without_global_and_bad_inputs():
    c = choose_micro_batch(9, None)
    assert (c.micro_batch, c.grad_accum, c.global_batch, c.exact) == (9, 1, None, True)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(BadInput):
            choose_micro_batch(4, bad)  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        choose_micro_batch(0, 8)


# ------------------------------------------------------------------------------------------- margins


def test_margin_changes_what_fits(tiny_spec):
    plan = Plan(method="full", precision="fp32", seq_len=128)
    cap = analytic(tiny_spec, plan.with_(micro_batch=16)).peak_device + 1
    no_margin, _ = micro_batch_search(tiny_spec, plan, card(cap), analytic)
    big_margin, _ = micro_batch_search(tiny_spec, plan, card(cap, "30%"), analytic)
    assert no_margin.max_micro_batch >= 16
    assert big_margin is None or big_margin.max_micro_batch < no_margin.max_micro_batch


# ------------------------------------------------------------------------------------------- search on the real model


def test_micro_batch_search_is_the_exact_boundary_of_the_memory_model(tiny_spec):
    plan = Plan(method="lora", precision="bf16-mixed", seq_len=256)
    target = analytic(tiny_spec, plan.with_(micro_batch=11)).peak_device
    choice, mem = micro_batch_search(tiny_spec, plan, card(target), analytic, global_batch=None)
    assert choice.max_micro_batch == 11
    assert mem.peak_device <= target
    assert analytic(tiny_spec, plan.with_(micro_batch=12)).peak_device > target
    # with a global batch of 24 the micro-batch must divide it: 8 x 3
    choice, _ = micro_batch_search(tiny_spec, plan, card(target), analytic, global_batch=24)
    assert (choice.micro_batch, choice.grad_accum) == (8, 3)


def test_search_llama7b_24gb_prefers_fidelity_and_keeps_global_exact():
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    plans = enumerate_candidates({}, Plan(seq_len=1024))
    res = search(spec, plans, card(24 * 10**9, 0.1), global_batch=32, estimator=analytic, host_ram=128 * 2**30)
    best = res.best
    assert best is not None
    # full fine-tuning of 6.7B parameters cannot fit 24 GB with AdamW: the best plan is an adapter method. (With
    # unlimited host RAM it could: the optimizer in backward at micro-batch 32, every activation offloaded without
    # checkpointing, 54 GB of paged AdamW states paged out — host RAM the machine must have.)
    assert best.plan.method in ("lora", "qlora")
    unlimited = search(spec, plans, card(24 * 10**9, 0.1), global_batch=32, estimator=analytic).best.plan
    assert unlimited.method == "full" and unlimited.optimizer_is_paged and unlimited.offload_activations
    assert best.plan.micro_batch * best.plan.grad_accum == 32
    assert 32 % best.plan.micro_batch == 0
    assert res.budget.fits(best.memory) and best.memory.resident_device <= res.budget.limit_bytes
    # ranks are fidelity-ordered: no fitting plan ranked below the best is more faithful
    for c in res.fitting[1:]:
        assert fidelity_key(c.plan) >= fidelity_key(best.plan)
    # every plan that does not fit really exceeds the budget at micro-batch 1, or says why it is out
    for c in res.candidates:
        if not c.fits and not c.why_not:
            assert c.memory.resident_device > res.budget.limit_bytes
    assert all("cannot accumulate" in c.why_not or "host RAM" in c.why_not for c in res.candidates if c.why_not)


def test_prefer_speed_ranks_by_throughput(tiny_spec):
    plans = enumerate_candidates({}, Plan(seq_len=128))
    cap = card(10 * 2**30)
    q = search(tiny_spec, plans, cap, global_batch=16, estimator=analytic, prefer="quality")
    s = search(tiny_spec, plans, cap, global_batch=16, estimator=analytic, prefer="speed")
    assert q.best.plan.method == "full"  # everything fits a tiny model: the most faithful wins
    tps = [c.throughput.tokens_per_s for c in s.fitting]
    assert all(float(f"{a:.3g}") >= float(f"{b:.3g}") for a, b in zip(tps, tps[1:]))
    assert s.best.throughput.tokens_per_s >= q.best.throughput.tokens_per_s
    with pytest.raises(BadInput):
        search(tiny_spec, plans, cap, estimator=analytic, prefer="fast")  # type: ignore[arg-type]


def test_enumeration_filters_optimizer_swaps_and_bf16_on_old_gpus():
    plans = enumerate_candidates({}, Plan(seq_len=128))
    assert {p.optimizer for p in plans} <= {"adamw", "paged-adamw", "adamw-8bit", "paged-adamw-8bit"}
    assert {p.method for p in plans} == {"full", "lora", "qlora"}
    pinned = enumerate_candidates({"optimizer": "sgd", "method": "full"}, Plan(seq_len=128))
    assert {p.optimizer for p in pinned} == {"sgd"}
    t4 = enumerate_candidates({}, Plan(seq_len=128), bf16_supported=profile_for("Tesla T4").bf16)
    assert "bf16" not in {p.precision for p in t4} and "bf16-mixed" not in {p.precision for p in t4}


# ------------------------------------------------------------------------------------------- throughput model


def test_throughput_gc_costs_a_third_and_offload_costs_pcie(tiny_spec):
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    p = Plan(method="full", precision="bf16-mixed", seq_len=1024, micro_batch=4, grad_accum=8)
    base = estimate_throughput(spec, p, REFERENCE_PROFILE)
    gc = estimate_throughput(spec, p.with_(gradient_checkpointing=True), REFERENCE_PROFILE)
    assert gc.compute_s / base.compute_s == pytest.approx(4 / 3, rel=1e-6)
    off = estimate_throughput(spec, p.with_(offload_optimizer=True), REFERENCE_PROFILE)
    assert off.transfer_s > 0 and off.tokens_per_s < base.tokens_per_s
    lora = estimate_throughput(spec, p.with_(method="lora"), REFERENCE_PROFILE)
    assert lora.tokens_per_s > base.tokens_per_s
    assert trainable_params(spec, p.with_(method="lora")) < spec.num_params // 50


def test_profile_lookup():
    assert profile_for("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert profile_for("NVIDIA A100-SXM4-40GB").name == "A100"
    assert profile_for(None) is REFERENCE_PROFILE
    assert profile_for("Tesla T4").bf16 is False


# ------------------------------------------------------------------------------------------- verify and refine


def _device(true_slope, true_fixed, cap):
    calls = []

    def trial(b):
        calls.append(b)
        m = true_fixed + true_slope * b
        return (m <= cap, m if m <= cap else None)

    return trial, calls


def test_verify_refines_up_once_when_the_model_overestimates():
    cap = 3000
    trial, calls = _device(100, 1000, cap)  # true max 20
    pred = lambda b: 1000 + 110 * b  # noqa: E731 - 10% pessimistic
    start = max_fitting(lambda b: pred(b) <= cap, 1024)
    best, steps = verify_and_refine(start, range(1, 1025), pred, trial, cap, cap)
    # ratio calibration (k = measured/predicted at the first trial) is conservative when only the slope is off
    assert best in (19, 20) and len(steps) == 2 and all(s.fits for s in steps)
    assert start < best


def test_verify_steps_down_when_the_model_underestimates():
    cap = 3000
    trial, calls = _device(100, 1000, cap)
    pred = lambda b: 1000 + 80 * b  # noqa: E731 - optimistic: predicts 25
    start = max_fitting(lambda b: pred(b) <= cap, 1024)
    best, steps = verify_and_refine(start, range(1, 1025), pred, trial, cap, cap)
    assert not steps[0].fits and steps[-1].fits
    assert best == max(s.micro_batch for s in steps if s.fits) and 19 <= best <= 20
    assert len(steps) <= 4


def test_verify_keeps_divisors_and_returns_zero_when_nothing_fits():
    cap = 3000
    trial, calls = _device(100, 1000, cap)
    best, steps = verify_and_refine(16, divisors(32), lambda b: 1000 + 90 * b, trial, cap, cap)
    assert best == 16 and all(32 % s.micro_batch == 0 for s in steps)
    trial, calls = _device(100, 5000, cap)  # even 1 does not fit
    best, steps = verify_and_refine(4, divisors(32), lambda b: 1000 + 90 * b, trial, cap, cap, max_trials=5)
    assert best == 0 and [s.micro_batch for s in steps][-1] == 1


def test_ranking_like_an_expert_on_device_before_offload_and_the_fastest_of_the_tier():
    """Llama-2-7B on 80 GB: full fine-tuning fits on the device (8-bit AdamW or pure bf16), so an optimizer offload
    (PCIe-bound) is not chosen; within the tier the faster plan wins. Offload plans list the host RAM they need and
    are out when the machine has less."""
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    plans = enumerate_candidates({}, Plan(seq_len=2048))
    res = search(spec, plans, card(80 * 10**9), estimator=analytic, host_ram=2**40)
    best = res.best
    assert best.plan.method == "full" and not best.plan.offload_optimizer
    offloaded = [c for c in res.fitting if c.plan.offload_optimizer]
    assert offloaded and all(c.rank > best.rank for c in offloaded)
    assert all(c.memory.cpu_offloaded > 0 for c in offloaded)
    same_tier = [c for c in res.fitting if fidelity_key(c.plan) == fidelity_key(best.plan)]
    assert max(c.throughput.tokens_per_s for c in same_tier) == best.throughput.tokens_per_s
    small = search(spec, plans, card(80 * 10**9), estimator=analytic, host_ram=2**30)
    out = [c for c in small.candidates if c.why_not]
    assert out and all(not c.fits and "host RAM" in c.why_not for c in out)
    assert not any(c.plan.offload_optimizer for c in small.fitting)


def test_the_search_drops_peft_s_k_bit_upcast_only_when_that_is_what_fits():
    """tune searches QLoRA in bf16 without the k-bit upcast (TRL's recipe) next to peft's, and ranks it below every
    upcast plan of its method and quantization, offloaded ones included: Llama-3.3-70B QLoRA at 2,048 tokens on
    48 GB fits on the device only without the upcast, and with it when activations can be offloaded (5 GiB of
    host RAM)."""
    plans = enumerate_candidates({"method": "qlora"}, Plan(seq_len=2048))
    assert {p.kbit_upcast for p in plans if p.precision == "bf16"} == {True, False}
    assert all(p.kbit_upcast for p in plans if p.precision != "bf16")
    assert all(p.kbit_upcast for p in enumerate_candidates({"method": "qlora", "kbit_upcast": True}, Plan()))
    up = Plan(method="qlora", quant="nf4", precision="bf16", offload_activations=True)
    assert fidelity_key(up) < fidelity_key(Plan(method="qlora", quant="nf4", precision="bf16", kbit_upcast=False))
    assert fidelity_key(up.with_(precision="bf16-mixed", kbit_upcast=False)) == fidelity_key(
        up.with_(precision="bf16-mixed")
    )  # an fp32-loaded base: nothing to upcast
    spec = load_spec("meta-llama/Llama-3.3-70B-Instruct")
    no_host = search(spec, plans, card(48 * 10**9), estimator=analytic, host_ram=2**30)
    assert not no_host.best.plan.kbit_upcast and not no_host.best.plan.offload_activations
    assert not any(c.plan.kbit_upcast for c in no_host.fitting)
    host = search(spec, plans, card(48 * 10**9), estimator=analytic, host_ram=24 * 2**30)
    assert host.best.plan.kbit_upcast and host.best.plan.offload_activations
    assert fidelity_key(host.best.plan) < min(fidelity_key(c.plan) for c in host.fitting if not c.plan.kbit_upcast)


def test_every_single_pin_selects_plans_the_unpinned_search_considers():
    """What one pin can select is in the unpinned candidate list (paged 32-bit AdamW for a full fine-tune, the
    optimizer in backward for LoRA, activation offload without checkpointing, tiled MLPs without it), and a pinned
    tiled MLP is never combined with the optimizer in backward (validate refuses it: tune --tiled-mlp crashed)."""
    from oomdoctor.model.execution import upcast_changes_bytes
    from oomdoctor.tune.search import ADAMW_FAMILY

    def same_bytes(p: Plan) -> Plan:  # kbit_upcast off where there is nothing to upcast is the same plan
        return p if upcast_changes_bytes(p) else p.with_(kbit_upcast=True)

    base = Plan(seq_len=8192)
    every = set(enumerate_candidates({}, base, tiled_mlp=True))
    pins = [("optimizer", o) for o in ADAMW_FAMILY] + [
        ("kbit_upcast", False),
        ("offload_activations", True),
        ("optimizer_in_backward", True),
        ("gradient_checkpointing", False),
        ("loss", "chunked"),
    ]
    for k, v in pins:
        assert {same_bytes(p) for p in enumerate_candidates({k: v}, base, tiled_mlp=True)} <= every, (k, v)
    tiled = enumerate_candidates({"tiled_mlp": True}, base)
    assert tiled and not any(p.optimizer_in_backward for p in tiled)
    assert {p for p in tiled if not p.gradient_checkpointing} <= every


def test_qlora_7b_fits_a_16gb_t4_with_pure_bf16_and_paged_optimizers_in_the_search():
    spec = load_spec("Qwen/Qwen2.5-7B")
    plans = enumerate_candidates({}, Plan(seq_len=2048), bf16_supported=True)
    assert any(p.method == "qlora" and p.precision == "bf16" for p in plans)
    assert any(p.method == "qlora" and p.optimizer == "paged-adamw-8bit" for p in plans)
    res = search(spec, plans, card(16 * 10**9), estimator=analytic)
    assert res.best is not None and res.best.plan.method == "qlora"
