"""Each precision / method / technique that the CPU supports trains for real, and is really applied."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from train_util import load_weights, tiny_cfg

from oomdoctor.train.loop import train


def _run(tmp_path, name, **kw):
    return train(tiny_cfg(tmp_path / name, **kw))


def _finite_and_learning(res):
    assert res.optimizer_steps == 3
    assert all(math.isfinite(x) for x in res.losses), res.losses
    assert res.final_loss < res.first_loss, res.losses


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    return train(tiny_cfg(tmp_path_factory.mktemp("fp32")))


def test_fp32_full(fp32_run):
    _finite_and_learning(fp32_run)
    w = load_weights(fp32_run.checkpoint)
    assert all(t.dtype == torch.float32 for t in w.values())
    assert fp32_run.num_trainable_params == fp32_run.num_params


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_amp(tmp_path, fp32_run, precision):
    res = _run(tmp_path, precision, precision=precision)
    _finite_and_learning(res)
    # master weights stay fp32; autocast changes what is saved for backward (lower peak than fp32)
    assert all(t.dtype == torch.float32 for t in load_weights(res.checkpoint).values())
    assert res.measured_peak_bytes < fp32_run.measured_peak_bytes
    if precision == "fp16-mixed":
        import json
        from pathlib import Path

        assert (Path(res.checkpoint) / "scaler.pt").exists()  # GradScaler state is checkpointed
        assert json.loads((Path(res.checkpoint) / "trainer_state.json").read_text())["step"] == 3


def test_pure_bf16(tmp_path, fp32_run):
    res = _run(tmp_path, "bf16", precision="bf16")
    _finite_and_learning(res)
    assert all(t.dtype == torch.bfloat16 for t in load_weights(res.checkpoint).values())
    # half the bytes for weights, gradients and AdamW states
    assert res.measured_peak_bytes < 0.75 * fp32_run.measured_peak_bytes


def test_lora_adapters_only(tmp_path, fp32_run):
    res = _run(tmp_path, "lora", method="lora", r=4, lora_alpha=8, learning_rate=1e-2)
    _finite_and_learning(res)
    w = load_weights(res.checkpoint)
    assert w and all("lora_" in k for k in w), list(w)[:5]
    from pathlib import Path

    assert not (Path(res.checkpoint) / "model.safetensors").exists()
    assert res.num_trainable_params < 0.2 * res.num_params
    assert res.measured_peak_bytes < fp32_run.measured_peak_bytes


def test_qlora_4bit_on_cpu(tmp_path):
    """bitsandbytes 0.50 runs Linear4bit on CPU: QLoRA (nf4 + double quant + GC + peft) really trains here."""
    res = _run(
        tmp_path,
        "qlora",
        method="qlora",
        bnb_4bit_use_double_quant=True,
        gradient_checkpointing=True,
        precision="bf16-mixed",
        r=4,
        lora_alpha=8,
        learning_rate=1e-2,
    )
    _finite_and_learning(res)
    assert all("lora_" in k for k in load_weights(res.checkpoint))
    assert res.plan.startswith("qlora-nf4+dq")


def test_qlora_with_bf16_adapters_as_trl_runs_it(tmp_path):
    """adapter_dtype: bf16 (the QLoRA paper's recipe, TRL's SFTTrainer on a quantized model): the adapters, their
    gradients and AdamW states are bf16, it learns, and what it allocates is what was priced."""
    res = _run(
        tmp_path,
        "qlora-bf16",
        method="qlora",
        adapter_dtype="bf16",
        precision="bf16-mixed",
        r=4,
        lora_alpha=8,
        learning_rate=1e-2,
    )
    _finite_and_learning(res)
    weights = load_weights(res.checkpoint)
    assert weights and all(w.dtype == torch.bfloat16 for w in weights.values())
    pred = res.memory["peak_allocated_bytes"]
    assert abs(res.measured_peak_bytes - pred) / res.measured_peak_bytes < 0.015, (res.measured_peak_bytes, pred)


@pytest.mark.parametrize("quant,gc", [pytest.param("nf4", True, marks=pytest.mark.slow), ("int8", False)])
def test_qlora_without_kbit_upcast_keeps_the_base_in_bf16_and_trains(tmp_path, quant, gc):
    """``kbit_upcast: false`` (TRL's SFTTrainer, axolotl's ``skip_prepare_model_for_kbit_training``): the base is
    frozen as peft's k-bit preparation freezes it, but its norms, embeddings and head stay bf16 (the upcast makes
    them fp32); it learns, and what it allocates is what was priced (``device="cpu"``)."""
    from oomdoctor.execute.load import load_model, load_tokenizer, resolve_device
    from oomdoctor.memory.analytic import estimate_analytic
    from oomdoctor.train.sizing import predict_memory

    kw = dict(
        method="qlora",
        load_in_8bit=quant == "int8",
        precision="bf16",
        gradient_checkpointing=gc,
        r=4,
        lora_alpha=8,
        learning_rate=1e-2,
    )
    dtypes = {}
    for up in (True, False):
        cfg = tiny_cfg(tmp_path / f"load-{up}", kbit_upcast=up, **kw)
        built = load_model(
            cfg.model, cfg.to_plan(), resolve_device(cfg.device), vocab_size=len(load_tokenizer(cfg.model))
        )
        dtypes[up] = {
            p.dtype for n, p in built.model.named_parameters() if "norm" in n or "embed" in n or "lm_head" in n
        }
        assert all("lora_" in n for n, p in built.model.named_parameters() if p.requires_grad)
    assert dtypes == {True: {torch.float32}, False: {torch.bfloat16}}
    res = _run(tmp_path, f"no-upcast-{quant}", kbit_upcast=False, **kw)
    _finite_and_learning(res)
    assert "no-upcast" in res.plan
    spec, plan, _, _ = predict_memory(tiny_cfg(tmp_path / "p", kbit_upcast=False, **kw), res.micro_batch_size)
    assert not plan.kbit_upcast
    pred = estimate_analytic(spec, plan, device="cpu").peak_allocated
    assert abs(res.measured_peak_bytes - pred) / res.measured_peak_bytes < 0.015, (res.measured_peak_bytes, pred)


@pytest.mark.slow
def test_a_train_yaml_with_kbit_upcast_false_trains_and_resumes_only_as_the_same_run(tmp_path):
    """``kbit_upcast: false`` in a train YAML reaches the executor through ``oomdoctor train``; a resume that would
    put the upcast back is a different run (the fingerprint names the key)."""
    from train_util import cli, run_json, write_yaml

    cfg = tiny_cfg(
        tmp_path / "run",
        method="qlora",
        load_in_8bit=True,
        precision="bf16",
        kbit_upcast=False,
        r=4,
        lora_alpha=8,
        learning_rate=1e-2,
        max_steps=2,
        save_steps=1,
    )
    path = write_yaml(tmp_path / "no-upcast.yaml", cfg)
    assert "kbit_upcast: false" in path.read_text()
    out, _ = run_json(path)
    assert out["optimizer_steps"] == 2 and "no-upcast" in out["plan"]
    back_on = write_yaml(tmp_path / "upcast.yaml", replace(cfg, kbit_upcast=True, max_steps=3))
    p = cli("train", back_on, "--resume")
    assert p.returncode == 2 and "kbit_upcast: False -> True" in p.stderr, p.stderr


def test_qlora_base_is_quantized(tmp_path):
    from oomdoctor.execute.load import load_model, load_tokenizer, resolve_device

    cfg = tiny_cfg(tmp_path, method="qlora", r=4)
    built = load_model(cfg.model, cfg.to_plan(), resolve_device(cfg.device), vocab_size=len(load_tokenizer(cfg.model)))
    kinds = {type(m).__name__ for m in built.model.modules()}
    assert "Linear4bit" in kinds
    # the quantized base weights are frozen uint8 storage; only LoRA parameters train
    assert all("lora_" in n for n, p in built.model.named_parameters() if p.requires_grad)


def test_gradient_checkpointing_lowers_peak(tmp_path, fp32_run):
    res = _run(tmp_path, "gc", gradient_checkpointing=True)
    _finite_and_learning(res)
    # same math: same losses as without checkpointing (recompute is exact in fp32)
    assert res.losses == pytest.approx(fp32_run.losses, rel=1e-5)
    assert res.measured_peak_bytes < fp32_run.measured_peak_bytes


def test_offload_optimizer_and_activations(tmp_path, fp32_run):
    res = _run(tmp_path, "offload", offload_optimizer=True, offload_activations=True)
    _finite_and_learning(res)
    # the same updates as the device optimizer (same fp32 AdamW, stepped on host copies)
    assert res.losses == pytest.approx(fp32_run.losses, rel=1e-5)
    from train_util import max_abs_diff

    assert max_abs_diff(load_weights(res.checkpoint), load_weights(fp32_run.checkpoint)) < 1e-5
    # optimizer state (2 x 4 B/param) and saved activations left the simulated device
    assert res.measured_peak_bytes < fp32_run.measured_peak_bytes - 2 * 4 * res.num_trainable_params * 0.9


@pytest.mark.parametrize("optim", ["adafactor", "sgd", "adamw_bnb_8bit"])
def test_other_optimizers(tmp_path, optim):
    kw = {"sgd_momentum": 0.9, "learning_rate": 0.1} if optim == "sgd" else {}
    res = _run(tmp_path, optim, optim=optim, **kw)
    _finite_and_learning(res)


def test_paged_optimizer_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from oomdoctor.errors import NoGPU

    with pytest.raises(NoGPU, match="needs a CUDA GPU"):
        _run(tmp_path, "paged", optim="paged_adamw_8bit")


def test_prompt_response_masking(tmp_path):
    from oomdoctor.execute.load import load_tokenizer
    from oomdoctor.resources import tiny_dir
    from oomdoctor.train.config import DatasetConfig
    from oomdoctor.train.data import IGNORE, tokenize

    cfg = tiny_cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    data = tokenize(DatasetConfig(path=str(tiny_dir() / "sft.jsonl")), tok, 64)
    assert data.kind == "prompt_completion"
    ids, labels = data.samples[0].input_ids, data.samples[0].labels
    n_prompt = sum(1 for t in labels if t == IGNORE)
    assert 0 < n_prompt < len(labels)
    assert labels[:n_prompt] == [IGNORE] * n_prompt and labels[n_prompt:] == ids[n_prompt:]
    res = train(tiny_cfg(tmp_path / "sft", dataset=DatasetConfig(path=str(tiny_dir() / "sft.jsonl"))))
    _finite_and_learning(res)


#: Every method x precision x gradient checkpointing; ``make test-fast`` runs one per method and precision.
_PEAK_GRID = [
    (m, p, gc) for m in ("full", "lora", "qlora") for p in ("fp32", "bf16-mixed", "bf16") for gc in (False, True)
]
_PEAK_FAST = {
    ("full", "fp32", False),
    ("full", "bf16-mixed", True),
    ("lora", "bf16", True),
    ("lora", "fp32", True),
    ("qlora", "bf16", True),
    ("qlora", "fp32", False),
}


@pytest.mark.parametrize(
    "method,precision,gc",
    [
        pytest.param(
            *c, id=f"{c[0]}-{c[1]}-{'gc' if c[2] else 'no-gc'}", marks=[] if c in _PEAK_FAST else [pytest.mark.slow]
        )
        for c in _PEAK_GRID
    ],
)
def test_measured_peak_matches_the_prediction(tmp_path, method, precision, gc):
    """What train really allocates is what diagnose/tune priced: train builds, steps and optimizes through the
    executor the engines price (e.g. peft's fp32 adapters on a pure-bf16 base; k-bit preparation's fp32 upcast under
    pure-bf16 QLoRA). train prints the prediction for the device it runs on (here the CPU's semantics: CPU dropout
    noise, peft's bitsandbytes LoRA layers copying their inputs as they do when CUDA autocast is off, no CUDA
    context); the real CPU run's peak is within 1.5 % of it."""
    from oomdoctor.train.sizing import predict_memory

    kw = dict(method=method, precision=precision, gradient_checkpointing=gc)
    if method != "full":
        kw.update(r=4, lora_alpha=8)
    res = _run(tmp_path, f"{method}-{precision}-{gc}", **kw)
    _, _, priced, _ = predict_memory(tiny_cfg(tmp_path / "p", **kw), res.micro_batch_size, device="cpu")
    pred = priced.peak_allocated
    assert res.memory["peak_allocated_bytes"] == pred
    assert abs(res.measured_peak_bytes - pred) / res.measured_peak_bytes < 0.015, (res.measured_peak_bytes, pred)
