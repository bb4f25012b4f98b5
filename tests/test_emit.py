"""``tune --emit``: every foreign config is parsed by the tool's own parser and round-trips the plan's values.

TRL through ``trl.scripts.sft.make_parser`` (what ``trl sft`` runs, unknown keys refused), HF through
``HfArgumentParser(TrainingArguments)`` plus ``BitsAndBytesConfig`` / ``LoraConfig`` on the extra kwargs, accelerate
through its config loader and ``accelerate launch``'s own validation, axolotl through its pydantic schema when it
is installed. No training runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from oomdoctor.errors import BadInput
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan
from oomdoctor.plan.techniques import ALL_LINEAR
from oomdoctor.files import write_text_atomic
from oomdoctor.resources import tiny_dir
from oomdoctor.tune.emit import (
    DATASET_PLACEHOLDER, HF_EXTRA_KEYS, EmitRequest, emit, lora_targets, request_from_result, write_emitted,
)

LLAMA7B = "meta-llama/Llama-2-7b-hf"
TINY_MODEL = str(tiny_dir() / "model")

#: 7B plans covering every knob away from its default at least once.
PLANS: dict[str, Plan] = {
    "qlora": Plan(method="qlora", quant="nf4", double_quant=True, precision="bf16-mixed", optimizer="paged-adamw-8bit",
                  gradient_checkpointing=True, lora_r=16, lora_alpha=32, lora_dropout=0.05, micro_batch=4,
                  grad_accum=8, seq_len=1024),
    "lora": Plan(method="lora", precision="bf16", attn="flash", lora_targets=("q_proj", "v_proj"), lora_r=32,
                 optimizer_impl="foreach", gradient_checkpointing=True, offload_activations=True, micro_batch=2,
                 grad_accum=3, seq_len=512),
    "full": Plan(method="full", precision="fp32", attn="eager", micro_batch=1, grad_accum=16, seq_len=256),
    "int8-fp16": Plan(method="qlora", quant="int8", precision="fp16-mixed", optimizer="sgd", sgd_momentum=0.9,
                      lora_targets=("q_proj",), lora_on_head=True, offload_optimizer=True, micro_batch=3,
                      grad_accum=5, seq_len=128),
}
OPTIM = {"qlora": "paged_adamw_8bit", "lora": "adamw_torch", "full": "adamw_torch_fused", "int8-fp16": "sgd"}


@pytest.fixture(scope="module")
def spec7b():
    return load_spec(LLAMA7B)


@pytest.fixture
def gpu_bf16(monkeypatch):
    """The emitted configs are for a bf16-capable GPU; TrainingArguments checks the machine it is parsed on."""
    import transformers.training_args as ta

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _request(spec, plan: Plan, dataset: str | None = "data/train.jsonl") -> EmitRequest:
    return EmitRequest(plan=plan, model=LLAMA7B, spec=spec, dataset=dataset)


# ---------------------------------------------------------------------------------------------- TRL


def _trl_parse(path: str):
    pytest.importorskip("trl")
    from trl.scripts.sft import make_parser

    return make_parser().parse_args_and_config(["--config", path])  # unknown keys raise


@pytest.mark.parametrize("name", list(PLANS))
def test_trl_config_parses_and_round_trips(name, spec7b, tmp_path, gpu_bf16):
    plan = PLANS[name]
    em = emit("trl", _request(spec7b, plan))
    script, sft, model, data = _trl_parse(_write(tmp_path, "trl.yaml", em.text))
    assert sft.per_device_train_batch_size == plan.micro_batch
    assert sft.gradient_accumulation_steps == plan.grad_accum
    assert sft.per_device_train_batch_size * sft.gradient_accumulation_steps == plan.effective_batch
    assert sft.max_length == plan.seq_len
    assert sft.gradient_checkpointing is plan.gradient_checkpointing  # TRL's default is True: written explicitly
    assert sft.activation_offloading is plan.offload_activations
    assert str(sft.optim.value) == OPTIM[name]
    assert (sft.bf16, sft.fp16) == (plan.precision in ("bf16", "bf16-mixed"), plan.precision == "fp16-mixed")
    assert model.dtype == ("bfloat16" if plan.precision == "bf16" else "float32")
    assert model.model_name_or_path == LLAMA7B
    assert model.attn_implementation == {"sdpa": "sdpa", "flash": "flash_attention_2", "eager": "eager"}[plan.attn]
    assert model.use_peft is plan.uses_lora
    assert model.load_in_4bit is (plan.quant in ("nf4", "fp4"))
    assert model.load_in_8bit is (plan.quant == "int8")
    assert data.datasets[0].path == "json" and data.datasets[0].data_files == "data/train.jsonl"
    if plan.uses_lora:
        assert (model.lora_r, model.lora_alpha, model.lora_dropout) == (plan.lora_r, plan.lora_alpha,
                                                                        plan.lora_dropout)
    if plan.quant == "nf4":
        assert model.bnb_4bit_quant_type == "nf4" and model.use_bnb_nested_quant is True
        assert any("bnb_4bit_compute_dtype bfloat16" in n for n in em.notes)  # TRL computes in the model dtype
    if plan.optimizer == "sgd":
        assert sft.optim_args == "momentum=0.9"


def test_trl_builds_the_planned_peft_and_bnb_configs(spec7b, tmp_path, gpu_bf16):
    from trl import get_peft_config, get_quantization_config

    _, _, model, _ = _trl_parse(_write(tmp_path, "q.yaml", emit("trl", _request(spec7b, PLANS["qlora"])).text))
    q = get_quantization_config(model)
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    peft = get_peft_config(model)
    assert peft.target_modules == ALL_LINEAR and peft.r == 16 and peft.lora_alpha == 32


def test_trl_single_lora_target_still_adapts_every_layer(tiny_config, tmp_path):
    """TRL hands a one-element target list to peft as a string, which peft full-matches against the module path:
    the single target is written as that regex, and peft adapts the module in every layer of a real model."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import get_peft_config

    from oomdoctor.model.load import spec_from_config

    spec = spec_from_config(tiny_config, name="tiny-llama")
    plan = Plan(method="lora", lora_targets=("q_proj",), seq_len=64)
    _, _, margs, _ = _trl_parse(_write(tmp_path, "t.yaml", emit("trl", _request(spec, plan)).text))
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(LlamaConfig(**tiny_config)), get_peft_config(margs))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert len(adapted) == tiny_config["num_hidden_layers"] and all(n.endswith("q_proj") for n in adapted)


