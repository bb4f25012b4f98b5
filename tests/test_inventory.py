"""Any causal LM transformers can build: the parameter inventory read from the model built on the meta device."""

from __future__ import annotations

import pytest
from test_moe import DEEPSEEK_V3

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput
from oomdoctor.model.architectures import build_spec
from oomdoctor.model.inventory import spec_from_transformers
from oomdoctor.model.load import load_config
from oomdoctor.plan import Plan, validate

PLAN = validate(Plan(method="lora", precision="bf16", gradient_checkpointing=True, seq_len=2048))


@pytest.mark.parametrize(
    "model_id",
    [
        "meta-llama/Llama-2-7b-hf",
        "google/gemma-2-9b",
        "mistralai/Mixtral-8x7B-v0.1",
        "microsoft/Phi-3-mini-4k-instruct",
        "openai-community/gpt2",
        "tiiuae/falcon-7b",
    ],
)
def test_the_meta_inventory_equals_the_hand_written_builders(model_id):
    """Where a family has a hand-written builder, reading transformers' own model gives the same parameters (to
    the element) and the same price (Mixtral within 0.2 %: its router is classified by shape)."""
    cfg, _, _ = load_config(model_id)
    hand, meta = build_spec(cfg, model_id), spec_from_transformers(cfg, model_id)
    assert meta.inventory == "transformers" and hand.inventory == "hand"
    assert meta.num_params == hand.num_params
    a, b = estimate(hand, PLAN).peak_device, estimate(meta, PLAN).peak_device
    assert abs(a - b) / a <= 0.002


@pytest.mark.parametrize("model_type,published", [("gpt_oss", 116.8e9), ("deepseek_v3", 671e9)])
def test_new_model_types_are_priced_from_their_transformers_defaults(model_type, published):
    """Types without a builder: transformers' default configs are the released models (gpt-oss-120b, DeepSeek-V3);
    the inventory gives their published parameter counts and a price."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type).to_dict()
    spec = build_spec(cfg, model_type)
    assert spec.inventory == "transformers" and spec.num_experts > 0
    assert abs(spec.num_params - published) / published < 0.01
    mem = estimate(spec, validate(Plan(method="qlora", precision="bf16", gradient_checkpointing=True, seq_len=1024)))
    assert mem.peak_device > spec.num_params * 0.5  # at least the 4-bit base
    assert any("generic transformer-block formulas" in n for n in mem.notes)  # eager experts: > 64, formulas


def test_a_vision_language_model_prices_its_vision_tower_as_frozen_parameters():
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2_5_vl")
    spec = build_spec(config.to_dict(), "qwen2_5_vl")
    vision = [g for g in spec.groups if "visual" in g.path]
    assert vision and not any(g.per_layer for g in vision)
    assert {g.path for g in spec.groups if g.tower} == {g.path for g in vision}
    assert spec.num_layers == config.get_text_config().num_hidden_layers
    assert sum(g.count for g in spec.groups if g.per_layer and g.name == "q_proj") == spec.num_layers


def test_a_config_transformers_refuses_is_one_message():
    with pytest.raises(BadInput, match="transformers"):
        build_spec({"model_type": "no_such_model_type_xyz", "hidden_size": 64}, "x")


def test_a_moe_config_without_its_top_k_is_one_message():
    """transformers' default DeepSeek-V2 config leaves num_experts_per_tok unset: its router cannot run (topk with
    k=None), so it is refused with the key to set, not priced as if it routed to 2 experts."""
    with pytest.raises(BadInput, match="num_experts_per_tok is not set") as e:
        build_spec(dict(DEEPSEEK_V3, num_experts_per_tok=None), "x")
    assert "set num_experts_per_tok in config.json" in str(e.value)


def test_a_replay_a_meta_kernel_refuses_prints_no_torch_traceback(tmp_path):
    """Expert widths the grouped matmul refuses (bf16 rows not 16-byte aligned): the block measurement fails inside
    fake-tensor mode, whose logger would print a traceback; diagnose prices the blocks by formula and says nothing."""
    import json
    import subprocess
    import sys

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(DEEPSEEK_V3, moe_intermediate_size=33)))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "oomdoctor",
            "diagnose",
            str(path),
            "--method",
            "lora",
            "--precision",
            "bf16",
            "--seq-len",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "failed while attempting to run meta" not in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("model_type", ["exaone4", "olmo3", "ernie4_5"])
def test_llama_like_new_types_full_fine_tune_within_2_percent_of_the_simulation(model_type):
    """Llama-shaped blocks of types without a builder: the generic formulas match a replay of the real HF code.
    (Other block types are further off: the note on the estimate says so.)"""
    from oomdoctor.engines import simulate
    from oomdoctor.memory.analytic import estimate_analytic

    spec = build_spec(
        dict(
            model_type=model_type,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=344,
            vocab_size=512,
        ),
        model_type,
    )
    plan = validate(Plan(method="full", precision="bf16", seq_len=64, micro_batch=2))
    sim = simulate.simulate_plan(spec, plan, layers="full", round_to=1).breakdown.peak_allocated
    est = estimate_analytic(spec, plan).peak_allocated
    assert abs(est - sim) / sim <= 0.02, (est, sim)


def test_a_built_inventory_is_read_back_from_the_cache_on_disk(monkeypatch, tmp_path):
    """The next run reads the spec transformers' model gave (``oomdoctor.cache``, kind ``specs``) instead of importing
    the model's code and building it again; a damaged entry is built again."""
    from oomdoctor import cache
    from oomdoctor.model import inventory

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    cfg, _, _ = load_config("CohereLabs/c4ai-command-r7b-12-2024")
    inventory._on_disk.cache_clear()
    built = spec_from_transformers(cfg, "first")
    (entry,) = (tmp_path / "specs").iterdir()

    def not_again(*_):
        raise AssertionError("built again")

    inventory._on_disk.cache_clear()
    monkeypatch.setattr(inventory, "_built", not_again)
    read = spec_from_transformers(cfg, "second")
    assert read == type(built)(**{**built.__dict__, "name": "second"}) and read.config == built.config
    entry.write_text("{damaged")
    inventory._on_disk.cache_clear()
    with pytest.raises(AssertionError, match="built again"):
        spec_from_transformers(cfg, "third")
    inventory._on_disk.cache_clear()
