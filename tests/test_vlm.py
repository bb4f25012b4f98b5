"""Vision-language models fine-tuned on text: transformers builds their text side only inside the multimodal class
(``AutoModelForImageTextToText``); the executor builds that class, freezes the towers text never runs and keeps LoRA
off them, and the memory model prices exactly that (towers' weights held, never trained)."""

from __future__ import annotations

import json

import pytest
from train_util import cli, tiny_cfg, write_yaml

from oomdoctor.engines import blocks, estimate
from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import Plan, validate


def tiny_vlm(vocab: int = 512) -> dict:
    """transformers' Qwen2.5-VL config at a CPU test size (mrope sections summing to half the head dim)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen2_5_vl").to_dict()
    cfg["text_config"].update(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        layer_types=None,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
    )
    cfg["vision_config"].update(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, fullatt_block_indexes=[1]
    )
    return cfg


@pytest.fixture(scope="module")
def spec():
    return spec_from_config(tiny_vlm(), name="tiny-qwen2.5-vl")


def test_the_towers_are_what_lies_outside_the_text_decoder_and_the_head(spec):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from oomdoctor.model.inventory import auto_model_class, tower_prefixes

    config = AutoConfig.for_model("qwen2_5_vl", **{k: v for k, v in tiny_vlm().items() if k != "model_type"})
    assert auto_model_class(config).__name__ == "AutoModelForImageTextToText"
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
        llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", num_hidden_layers=1))
    assert tower_prefixes(model) == ("model.visual",)
    assert tower_prefixes(llama) == ()
    assert {g.path.split(".")[1] for g in spec.groups if g.tower} == {"visual"}
    assert not any(g.per_layer for g in spec.groups if g.tower)


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_the_executor_trains_the_text_side_only_and_the_formulas_count_the_same(spec, method):
    """Tower parameters are frozen in every method, LoRA adapts no tower module (peft ``exclude_modules``), and the
    trainable count the executor builds is the one the memory model prices."""
    from oomdoctor.execute.build import build_model
    from oomdoctor.memory.context import make_ctx
    from oomdoctor.memory.gradients import trainable_numel

    plan = validate(Plan(method=method, precision="bf16", seq_len=64))
    model = build_model(spec, plan).model
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and not any(".visual." in n for n in trainable)
    assert not any(".visual." in n and "lora_" in n for n, _ in model.named_parameters())
    assert sum(trainable.values()) == trainable_numel(make_ctx(spec, plan))


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="full", precision="bf16"),
        dict(method="lora", precision="bf16", gradient_checkpointing=True),
        dict(method="qlora", precision="bf16-mixed", gradient_checkpointing=True),
    ],
    ids=["full", "lora-gc", "qlora-gc"],
)
def test_analytic_within_2_percent_of_the_replay(spec, kw):
    """The text blocks are replayed (measured, not the generic formulas) and the whole step agrees with the
    simulated one; before, the executor could not build the model and the optimizer states of the never-run tower
    were priced (Gemma 3 multimodal, full bf16: +6.5 %)."""
    plan = validate(Plan(seq_len=256, micro_batch=2, **kw))
    assert blocks.block_saves(spec, plan) is not None
    a = estimate(spec, plan, "analytic").peak_allocated
    s = estimate(spec, plan, "simulate").peak_allocated
    assert abs(a - s) <= 0.02 * s, (a, s)


@pytest.mark.slow
def test_the_bundled_qwen2_5_vl_7b_blocks_price_as_replayed():
    """The released Qwen2.5-VL-7B shapes, cut to 2 blocks, every block replayed: analytic equals the replay."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from blocks_vs_simulate import shrink

    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.model.architectures import build_spec
    from oomdoctor.model.load import load_spec

    full = load_spec("Qwen/Qwen2.5-VL-7B-Instruct")
    assert full.num_params == 8_292_166_656 and sum(g.total_numel for g in full.groups if g.tower) > 6e8
    cut = build_spec(shrink(dict(full.config), 2), "Qwen2.5-VL-7B@2")
    for kw in (
        dict(method="full", precision="bf16"),
        dict(method="qlora", precision="bf16-mixed", gradient_checkpointing=True),
    ):
        plan = validate(Plan(seq_len=2048, **kw))
        a = estimate(cut, plan, "analytic").peak_allocated
        s = simulate_plan(cut, plan, layers="full").breakdown.peak_allocated
        assert abs(a - s) <= 0.005 * s, (kw, a, s)