# ---------------------------------------------------------------------------------------------- HF


@pytest.mark.parametrize("name", list(PLANS))
def test_hf_json_parses_into_training_arguments_and_kwargs(name, spec7b, tmp_path, gpu_bf16):
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, HfArgumentParser, TrainingArguments

    plan = PLANS[name]
    path = _write(tmp_path, "hf.json", emit("hf", _request(spec7b, plan)).text)
    (args,) = HfArgumentParser(TrainingArguments).parse_json_file(path, allow_extra_keys=True)
    doc = json.loads(Path(path).read_text())
    strict = {k: v for k, v in doc.items() if k not in HF_EXTRA_KEYS}
    HfArgumentParser(TrainingArguments).parse_dict(strict)  # every other key is a TrainingArguments field
    assert set(doc) - set(strict) == set(HF_EXTRA_KEYS)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == plan.effective_batch
    assert args.per_device_train_batch_size == plan.micro_batch
    assert str(args.optim.value) == OPTIM[name]
    assert args.gradient_checkpointing is plan.gradient_checkpointing
    assert (args.bf16, args.fp16) == (plan.precision in ("bf16", "bf16-mixed"), plan.precision == "fp16-mixed")
    assert doc["max_length"] == plan.seq_len
    assert doc["model_init_kwargs"]["dtype"] == ("bfloat16" if plan.precision == "bf16" else "float32")
    if plan.quant:
        q = BitsAndBytesConfig(**doc["quantization_config"])
        assert q.load_in_4bit is (plan.quant == "nf4") and q.load_in_8bit is (plan.quant == "int8")
        if plan.quant == "nf4":
            assert q.bnb_4bit_use_double_quant and str(q.bnb_4bit_compute_dtype) == "torch.bfloat16"
    else:
        assert doc["quantization_config"] is None
    if plan.uses_lora:
        lc = LoraConfig(**doc["peft_config"])
        assert lc.r == plan.lora_r and lc.lora_alpha == plan.lora_alpha
    else:
        assert doc["peft_config"] is None


