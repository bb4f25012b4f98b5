"""Eval, epochs, metrics and merged outputs of ``oomdoctor train``: real tiny runs on CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from train_util import cli, tiny_cfg, write_yaml

from oomdoctor.errors import BadInput
from oomdoctor.train.data import Sample
from oomdoctor.train.evaluate import split_eval


def test_split_eval_is_seeded_disjoint_and_keeps_order():
    samples = [Sample([i], [i], (1,)) for i in range(20)]
    train, held = split_eval(samples, 0.25, seed=3)
    assert len(held) == 5 and len(train) == 15
    assert split_eval(samples, 0.25, seed=3) == (train, held)
    assert {s.input_ids[0] for s in train}.isdisjoint({s.input_ids[0] for s in held})
    assert [s.input_ids[0] for s in train] == sorted(s.input_ids[0] for s in train)
    with pytest.raises(BadInput, match="nothing to train on"):
        split_eval(samples[:1], 0.5, seed=0)


@pytest.mark.parametrize("method,precision", [("full", "fp32"), ("lora", "bf16")])
def test_eval_phase_memory_matches_a_real_eval_forward(method, precision, tmp_path):
    """The dry run's eval price (``oomdoctor.memory.evaluation``) against LiveBytes around a real eval pass."""
    import torch

    from oomdoctor.engines import estimate
    from oomdoctor.execute.load import ModelSource, load_model, load_tokenizer
    from oomdoctor.execute.optim import OptimizerArgs, make_plan_optimizer
    from oomdoctor.execute.step import TrainStep
    from oomdoctor.execute.tracking import LiveBytes
    from oomdoctor.memory.evaluation import eval_memory
    from oomdoctor.model.load import load_spec
    from oomdoctor.train.data import collate, tokenize
    from oomdoctor.train.evaluate import evaluate

    cfg = tiny_cfg(tmp_path, method=method, precision=precision, micro_batch_size=2, gradient_accumulation_steps=1)
    plan = cfg.to_plan()
    src = ModelSource(path=None, config=cfg.model.config, init="random", tokenizer=cfg.model.tokenizer)
    tok = load_tokenizer(src)
    data = tokenize(cfg.dataset, tok, cfg.seq_len)
    loaded = load_model(src, plan, torch.device("cpu"), vocab_size=len(tok), seed=0)
    step = TrainStep(loaded.model, make_plan_optimizer(loaded.trainable, plan, OptimizerArgs()), plan, "cpu")
    step.forward_backward(collate(data.samples[:2], data.pad_id), num_items_in_batch=100)
    step.optimizer_step()  # optimizer state exists, gradients are gone: the state eval runs in
    eval_bs = 8
    meter = LiveBytes(history=False)
    meter.track_module(loaded.model, step.optimizer, grad_hooks=False)
    meter.track_optimizer(step.optimizer)
    with meter:
        loss = evaluate(
            step, data.samples[:eval_bs], pad_id=data.pad_id, batch_size=eval_bs, device=torch.device("cpu")
        )
    assert 0 < loss < 20
    spec = load_spec(cfg.model_ref)
    predicted = eval_memory(spec, plan, eval_bs, estimate(spec, plan)).peak_allocated
    assert abs(predicted - meter.peak) / meter.peak <= 0.10, (predicted, meter.peak)


