"""``optimizer_in_backward``: per-parameter optimizer steps inside backward (torchtune's ``optimizer_in_bwd``).

Same weights as stepping after backward (no clipping, no accumulation), gradients never all alive at once, priced
by the formulas and the simulated engine alike, run by ``train``, chosen by ``tune`` where only it fits."""

from __future__ import annotations

import pytest
from train_util import tiny_cfg

from oomdoctor.errors import BadInput
from oomdoctor.plan import Plan, validate


def test_same_weights_as_stepping_after_backward_and_no_gradient_left(tmp_path):
    import torch

    from oomdoctor.execute.load import ModelSource, load_model, load_tokenizer
    from oomdoctor.execute.optim import OptimizerArgs, make_plan_optimizer, make_scheduler
    from oomdoctor.execute.step import TrainStep
    from oomdoctor.train.data import collate, tokenize

    cfg = tiny_cfg(tmp_path)
    src = ModelSource(path=None, config=cfg.model.config, init="random", tokenizer=cfg.model.tokenizer)
    tok = load_tokenizer(src)
    data = tokenize(cfg.dataset, tok, cfg.seq_len)
    weights = []
    for oib in (False, True):
        plan = cfg.to_plan().with_(optimizer_in_backward=oib, grad_accum=1)
        loaded = load_model(src, plan, torch.device("cpu"), vocab_size=len(tok), seed=0)
        opt = make_plan_optimizer(loaded.trainable, plan, OptimizerArgs(learning_rate=1e-2, weight_decay=0.1))
        sched = make_scheduler("cosine", opt, warmup_steps=1, total_steps=4)
        step = TrainStep(loaded.model, opt, plan, "cpu", max_grad_norm=None)
        for k in range(3):
            step.forward_backward(collate(data.samples[4 * k : 4 * k + 4], data.pad_id), num_items_in_batch=200)
            if oib:  # the gradients were used and freed inside backward
                assert all(p.grad is None for p in loaded.trainable)
            step.optimizer_step()
            sched.step()
        weights.append({n: p.detach().clone() for n, p in loaded.model.named_parameters()})
    assert max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0]) == 0.0


def test_validation_refuses_accumulation_offload_and_fp16():
    for bad in (dict(grad_accum=2), dict(offload_optimizer=True), dict(precision="fp16-mixed")):
        with pytest.raises(BadInput, match="optimizer_in_backward"):
            validate(Plan(optimizer_in_backward=True, **bad))


def test_formulas_and_simulation_agree_and_gradients_vanish():
    from oomdoctor.engines import simulate
    from oomdoctor.memory.analytic import estimate_analytic
    from oomdoctor.model.architectures import build_spec

    spec = build_spec(
        dict(
            model_type="llama",
            hidden_size=256,
            num_hidden_layers=4,
            intermediate_size=688,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=2000,
        ),
        "small",
    )
    for precision in ("bf16", "fp32"):  # short sequences: the model states, not the activations, make the peak
        base = validate(Plan(precision=precision, seq_len=32, micro_batch=1, gradient_checkpointing=True))
        oib = base.with_(optimizer_in_backward=True)
        sim_base = simulate.simulate_plan(spec, base, layers="full", round_to=1).breakdown
        sim = simulate.simulate_plan(spec, oib, layers="full", round_to=1).breakdown
        est = estimate_analytic(spec, oib)
        assert sim.peak_allocated < sim_base.peak_allocated
        assert abs(est.peak_allocated - sim.peak_allocated) / sim.peak_allocated <= 0.05, (precision, est, sim)


@pytest.mark.slow
def test_train_runs_it_and_the_yaml_demands_no_clipping(tmp_path):
    import yaml

    from oomdoctor.train.config import parse_train_config
    from oomdoctor.train.config.render import render_yaml
    from oomdoctor.train.loop import train

    cfg = tiny_cfg(
        tmp_path / "out", max_steps=2, gradient_accumulation_steps=1, micro_batch_size=8, optimizer_in_backward=True
    )
    with pytest.raises(BadInput, match="max_grad_norm"):
        parse_train_config(yaml.safe_load(render_yaml(cfg)), check_paths=False)
    from dataclasses import replace

    res = train(replace(cfg, max_grad_norm=None), gpu_mem=64 * 2**20)
    assert res.optimizer_steps == 2 and res.plan.endswith("opt-in-bwd")
    assert res.losses[1] < res.losses[0]
    predicted = res.memory["peak_allocated_bytes"]
    assert abs(res.measured_peak_bytes - predicted) / predicted <= 0.05


def test_tune_finds_torchtunes_full_fine_tune_of_a_7b_on_24gb():
    from oomdoctor.tune.tuner import tune

    r = tune("meta-llama/Llama-2-7b-hf", gpu_mem=24 * 10**9, seq_len=2048, verify_mode="none")
    assert r.plan.method == "full" and r.plan.optimizer_in_backward and r.plan.precision == "bf16"