def test_hf_notes_name_what_training_arguments_cannot_say(spec7b):
    em = emit("hf", _request(spec7b, PLANS["lora"]))
    assert any(n.startswith("offload_activations: not expressible in HF TrainingArguments") for n in em.notes)
    em = emit("hf", _request(spec7b, PLANS["int8-fp16"]))
    assert any(n.startswith("offload_optimizer: not expressible") for n in em.notes)
    assert json.loads(em.text)["oomdoctor"]["notes"] == list(em.notes)


def test_the_adapter_dtype_each_tool_runs_is_said(spec7b):
    """TRL's SFTTrainer casts a quantized model's adapters to bf16 (and only those): a plan with other adapters
    says so; HF/axolotl/accelerate scripts are told how to get bf16 adapters."""
    qlora = Plan(method="qlora", quant="nf4", precision="bf16-mixed")
    fp32_notes = emit("trl", _request(spec7b, qlora)).notes
    assert any(n.startswith("adapter_dtype fp32: not expressible in TRL") for n in fp32_notes)
    assert not any("adapter_dtype" in n for n in emit("trl", _request(spec7b, qlora.with_(adapter_dtype="bf16"))).notes)
    for target in ("hf", "axolotl", "accelerate"):
        notes = emit(target, _request(spec7b, qlora.with_(adapter_dtype="bf16"))).notes
        assert any("cast every trainable parameter to torch.bfloat16" in n for n in notes), target


# ---------------------------------------------------------------------------------------------- accelerate


