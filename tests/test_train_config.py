"""train config: strict validation (all problems at once), aliases, plan round trips, the commented YAML."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oomdoctor.errors import ConfigErrors
from oomdoctor.plan import Plan, validate
from oomdoctor.train.config import TrainConfig, config_from_plan, load_train_config, parse_train_config, render_yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "train" / "tiny-cpu.yaml"
GOOD = {
    "model": {"config": "bundled:tiny/model/config.json", "init": "random", "tokenizer": "bundled:tiny/tokenizer"},
    "dataset": {"path": "bundled:tiny/train.jsonl"},
}


def _parse(**top):
    return parse_train_config({**GOOD, **top}, base_dir=ROOT)


def test_bundled_configs_load():
    cfg = load_train_config(TINY)
    assert cfg.model.init == "random" and cfg.max_steps > 0
    assert cfg.to_plan().micro_batch == cfg.micro_batch_size
    for name in ("llama2-7b-qlora-24gb.yaml", "mistral-7b-lora-40gb.yaml", "tinyllama-full-24gb.yaml"):
        raw = yaml.safe_load((ROOT / "configs" / "train" / name).read_text())
        cfg = parse_train_config(raw, check_paths=False)
        assert cfg.gpu_mem and cfg.to_plan()


def test_all_problems_reported_at_once():
    raw = {
        "model": {"pathh": "x"},
        "dataset": {"path": "no/such/file.jsonl", "packng": True},
        "learning_rat": 1e-4,
        "bf16": True,
        "fp16": True,
        "per_device_train_batch_size": "big",
        "optim": "adamw8bit",
        "method": "full",
        "load_in_4bit": True,
        "lora_dropout": 1.5,
        "global_batch_size": 10,
        "micro_batch_size": 3,
    }
    with pytest.raises(ConfigErrors) as ei:
        parse_train_config(raw, base_dir=ROOT)
    text = str(ei.value)
    probs = ei.value.problems
    assert len(probs) >= 9, probs
    for needle in (
        "learning_rat: unknown key; did you mean 'learning_rate'",
        "model.pathh: unknown key; did you mean 'model.path'",
        "dataset.packng: unknown key; did you mean 'dataset.packing'",
        "bf16 and fp16 are both true",
        "per_device_train_batch_size: expected an integer or 'auto'",
        "did you mean 'adamw_8bit'",
        "method: full cannot train a bitsandbytes-quantized base",
        "lora_dropout: must be in [0, 1)",
        "dataset.path: 'no/such/file.jsonl' does not exist",
        "micro_batch_size: conflicts with per_device_train_batch_size",
    ):
        assert needle in text, (needle, text)


def test_aliases_and_batch_resolution():
    cfg = _parse(per_device_train_batch_size=4, global_batch_size=32, max_seq_length=256, bf16=True)
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.seq_len) == (4, 8, 256)
    assert cfg.precision == "bf16-mixed" and cfg.effective_batch_size == 32
    with pytest.raises(ConfigErrors, match="not a multiple"):
        _parse(micro_batch_size=3, global_batch_size=10)
    with pytest.raises(ConfigErrors, match=r"global_batch_size: 12 != micro_batch_size 4 x gradient_accumulation"):
        _parse(micro_batch_size=4, gradient_accumulation_steps=2, global_batch_size=12)
    ranks = _parse(micro_batch_size=4, global_batch_size=64, world_size=8, strategy="fsdp")
    assert ranks.gradient_accumulation_steps == 2  # global = micro x accumulation x world_size
    _parse(micro_batch_size=4, gradient_accumulation_steps=2, global_batch_size=64, world_size=8)
    with pytest.raises(ConfigErrors, match=r"!= micro_batch_size 4 x gradient_accumulation_steps 2 x world_size 8"):
        _parse(micro_batch_size=4, gradient_accumulation_steps=2, global_batch_size=8, world_size=8)
    auto = _parse(micro_batch_size="auto", global_batch_size=16)
    assert auto.micro_batch_size == "auto" and auto.effective_batch_size == 16
    with pytest.raises(ConfigErrors, match="precision: 'fp32' conflicts with bf16: true"):
        _parse(precision="fp32", bf16=True)


def test_qlora_normalization_and_plan():
    cfg = _parse(method="lora", load_in_4bit=True, bnb_4bit_use_double_quant=True, precision="bf16-mixed")
    plan = cfg.to_plan()
    assert cfg.method == "qlora" and plan.method == "qlora" and plan.quant == "nf4" and plan.double_quant
    assert _parse(method="qlora").load_in_4bit is True
    with pytest.raises(ConfigErrors, match="load_in_4bit and load_in_8bit"):
        _parse(method="qlora", load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ConfigErrors, match="paged optimizers already page"):
        _parse(optim="paged_adamw_8bit", offload_optimizer=True)


def test_random_init_needs_config_and_tokenizer():
    with pytest.raises(ConfigErrors) as ei:
        parse_train_config({"model": {"init": "random"}, "dataset": GOOD["dataset"]}, base_dir=ROOT)
    assert "model.config: missing" in str(ei.value) and "model.tokenizer: required" in str(ei.value)


@pytest.mark.parametrize(
    "plan",
    [
        Plan(
            method="qlora",
            precision="bf16-mixed",
            optimizer="paged-adamw-8bit",
            gradient_checkpointing=True,
            micro_batch=4,
            grad_accum=8,
            seq_len=1024,
            double_quant=True,
        ),
        Plan(
            method="full",
            precision="bf16",
            optimizer="adamw",
            optimizer_impl="fused",
            micro_batch=2,
            grad_accum=3,
            offload_optimizer=True,
            offload_activations=True,
            attn="eager",
        ),
        Plan(
            method="lora",
            precision="fp16-mixed",
            optimizer="sgd",
            sgd_momentum=0.9,
            lora_targets=("q_proj", "v_proj"),
            lora_on_head=True,
            quant="int8",
        ),
        Plan(method="lora", precision="fp32", optimizer="adafactor", lora_r=8, lora_dropout=0.0),
        Plan(method="full", precision="bf16", world_size=8, strategy="zero3", bucket_size=10**7),
    ],
)
def test_plan_yaml_round_trip(plan):
    cfg = config_from_plan("meta-llama/Llama-2-7b-hf", plan, max_steps=200, dataset="data/x.jsonl", gpu_mem="24GB")
    text = render_yaml(cfg, header="test header")
    # every memory knob is commented with its effect
    for key in (
        "micro_batch_size",
        "gradient_checkpointing",
        "optim",
        "offload_optimizer",
        "load_in_4bit",
        "r",
        "seq_len",
        "precision",
        "method",
    ):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{key}:"))
        assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, line
    back = parse_train_config(yaml.safe_load(text), check_paths=False)
    assert back == cfg
    assert back.to_plan() == validate(plan)


def test_cli_config_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {pathh: x}\ndataset: {path: nope.jsonl}\nlearning_rat: 1\nwarmup_steps: -1\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "oomdoctor", "train", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    for needle in ("learning_rat", "model.pathh", "nope.jsonl", "warmup_steps: must be >= 0"):
        assert needle in p.stderr, p.stderr
    yaml_err = tmp_path / "broken.yaml"
    yaml_err.write_text("model: [unclosed\n")
    p = subprocess.run(
        [sys.executable, "-m", "oomdoctor", "train", str(yaml_err)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2 and "not valid YAML" in p.stderr and "Traceback" not in p.stderr


def test_defaults_are_documented():
    import inspect
    from dataclasses import fields

    src = inspect.getsource(TrainConfig)
    for f in fields(TrainConfig):
        assert f"    {f.name}:" in src
        # a docstring follows every field (litgpt style)
        after = src.split(f"\n    {f.name}:", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f.name


def test_cli_import_stays_light():
    """`oomdoctor --help` stays instant: the train command and its config module import no torch stack."""
    code = (
        "import sys, oomdoctor.cli, oomdoctor.train.config, oomdoctor.train.dryrun; "
        "print([m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules])"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