def test_train_runs_a_vision_language_model_from_the_cli_and_merges_a_loadable_model(tmp_path):
    """``oomdoctor train`` on a Qwen2.5-VL config: QLoRA on the text side, the towers frozen (and quantized, as
    transformers' bitsandbytes loading does), the merged output a plain model AutoModelForImageTextToText loads."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForImageTextToText

    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps(tiny_vlm(vocab=474)))
    base = tiny_cfg(tmp_path / "out", method="qlora", precision="bf16-mixed", max_steps=2, merge_adapter=True)
    cfg = replace(base, model=replace(base.model, config=str(tmp_path / "vl" / "config.json")))
    p = cli("train", write_yaml(tmp_path / "vl.yaml", cfg), "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    summary = json.loads(p.stdout)
    assert summary["optimizer_steps"] == 2
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter["exclude_modules"] == r"(model\.visual)(\..*)?"
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "merged")
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert all(p.dtype.is_floating_point for p in merged.parameters())
    with torch.no_grad():
        assert torch.isfinite(merged(torch.randint(0, 474, (1, 16))).logits).all()


@pytest.mark.parametrize(
    "targets,head", [(("all-linear",), False), (("q_proj", "v_proj"), False), (("all-linear",), True)]
)
def test_emitted_targets_adapt_what_the_executor_adapts(spec, targets, head):
    """TRL and axolotl have no ``exclude_modules``: ``tune --emit`` writes one regex for the text side's linears,
    and peft given it adapts exactly the modules the executor's all-linear + exclude_modules adapts."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from oomdoctor.execute.build import build_model, hf_config
    from oomdoctor.execute.trainers.common import lora_targets
    from oomdoctor.model.inventory import auto_model_class

    plan = validate(Plan(method="lora", precision="bf16", seq_len=64, lora_targets=targets, lora_on_head=head))

    def adapted(model) -> set[str]:
        return {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer)}

    ours = adapted(build_model(spec, plan).model)
    config = hf_config(spec, plan)
    with torch.device("meta"):
        fresh = auto_model_class(config).from_config(config)
    emitted = lora_targets(plan, spec)
    assert isinstance(emitted, str) and "visual" in emitted
    theirs = adapted(get_peft_model(fresh, LoraConfig(r=8, target_modules=emitted)))
    assert ours == theirs and ours and not any("visual" in n for n in ours)


def test_llama_3_2_vision_image_cross_attention_layers_are_its_tower():
    """Llama-3.2-Vision's text model skips its image cross-attention layers (Meta's "vision adapter") without image
    states: frozen like a tower, priced with weights alone, and simulate extrapolates in their period (5 blocks).
    Before, the full fine-tune of the released shape at 40 blocks was priced +15 % (their gradients and AdamW
    states) and LoRA's extrapolated replay +8 %."""
    import sys
    from pathlib import Path

    from transformers import AutoConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from blocks_vs_simulate import shrink

    from oomdoctor.engines.kinds import layer_period
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.execute.build import build_model
    from oomdoctor.memory.context import make_ctx
    from oomdoctor.memory.gradients import trainable_numel
    from oomdoctor.model.architectures import build_spec

    spec = build_spec(shrink(AutoConfig.for_model("mllama").to_dict(), 10), "mllama@10")
    assert spec.towers == ("model.layers.3", "model.layers.8")
    plan = validate(Plan(method="full", precision="bf16", seq_len=256))
    assert layer_period(spec, plan) == 5
    model = build_model(spec, plan).model
    frozen = {n.split(".")[2] for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"3", "8"}
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable_numel(make_ctx(spec, plan))
    full = simulate_plan(spec, plan, layers="full").breakdown.peak_allocated
    assert abs(estimate(spec, plan, "analytic").peak_allocated - full) <= 0.005 * full