@pytest.mark.parametrize("name", list(PLANS))
def test_accelerate_launch_config_loads(name, spec7b, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    plan = PLANS[name]
    path = _write(tmp_path, "acc.yaml", emit("accelerate", _request(spec7b, plan)).text)
    cfg = load_config_from_file(path)
    assert isinstance(cfg, ClusterConfig) and cfg.num_processes == plan.world_size
    want = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16": "bf16"}[plan.precision]
    assert cfg.mixed_precision == want
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
    assert args.mixed_precision == want and args.num_processes == plan.world_size
    if plan.offload_optimizer:
        assert args.use_deepspeed and args.zero_stage == 2 and args.offload_optimizer_device == "cpu"
        assert int(args.gradient_accumulation_steps) == plan.grad_accum
    else:
        assert not args.use_deepspeed


def test_accelerate_lists_the_script_settings(spec7b):
    em = emit("accelerate", _request(spec7b, PLANS["qlora"]))
    script = next(n for n in em.notes if n.startswith("the training knobs are train.py's"))
    for part in ("per_device_train_batch_size 4", "gradient_accumulation_steps 8", "optim paged_adamw_8bit",
                 "bnb_4bit_use_double_quant=True", "LoRA r 16"):
        assert part in script
    assert "#   - the training knobs" in em.text


# ---------------------------------------------------------------------------------------------- axolotl


@pytest.mark.parametrize("name", list(PLANS))
def test_axolotl_config(name, spec7b):
    plan = PLANS[name]
    em = emit("axolotl", _request(spec7b, plan))
    doc = yaml.safe_load(em.text)
    assert (doc["micro_batch_size"], doc["gradient_accumulation_steps"]) == (plan.micro_batch, plan.grad_accum)
    assert doc["sequence_len"] == plan.seq_len and doc["optimizer"] == OPTIM[name]
    assert doc.get("adapter") == {"full": None, "lora": "lora"}.get(plan.method, "qlora" if plan.quant != "int8"
                                                                   else "lora")
    assert doc["datasets"] == [{"path": "data/train.jsonl", "split": "train", "type": "completion",
                                "ds_type": "json"}]
    if plan.lora_targets == (ALL_LINEAR,) and plan.uses_lora:
        assert doc["lora_target_linear"] is True
    if plan.quant == "nf4":
        assert doc["bnb_config_kwargs"] == {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                                            "bnb_4bit_compute_dtype": "bfloat16"}
    schema = pytest.importorskip("axolotl.utils.schemas.config")
    cfg = schema.AxolotlInputConfig(**doc)
    assert cfg.micro_batch_size == plan.micro_batch and cfg.sequence_len == plan.seq_len


# ---------------------------------------------------------------------------------------------- shared


def test_lora_targets(spec7b):
    assert lora_targets(Plan(method="lora"), spec7b) == ALL_LINEAR
    assert lora_targets(Plan(method="lora", lora_on_head=True), spec7b) == [
        "down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert lora_targets(Plan(method="lora", lora_targets=("v_proj", "q_proj")), spec7b) == ["q_proj", "v_proj"]


@pytest.mark.parametrize("target", ["trl", "hf", "axolotl", "accelerate"])
def test_missing_dataset_is_a_named_placeholder(target, spec7b):
    em = emit(target, _request(spec7b, PLANS["full"], dataset=None))
    assert DATASET_PLACEHOLDER in em.text and any("placeholder" in n for n in em.notes)


def test_unknown_target_is_bad_input(spec7b):
    with pytest.raises(BadInput, match="--emit"):
        emit("deepspeed", _request(spec7b, PLANS["full"]))


def test_write_text_is_atomic_and_refuses_to_overwrite(tmp_path):
    p = tmp_path / "sub" / "x.yaml"
    write_text_atomic(p, "a: 1\n")
    with pytest.raises(BadInput, match="exists"):
        write_text_atomic(p, "a: 2\n")
    write_text_atomic(p, "a: 2\n", overwrite=True)
    assert p.read_text() == "a: 2\n" and [q.name for q in p.parent.iterdir()] == ["x.yaml"]


def test_tune_result_on_the_bundled_tiny_model(tmp_path, gpu_bf16):
    from oomdoctor.tune.tuner import tune

    r = tune(TINY_MODEL, gpu_mem=10**9, seq_len=64, global_batch=8, gpu=None, verify_mode="none")
    req = request_from_result(r, TINY_MODEL, "bundled:tiny/train.jsonl")
    assert req.model == TINY_MODEL and not req.model_has_weights and req.plan == r.plan
    w = write_emitted(r, TINY_MODEL, "trl", tmp_path / "t.yaml", dataset="bundled:tiny/train.jsonl")
    assert w.command.endswith(f"trl sft --config {tmp_path / 't.yaml'}")
    assert any("config without weights" in n for n in w.emitted.notes)
    _, sft, _, _ = _trl_parse(str(w.path))
    assert sft.per_device_train_batch_size * sft.gradient_accumulation_steps == 8
    assert f"# Plan: {r.plan.label()}" in w.path.read_text()


def test_cli_tune_emit_trl(tmp_path, monkeypatch, capsys, gpu_bf16):
    from oomdoctor.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["tune", TINY_MODEL, "--gpu-mem", "1GB", "--seq-len", "64", "--global-batch", "8", "--emit", "trl",
            "--verify", "none", "--output", "x.yaml", "--json"]
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None)
    d = json.loads(capsys.readouterr().out)
    assert d["emit"] == "trl" and d["config_path"] == "x.yaml"
    assert d["command"].endswith("trl sft --config x.yaml")
    _, sft, model, _ = _trl_parse(str(tmp_path / "x.yaml"))
    assert sft.per_device_train_batch_size == d["plan"]["micro_batch_size"]
    assert sft.gradient_accumulation_steps == d["plan"]["gradient_accumulation_steps"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "exists" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- several GPUs

MULTI: dict[str, Plan] = {
    "ddp": Plan(method="lora", precision="bf16", world_size=2, strategy="ddp", micro_batch=2, seq_len=1024),
    "fsdp": Plan(method="full", precision="bf16-mixed", gradient_checkpointing=True, world_size=8, strategy="fsdp"),
    "hsdp": Plan(method="full", precision="bf16-mixed", world_size=16, strategy="fsdp", shard_group=8,
                 reshard_after_forward=False),
    "fsdp-offload": Plan(method="full", precision="bf16-mixed", world_size=4, strategy="fsdp", offload_params=True),
    "zero3-offload": Plan(method="full", precision="bf16-mixed", world_size=8, strategy="zero3",
                          offload_optimizer=True),
    "zero2": Plan(method="full", precision="bf16-mixed", world_size=8, strategy="zero2", bucket_size=10**7),
}


@pytest.mark.parametrize("name", list(MULTI))
def test_accelerate_launch_config_for_each_strategy(name, spec7b, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    plan = MULTI[name]
    req = EmitRequest(plan=plan, model=LLAMA7B, spec=spec7b, dataset="d.jsonl",
                      gpus_per_node=8 if plan.world_size > 8 else None)
    em = emit("accelerate", req)
    path = _write(tmp_path, "acc.yaml", em.text)
    cfg = load_config_from_file(path)
    assert cfg.num_processes == plan.world_size and cfg.num_machines == plan.world_size // min(plan.world_size, 8)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
    assert args.num_processes == plan.world_size
    if plan.strategy == "ddp":
        assert args.multi_gpu and not args.use_fsdp and not args.use_deepspeed
    elif plan.strategy == "fsdp":
        assert args.use_fsdp and int(args.fsdp_version) == 2
        assert args.fsdp_transformer_layer_cls_to_wrap == "LlamaDecoderLayer"
        assert args.fsdp_auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
        assert str(args.fsdp_reshard_after_forward).lower() == str(plan.reshard_after_forward).lower()
        assert str(args.fsdp_offload_params).lower() == str(plan.offload_params).lower()
        if plan.shard_group:
            assert cfg.parallelism_config == {"parallelism_config_dp_replicate_size": 2,
                                              "parallelism_config_dp_shard_size": 8}
    else:
        assert args.use_deepspeed and args.zero_stage == (3 if plan.strategy == "zero3" else 2)
        assert args.offload_optimizer_device == ("cpu" if plan.offload_optimizer else "none")
        if plan.bucket_size:
            assert any("bucket_size 10,000,000: not expressible" in n for n in em.notes)


@pytest.mark.parametrize("name", ["fsdp", "hsdp", "zero3-offload", "zero2"])
def test_hf_and_trl_set_fsdp_or_deepspeed(name, spec7b, tmp_path, gpu_bf16):
    from transformers import HfArgumentParser, TrainingArguments

    plan = MULTI[name]
    if plan.strategy != "fsdp":  # TrainingArguments parses a deepspeed config only with deepspeed installed
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    em = emit("hf", _request(spec7b, plan))
    (args,) = HfArgumentParser(TrainingArguments).parse_json_file(_write(tmp_path, "hf.json", em.text),
                                                                  allow_extra_keys=True)
    assert any("torchrun --nproc-per-node" in n for n in em.notes)
    if plan.strategy == "fsdp":
        assert args.fsdp_config["version"] == 2
        assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
        assert args.fsdp_config["reshard_after_forward"] is plan.reshard_after_forward
        assert (any("shard_group 8 (HSDP): not expressible" in n for n in em.notes)) is bool(plan.shard_group)
    else:
        zero = args.deepspeed["zero_optimization"]
        assert zero["stage"] == (3 if plan.strategy == "zero3" else 2)
        assert zero["reduce_bucket_size"] == (plan.bucket_size or 4096 ** 2)
        assert ("offload_optimizer" in zero) is plan.offload_optimizer
        assert not any(n.startswith("offload_optimizer: not expressible") for n in em.notes)
    trl = emit("trl", _request(spec7b, plan))
    _, sft, _, _ = _trl_parse(_write(tmp_path, "trl.yaml", trl.text))
    assert (sft.deepspeed is not None) is (plan.strategy != "fsdp")
