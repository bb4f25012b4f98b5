"""One vocabulary: the technique table drives the plan, the train YAML, the flags and the advice.

- every ``settings`` object diagnose/tune print is a train YAML with the same plan;
- every advice change, written as YAML keys, turns the train config into exactly the changed plan;
- every advice change, written as flags, uses only flags that diagnose has;
- one default per knob, the Hugging Face one.
"""

from __future__ import annotations

import pytest
import yaml

from oomdoctor.diagnose.advice import advise
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan, validate
from oomdoctor.plan.budget import Budget
from oomdoctor.plan.techniques import DEFAULTS, TECHNIQUES
from oomdoctor.train.config import config_from_plan, parse_train_config, render_yaml, to_plan
from oomdoctor.train.config.sections import TrainConfig

BASE = {"model": {"config": "m/config.json", "init": "random", "tokenizer": "tok"}, "dataset": {"path": "d.jsonl"}}

PLANS = [
    Plan(),
    Plan(
        method="full",
        precision="bf16",
        optimizer="adamw-8bit",
        gradient_checkpointing=True,
        micro_batch=4,
        grad_accum=8,
        seq_len=512,
    ),
    Plan(method="full", precision="bf16-mixed", optimizer="adamw", optimizer_impl="foreach", offload_optimizer=True),
    Plan(method="lora", precision="bf16-mixed", lora_r=16, lora_targets=("q_proj", "v_proj"), attn="eager"),
    Plan(
        method="qlora",
        precision="bf16",
        quant="nf4",
        double_quant=True,
        optimizer="paged-adamw-8bit",
        offload_activations=True,
    ),
    Plan(method="qlora", precision="fp16-mixed", quant="int8", optimizer="adafactor", lora_on_head=True),
    Plan(method="full", optimizer="sgd", sgd_momentum=0.9, lora_dropout=0.1),
]


def _train_plan(top: dict) -> Plan:
    raw = {**BASE, **top}
    return to_plan(parse_train_config(raw, check_paths=False))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label())
def test_settings_paste_into_a_train_yaml_as_the_same_plan(plan):
    plan = validate(plan)
    settings = plan.settings()
    assert _train_plan(settings) == plan


def _yaml_changes(text: str) -> dict:
    """``key: value, key2: value2`` (the advice's YAML form) as a mapping; ``model.x`` goes into ``model:``."""
    flat = yaml.safe_load("{" + text + "}")
    out: dict = {}
    for k, v in flat.items():
        if k.startswith("model."):
            out.setdefault("model", {})[k.removeprefix("model.")] = v
        else:
            out[k] = v
    return out


def _diagnose_flags() -> set[str]:
    import typer.main

    from oomdoctor.cli.app import app

    cmd = typer.main.get_command(app).commands["diagnose"]  # type: ignore[attr-defined]
    return {opt for p in cmd.params for opt in p.opts + p.secondary_opts}


@pytest.mark.parametrize(
    "plan",
    [
        Plan(method="full", precision="fp32", attn="eager", optimizer_impl="foreach", micro_batch=8, seq_len=1024),
        Plan(method="lora", precision="fp32", lora_on_head=True, micro_batch=2, seq_len=2048),
        Plan(method="qlora", quant="int8", precision="bf16-mixed", micro_batch=2, seq_len=1024),
    ],
    ids=lambda p: p.label(),
)
def test_every_advice_change_is_real_yaml_keys_and_real_diagnose_flags(plan):
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    plan = validate(plan)
    advice = advise(spec, plan, Budget(capacity_bytes=4 * 10**9, source="flag"), with_path=False)
    assert len(advice.single) >= 5
    flags = _diagnose_flags()
    cfg = config_from_plan("m/config.json", plan, init="random", tokenizer="tok", dataset="d.jsonl")
    start = yaml.safe_load(render_yaml(cfg))  # the YAML tune writes: Hugging Face key names
    for ch in advice.single:
        changes = _yaml_changes(ch.yaml)
        if "model" in changes:
            changes["model"] = {**start["model"], **changes["model"]}
        top = {**start, **changes}
        assert to_plan(parse_train_config(top, check_paths=False)) == ch.plan, (ch.id, ch.yaml)
        used = [w for w in ch.flags.split() if w.startswith("--")]
        assert used and set(used) <= flags, (ch.id, ch.flags)


def test_one_default_per_knob_the_hugging_face_one():
    assert Plan().settings() == {
        **{t.setting: (list(t.default) if isinstance(t.default, tuple) else t.default) for t in TECHNIQUES},
        "effective_batch_size": 1,
    }
    # what HF Trainer / peft give without arguments
    assert DEFAULTS["precision"] == "fp32" and DEFAULTS["optimizer"] == "adamw"
    assert DEFAULTS["optimizer_impl"] == "fused"  # adamw_torch_fused is TrainingArguments.optim's default on CUDA
    assert DEFAULTS["lora_r"] == 8 and DEFAULTS["lora_alpha"] == 8 and DEFAULTS["lora_dropout"] == 0.0
    cfg = TrainConfig()
    assert cfg.optim == "adamw_torch" and cfg.optim_impl == "fused" and cfg.precision == "fp32"
    assert cfg.r == 8 and cfg.lora_dropout == 0.0 and cfg.gradient_accumulation_steps == 1


def test_optimizer_impl_is_priced_on_diagnose_and_tune():
    from oomdoctor.engines import estimate

    spec = load_spec("meta-llama/Llama-2-7b-hf")
    fused = estimate(spec, validate(Plan(precision="bf16")), "analytic")
    foreach = estimate(spec, validate(Plan(precision="bf16", optimizer_impl="foreach")), "analytic")
    assert foreach.peak_device > fused.peak_device  # group-sized temporaries at the step