@pytest.mark.slow
def test_epochs_eval_metrics_tensorboard_and_dry_run(tmp_path):
    pytest.importorskip("tensorboard")  # in the dev extra; report_to's libraries are optional for users
    out = tmp_path / "out"
    cfg = tiny_cfg(
        out,
        max_steps=None,
        num_train_epochs=0.25,
        eval_steps=2,
        logging_steps=1,
        report_to=["tensorboard"],
        dataset=replace(tiny_cfg(out).dataset, eval_split=0.1),
    )
    path = write_yaml(tmp_path / "c.yaml", cfg)
    d = cli("train", path, "--dry-run", "--gpu-mem", "64MB", "--json")
    assert d.returncode == 0, d.stderr
    ev = json.loads(d.stdout)["eval"]
    assert ev["fits"] is True and ev["logits_bytes"] > 0 and ev["needed_bytes"] > 0
    p = cli("train", path, "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    # steps = ceil(0.25 epochs x train samples / effective batch): the epoch reached is 0.25 plus less than a step
    eff = res["effective_batch_size"]
    n_train = round(res["optimizer_steps"] * eff / res["epoch"])
    assert res["optimizer_steps"] == -(-n_train // (4 * eff))
    assert 0.25 <= res["epoch"] < 0.25 + eff / n_train and res["eval_loss"] > 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, res["optimizer_steps"] + 1))
    assert evals and evals[-1]["step"] == res["optimizer_steps"] and evals[-1]["eval_loss"] == res["eval_loss"]
    assert list((out / "runs").glob("events.out.tfevents.*"))


def test_missing_report_library_is_refused_before_training(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    path = write_yaml(tmp_path / "c.yaml", tiny_cfg(tmp_path / "out", report_to=["wandb"]))
    p = cli("train", path)
    assert p.returncode == 2 and "pip install wandb" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "method,precision,tol,targets",
    [
        ("lora", "fp32", 1e-5, ["all-linear"]),
        ("qlora", "bf16-mixed", 0.1, ["all-linear"]),
        ("qlora", "bf16-mixed", 0.1, ["q_proj", "v_proj"]),
    ],
)
def test_save_merged_gives_a_plain_model_with_the_adapted_outputs(tmp_path, method, precision, tol, targets):
    """``merge_adapter``: the merged model computes what base + adapter computed (QLoRA: on the dequantized base,
    up to bf16 rounding: before the fix for bitsandbytes' CPU repacking the error was 100 %). Quantized layers no
    adapter adapts are dequantized too (before, a QLoRA merge on q_proj/v_proj left 4-bit k_proj... in a "plain"
    model that did not load)."""
    import torch
    from transformers import AutoModelForCausalLM

    from oomdoctor.execute.build import save_merged
    from oomdoctor.execute.load import ModelSource, load_model, load_tokenizer

    cfg = tiny_cfg(tmp_path, method=method, precision=precision, target_modules=targets)
    src = ModelSource(path=None, config=cfg.model.config, init="random", tokenizer=cfg.model.tokenizer)
    tok = load_tokenizer(src)
    loaded = load_model(src, cfg.to_plan(), torch.device("cpu"), vocab_size=len(tok), seed=0)
    model = loaded.model
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # a trained adapter (peft initializes B to zero)
    ids = torch.randint(0, len(tok), (2, 16))
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        want = model(ids).logits.float()
    save_merged(model, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert getattr(merged.config, "quantization_config", None) is None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        got = merged(ids).logits.float()
    assert (got - want).abs().max() <= tol * want.abs().max(), float((got - want).abs().max())


@pytest.mark.slow
def test_merge_adapter_run_writes_a_loadable_merged_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oomdoctor.train.loop import train
    from oomdoctor.train.rundir import MERGED_DIR

    out = tmp_path / "out"
    train(tiny_cfg(out, max_steps=1, method="lora", merge_adapter=True))
    assert (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out / MERGED_DIR)
    assert AutoTokenizer.from_pretrained(out / MERGED_DIR) is not None
    assert not any("lora_" in n for n, _ in merged.named_parameters())


@pytest.mark.slow
def test_report_to_wandb_offline_through_its_own_library(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # optional: report_to's libraries are the user's choice
    from oomdoctor.train.loop import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = tmp_path / "out"
    res = train(tiny_cfg(out, max_steps=2, report_to=["wandb"]))
    assert res.optimizer_steps == 2
    assert list((out / "wandb").glob("offline-run-*")), "wandb wrote no offline run"
