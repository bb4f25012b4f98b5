"""``tune --emit``: every foreign config is parsed by the trainer's own parser and round-trips the plan's values; a
plan a trainer cannot run is never written; the header lists every knob with the key that carries it.

TRL through ``trl.scripts.sft.make_parser`` (what ``trl sft`` runs, unknown keys refused), HF through
``HfArgumentParser(TrainingArguments)`` plus ``BitsAndBytesConfig`` / ``LoraConfig`` on the script's keys, accelerate
through its config loader and ``accelerate launch``'s own validation, axolotl through its pydantic schema when it
is installed. No training runs here (tests/test_emit_runs.py trains).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from oomdoctor.errors import BadInput
from oomdoctor.execute.trainers import DocumentRequest
from oomdoctor.execute.trainers.common import DATASET_PLACEHOLDER, lora_targets
from oomdoctor.execute.trainers.hf import EXTRA_KEYS as HF_EXTRA_KEYS
from oomdoctor.files import write_text_atomic
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan
from oomdoctor.plan.targets import RULES, adapt, applies, refusals
from oomdoctor.plan.techniques import ALL_LINEAR
from oomdoctor.resources import tiny_dir
from oomdoctor.tune.emit import emit, request_from_result, schedule, write_emitted

LLAMA7B = "meta-llama/Llama-2-7b-hf"
TINY_MODEL = str(tiny_dir() / "model")

#: 7B plans covering every knob away from its default at least once.
PLANS: dict[str, Plan] = {
    "qlora": Plan(
        method="qlora",
        quant="nf4",
        double_quant=True,
        precision="bf16",
        optimizer="paged-adamw-8bit",
        gradient_checkpointing=True,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        micro_batch=4,
        grad_accum=8,
        seq_len=1024,
    ),
    "lora": Plan(
        method="lora",
        precision="bf16",
        attn="flash",
        lora_targets=("q_proj", "v_proj"),
        lora_r=32,
        optimizer_impl="foreach",
        gradient_checkpointing=True,
        offload_activations=True,
        micro_batch=2,
        grad_accum=3,
        seq_len=512,
    ),
    "full": Plan(method="full", precision="fp32", attn="eager", micro_batch=1, grad_accum=16, seq_len=256),
    "int8-fp16": Plan(
        method="qlora",
        quant="int8",
        precision="fp16-mixed",
        optimizer="sgd",
        sgd_momentum=0.9,
        optimizer_impl="foreach",
        lora_targets=("q_proj",),
        lora_on_head=True,
        micro_batch=3,
        grad_accum=5,
        seq_len=128,
    ),
}
OPTIM = {"qlora": "paged_adamw_8bit", "lora": "adamw_torch", "full": "adamw_torch_fused", "int8-fp16": "sgd"}
#: The plans each trainer runs (the others it refuses: test_what_a_trainer_cannot_run_is_never_written).
RUNS = {
    "trl": ("qlora", "lora", "full"),
    "hf": ("qlora", "full", "int8-fp16"),
    "axolotl": ("qlora", "lora", "full"),
    "accelerate": ("qlora", "lora", "full", "int8-fp16"),
}


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


def _request(spec, plan: Plan, trainer: str, dataset: str | None = "data/train.jsonl", **kw) -> DocumentRequest:
    return DocumentRequest(
        plan=adapt(plan, trainer), spec=spec, model=LLAMA7B, dataset=dataset, schedule=schedule(), **kw
    )


def _emit(spec, name: str, trainer: str, **kw):
    return emit(_request(spec, PLANS[name], trainer, **kw))


# ---------------------------------------------------------------------------------------------- what runs where


@pytest.mark.parametrize("trainer", list(RUNS))
def test_what_a_trainer_cannot_run_is_never_written(trainer, spec7b):
    for name, plan in PLANS.items():
        try:
            p = adapt(plan, trainer)
        except BadInput:  # what the trainer fixes makes the plan impossible (TRL's bf16 adapters under fp16)
            assert name not in RUNS[trainer], name
            continue
        if name in RUNS[trainer]:
            assert not refusals(p), (name, [str(r) for r in refusals(p)])
        else:
            assert refusals(p), name
            with pytest.raises(BadInput, match="cannot run"):
                emit(DocumentRequest(plan=p, spec=spec7b, model=LLAMA7B))


@pytest.mark.parametrize("trainer", list(RUNS))
def test_the_header_lists_every_knob_with_its_key(trainer, spec7b):
    for name in RUNS[trainer]:
        em = _emit(spec7b, name, trainer)
        plan = adapt(PLANS[name], trainer)
        listed = {line.split(" ", 1)[0] for line in em.knobs}
        assert listed == {k for k in RULES[trainer] if applies(k, plan)}, name
        data = json.loads(em.text) if trainer == "hf" else yaml.safe_load(em.text)
        if trainer == "hf":
            assert data["oomdoctor"]["knobs"] == list(em.knobs)
        else:
            assert all(f"#   {line}\n" in em.text for line in em.knobs)
        # a key the header names holds the value it shows
        for line in em.knobs:
            knob, _, said = line.partition(" -> ")
            for part in said.split(", "):
                key, sep, value = part.partition(": ")
                if sep and key in data and not isinstance(data[key], (dict, list)):
                    assert json.dumps(data[key]) == value or str(data[key]) == value, (line, data[key])


def test_trl_fixes_what_sft_trainer_runs_whatever_the_config_says():
    q = adapt(Plan(method="qlora", precision="bf16", optimizer="sgd"), "trl")
    assert (q.loss, q.kbit_upcast, q.adapter_dtype, q.optimizer_impl) == ("chunked", False, "bf16", "foreach")
    assert adapt(Plan(method="lora", precision="bf16"), "trl").adapter_dtype == "fp32"
    assert adapt(Plan(method="full"), "hf").loss == "standard"  # transformers' loss unless Liger is asked for


def test_a_pinned_knob_the_trainer_cannot_run_is_one_message(tmp_path, capsys):
    from oomdoctor.cli import main

    for pin, match in (
        (["--tiled-mlp"], "tiled_mlp on: no tiled MLP"),
        (["--loss", "standard"], "fused LM head"),
        (["--optimizer-in-backward"], "optimizer-in-backward"),
    ):
        with pytest.raises(SystemExit) as e:
            main(
                [
                    "tune",
                    TINY_MODEL,
                    "--gpu-mem",
                    "1GB",
                    "--seq-len",
                    "64",
                    "--emit",
                    "trl",
                    "--verify",
                    "none",
                    "--output",
                    str(tmp_path / "x.yaml"),
                ]
                + pin
            )
        err = capsys.readouterr().err
        assert e.value.code == 2 and "trl cannot run what was pinned" in err and match in err, err
        assert "Traceback" not in err and not (tmp_path / "x.yaml").exists()


# ---------------------------------------------------------------------------------------------- TRL


def _trl_parse(path: str):
    pytest.importorskip("trl")
    from trl.scripts.sft import make_parser

    return make_parser().parse_args_and_config(["--config", path])  # unknown keys raise


@pytest.mark.parametrize("name", RUNS["trl"])
def test_trl_config_parses_and_round_trips(name, spec7b, tmp_path, gpu_bf16):
    plan = adapt(PLANS[name], "trl")
    em = _emit(spec7b, name, "trl")
    script, sft, model, data = _trl_parse(_write(tmp_path, "trl.yaml", em.text))
    assert sft.per_device_train_batch_size == plan.micro_batch
    assert sft.gradient_accumulation_steps == plan.grad_accum
    assert sft.per_device_train_batch_size * sft.gradient_accumulation_steps == plan.effective_batch
    assert sft.max_length == plan.seq_len
    assert sft.gradient_checkpointing is plan.gradient_checkpointing  # TRL's default is True: written explicitly
    if plan.gradient_checkpointing:
        assert sft.activation_checkpointing_kwargs == {"use_reentrant": False}
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
        assert (model.lora_r, model.lora_alpha, model.lora_dropout) == (plan.lora_r, plan.lora_alpha, plan.lora_dropout)
    if plan.quant == "nf4":
        assert model.bnb_4bit_quant_type == "nf4" and model.use_bnb_nested_quant is True


def test_trl_builds_the_planned_peft_and_bnb_configs(spec7b, tmp_path, gpu_bf16):
    import torch
    from trl import get_peft_config, get_quantization_config

    _, _, model, _ = _trl_parse(_write(tmp_path, "q.yaml", _emit(spec7b, "qlora", "trl").text))
    q = get_quantization_config(model)
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16  # the model dtype: what the plan's pure bf16 computes in
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
    _, _, margs, _ = _trl_parse(_write(tmp_path, "t.yaml", emit(_request(spec, plan, "trl")).text))
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(LlamaConfig(**tiny_config)), get_peft_config(margs))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert len(adapted) == tiny_config["num_hidden_layers"] and all(n.endswith("q_proj") for n in adapted)


# ---------------------------------------------------------------------------------------------- HF


@pytest.mark.parametrize("name", RUNS["hf"])
def test_hf_json_parses_into_training_arguments_and_kwargs(name, spec7b, tmp_path, gpu_bf16):
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, HfArgumentParser, TrainingArguments

    plan = adapt(PLANS[name], "hf")
    path = _write(tmp_path, "hf.json", _emit(spec7b, name, "hf").text)
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
    assert doc["prepare_model_for_kbit_training"] is plan.upcasts_kbit
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
    assert doc["oomdoctor"]["knobs"] and any(k.startswith("micro_batch ") for k in doc["oomdoctor"]["knobs"])


def test_hf_chunked_loss_is_liger(spec7b):
    doc = json.loads(emit(_request(spec7b, PLANS["full"].with_(loss="chunked"), "hf")).text)
    assert doc["use_liger_kernel"] is True
    assert any("liger-kernel" in a for a in doc["oomdoctor"]["about"])  # the versions the price assumes


# ---------------------------------------------------------------------------------------------- accelerate


@pytest.mark.parametrize("name", RUNS["accelerate"])
def test_accelerate_launch_config_loads(name, spec7b, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    plan = adapt(PLANS[name], "accelerate")
    path = _write(tmp_path, "acc.yaml", _emit(spec7b, name, "accelerate").text)
    cfg = load_config_from_file(path)
    assert isinstance(cfg, ClusterConfig) and cfg.num_processes == plan.world_size
    want = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16": "bf16"}[plan.precision]
    assert cfg.mixed_precision == want
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", path, "train.py"]))
    assert args.mixed_precision == want and args.num_processes == plan.world_size
    assert not args.use_deepspeed


def test_accelerate_lists_the_script_settings(spec7b):
    em = _emit(spec7b, "qlora", "accelerate")
    script = next(n for n in em.notes if n.startswith("the training knobs are train.py's"))
    for part in (
        "per_device_train_batch_size 4",
        "gradient_accumulation_steps 8",
        "optim paged_adamw_8bit",
        "bnb_4bit_use_double_quant=True",
        "LoRA r 16",
        "prepare_model_for_kbit_training",
    ):
        assert part in script
    assert "#   - the training knobs" in em.text


# ---------------------------------------------------------------------------------------------- axolotl


@pytest.mark.parametrize("name", RUNS["axolotl"])
def test_axolotl_config(name, spec7b):
    plan = adapt(PLANS[name], "axolotl")
    doc = yaml.safe_load(_emit(spec7b, name, "axolotl").text)
    assert (doc["micro_batch_size"], doc["gradient_accumulation_steps"]) == (plan.micro_batch, plan.grad_accum)
    assert doc["sequence_len"] == plan.seq_len and doc["optimizer"] == OPTIM[name]
    assert doc.get("adapter") == {"full": None, "lora": "lora"}.get(
        plan.method, "qlora" if plan.quant != "int8" else "lora"
    )
    assert doc["datasets"] == [{"path": "data/train.jsonl", "split": "train", "type": "completion", "ds_type": "json"}]
    if plan.lora_targets == (ALL_LINEAR,) and plan.uses_lora:
        assert doc["lora_target_linear"] is True
    if plan.quant == "nf4":
        assert doc["bnb_config_kwargs"] == {
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
        }
    config = pytest.importorskip("axolotl.utils.config")  # axolotl's own validation (runs without a GPU)
    from axolotl.utils.dict import DictDefault

    cfg = DictDefault(doc)
    config.prepare_plugins(cfg)
    cfg = config.validate_config(cfg)
    assert cfg.micro_batch_size == plan.micro_batch and cfg.sequence_len == plan.seq_len
    if plan.gradient_checkpointing:
        assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": False}


# ---------------------------------------------------------------------------------------------- shared


def test_lora_targets(spec7b):
    assert lora_targets(Plan(method="lora"), spec7b) == ALL_LINEAR
    assert lora_targets(Plan(method="lora", lora_on_head=True), spec7b) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert lora_targets(Plan(method="lora", lora_targets=("v_proj", "q_proj")), spec7b) == ["q_proj", "v_proj"]


@pytest.mark.parametrize("target", ["trl", "hf", "axolotl", "accelerate"])
def test_missing_dataset_is_a_named_placeholder(target, spec7b):
    em = _emit(spec7b, "full", target, dataset=None)
    assert DATASET_PLACEHOLDER in em.text and any("placeholder" in n for n in em.notes)


def test_oomdoctor_is_not_a_foreign_document(spec7b):
    with pytest.raises(BadInput, match="--emit"):
        emit(DocumentRequest(plan=PLANS["full"], spec=spec7b, model=LLAMA7B))


def test_write_text_is_atomic_and_refuses_to_overwrite(tmp_path):
    p = tmp_path / "sub" / "x.yaml"
    write_text_atomic(p, "a: 1\n")
    with pytest.raises(BadInput, match="exists"):
        write_text_atomic(p, "a: 2\n")
    write_text_atomic(p, "a: 2\n", overwrite=True)
    assert p.read_text() == "a: 2\n" and [q.name for q in p.parent.iterdir()] == ["x.yaml"]


def test_tune_result_on_the_bundled_tiny_model(tmp_path, gpu_bf16):
    from oomdoctor.tune.tuner import tune

    r = tune(
        TINY_MODEL, gpu_mem=10**9, seq_len=64, global_batch=8, gpu=None, verify_mode="none", pins={"trainer": "trl"}
    )
    assert r.plan.trainer == "trl" and not refusals(r.plan)
    req = request_from_result(r, TINY_MODEL, "bundled:tiny/train.jsonl")
    assert req.model == TINY_MODEL and not req.model_has_weights and req.plan == r.plan
    # bundled names, which another trainer cannot resolve, become the package's files
    req = request_from_result(r, "bundled:tiny/model/config.json", "bundled:tiny/train.jsonl")
    assert (req.model, req.dataset) == (TINY_MODEL, str(tiny_dir() / "train.jsonl")) and not req.model_has_weights
    w = write_emitted(r, TINY_MODEL, tmp_path / "t.yaml", dataset="bundled:tiny/train.jsonl")
    assert w.command.endswith(f"trl sft --config {tmp_path / 't.yaml'}")
    assert any("config without weights" in n for n in w.emitted.notes)
    _, sft, _, _ = _trl_parse(str(w.path))
    assert sft.per_device_train_batch_size * sft.gradient_accumulation_steps == 8
    assert f"# Plan: {r.plan.label()}" in w.path.read_text()


def test_cli_tune_emit_trl(tmp_path, monkeypatch, capsys, gpu_bf16):
    from oomdoctor.cli import main

    monkeypatch.chdir(tmp_path)
    args = [
        "tune",
        TINY_MODEL,
        "--gpu-mem",
        "1GB",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--emit",
        "trl",
        "--verify",
        "none",
        "--output",
        "x.yaml",
        "--json",
    ]
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None)
    d = json.loads(capsys.readouterr().out)
    assert d["emit"] == "trl" and d["config_path"] == "x.yaml" and d["plan"]["trainer"] == "trl"
    assert d["command"].endswith("trl sft --config x.yaml")
    assert any(k.startswith("loss chunked -> TRL's fused LM head") for k in d["emit_knobs"])
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
    "hsdp": Plan(
        method="full",
        precision="bf16-mixed",
        world_size=16,
        strategy="fsdp",
        shard_group=8,
        reshard_after_forward=False,
    ),
    "fsdp-offload": Plan(method="full", precision="bf16-mixed", world_size=4, strategy="fsdp", offload_params=True),
    "zero3-offload": Plan(
        method="full", precision="bf16-mixed", world_size=8, strategy="zero3", offload_optimizer=True
    ),
    "zero2": Plan(method="full", precision="bf16-mixed", world_size=8, strategy="zero2"),
}


@pytest.mark.parametrize("name", list(MULTI))
def test_accelerate_launch_config_for_each_strategy(name, spec7b, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    plan = adapt(MULTI[name], "accelerate")
    req = DocumentRequest(
        plan=plan, model=LLAMA7B, spec=spec7b, dataset="d.jsonl", gpus_per_node=8 if plan.world_size > 8 else None
    )
    path = _write(tmp_path, "acc.yaml", emit(req).text)
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
            assert cfg.parallelism_config == {
                "parallelism_config_dp_replicate_size": 2,
                "parallelism_config_dp_shard_size": 8,
            }
    else:
        assert args.use_deepspeed and args.zero_stage == (3 if plan.strategy == "zero3" else 2)
        assert args.offload_optimizer_device == ("cpu" if plan.offload_optimizer else "none")


def test_deepspeed_buckets_and_hsdp_are_refused_where_no_key_carries_them():
    assert refusals(adapt(MULTI["zero2"].with_(bucket_size=10**7), "accelerate"))
    assert refusals(adapt(MULTI["hsdp"], "trl")) and refusals(adapt(MULTI["hsdp"], "hf"))
    assert not refusals(adapt(MULTI["hsdp"], "accelerate"))


@pytest.mark.parametrize("name", ["fsdp", "zero3-offload", "zero2"])
def test_hf_and_trl_set_fsdp_or_deepspeed(name, spec7b, tmp_path, gpu_bf16):
    from transformers import HfArgumentParser, TrainingArguments

    if MULTI[name].strategy != "fsdp":  # TrainingArguments parses a deepspeed config only with deepspeed installed
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    plan = adapt(MULTI[name], "hf")
    em = emit(_request(spec7b, plan, "hf"))
    (args,) = HfArgumentParser(TrainingArguments).parse_json_file(
        _write(tmp_path, "hf.json", em.text), allow_extra_keys=True
    )
    assert any("torchrun --nproc-per-node" in n for n in em.notes)
    if plan.strategy == "fsdp":
        assert args.fsdp_config["version"] == 2
        assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
        assert args.fsdp_config["reshard_after_forward"] is plan.reshard_after_forward
    else:
        zero = args.deepspeed["zero_optimization"]
        assert zero["stage"] == (3 if plan.strategy == "zero3" else 2)
        assert zero["reduce_bucket_size"] == (plan.bucket_size or 4096**2)
        assert ("offload_optimizer" in zero) is plan.offload_optimizer
    trl = emit(_request(spec7b, plan, "trl"))
    _, sft, _, _ = _trl_parse(_write(tmp_path, "trl.yaml", trl.text))
    assert (sft.deepspeed is not None) is (plan.strategy != "fsdp")


def test_docs_print_the_table_oomdoctor_targets_prints(capsys):
    """docs/tune.md quotes `oomdoctor targets --markdown` between its markers: the two agree."""
    from oomdoctor.cli import main

    def run(args: list[str]) -> str:
        try:
            main(args)
        except SystemExit as e:
            assert e.code in (0, None)
        return capsys.readouterr().out

    printed = run(["targets", "--markdown"])
    doc = (Path(__file__).resolve().parent.parent / "docs" / "tune.md").read_text()
    quoted = doc.split("<!-- targets:begin -->\n", 1)[1].split("<!-- targets:end -->", 1)[0]
    assert quoted == printed, "re-run: oomdoctor targets --markdown, paste between the markers in docs/tune.md"
    rows = json.loads(run(["targets", "trl", "--json"]))["trl"]["knobs"]
    tiled = next(r for r in rows if r["knob"] == "tiled_mlp")
    assert tiled["cannot"] and tiled["cannot"][0]["values"] == ["true"]
