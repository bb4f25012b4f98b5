"""``tune --emit TARGET``: the tuned plan as a config for the user's own tool (TRL, HF Trainer, axolotl, accelerate).

One function per target builds the document from an :class:`EmitRequest` (plan, model, dataset, output dir); the
knob names come from the technique table (``oomdoctor.plan.techniques``: ``HF_OPTIM_NAMES``, ``HF_ATTN_NAMES``,
``ALL_LINEAR``) and the schedule (learning rate, epochs...) from the ``oomdoctor train`` defaults, so the foreign run
trains like ``oomdoctor train`` would. Every plan knob is either written under the target's own key or named in
:attr:`Emitted.notes` (the header comment of the file; ``tune`` prints them): "not expressible in TRL: ...".

Targets and the parser that accepts each document (tests/test_emit.py parses every one with it):

- ``trl``: a YAML for ``trl sft --config FILE`` (``TrlParser`` over ScriptArguments, SFTConfig, ModelConfig and
  DatasetMixtureConfig);
- ``hf``: a JSON for ``HfArgumentParser(TrainingArguments).parse_json_file(FILE, allow_extra_keys=True)`` whose
  extra keys carry what TrainingArguments does not: ``model_name_or_path``, ``model_init_kwargs``
  (``from_pretrained`` kwargs), ``quantization_config`` (``BitsAndBytesConfig`` kwargs), ``peft_config``
  (``LoraConfig`` kwargs), ``dataset`` (``load_dataset`` kwargs), ``max_length`` and ``oomdoctor`` (plan, notes);
- ``axolotl``: a YAML in axolotl's config schema for ``axolotl train FILE``;
- ``accelerate``: a launch config for ``accelerate launch --config_file FILE train.py`` (mixed precision, processes
  and machines, the strategy: DDP, the FSDP2 plugin, the DeepSpeed plugin; DeepSpeed ZeRO-Offload for the offload
  knobs on one GPU); the training knobs belong to the script and are listed in the header.

Several GPUs (``tune --gpus N``): ``hf`` and ``trl`` set TrainingArguments' ``fsdp`` / ``fsdp_config`` (FSDP2) or
``deepspeed`` (a ZeRO config dict with explicit buckets) and are launched with ``torchrun --nproc-per-node``; what a
target cannot express (HSDP's shard group in TrainingArguments, DeepSpeed buckets in an accelerate launch config) is
a note.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from oomdoctor.errors import BadInput
from oomdoctor.files import write_text_atomic
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.plan import DEEPSPEED, SHARDED
from oomdoctor.plan.techniques import ALL_LINEAR, HF_ATTN_NAMES, HF_OPTIM_NAMES
from oomdoctor.train.config import TrainConfig
from oomdoctor.tune.tuner import TuneResult
from oomdoctor.units import format_bytes

#: ``--emit`` values: ``oomdoctor`` (the ``oomdoctor train`` YAML, the default) and the foreign tools.
EMIT_TARGETS: tuple[str, ...] = ("oomdoctor", "trl", "hf", "axolotl", "accelerate")
#: The tool each foreign target is for (in notes: "not expressible in TRL: ...").
TOOL_NAMES: dict[str, str] = {"trl": "TRL", "hf": "HF TrainingArguments", "axolotl": "axolotl",
                              "accelerate": "an accelerate launch config"}
#: The file suffix each foreign target writes.
SUFFIXES: dict[str, str] = {"trl": ".yaml", "hf": ".json", "axolotl": ".yaml", "accelerate": ".yaml"}
#: Dataset written when ``tune`` was given no ``--dataset`` (the bundled sample only exists inside this repository).
DATASET_PLACEHOLDER = "PATH/TO/YOUR/train.jsonl"
#: ``load_dataset`` builder for a local data file, by suffix.
DATA_BUILDERS: dict[str, str] = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                                 ".txt": "text"}
#: How a script gets bf16 adapters (peft's ``autocast_adapter_dtype=False`` does not reach a quantized base).
BF16_ADAPTERS = "after get_peft_model, cast every trainable parameter to torch.bfloat16 (as TRL's SFTTrainer does)"
#: The extra (non-TrainingArguments) keys of the ``hf`` JSON.
HF_EXTRA_KEYS: tuple[str, ...] = ("model_name_or_path", "model_init_kwargs", "quantization_config", "peft_config",
                                  "dataset", "max_length", "oomdoctor")


def hf_usage(spec: ModelSpec, plan: Plan) -> str:
    """How the ``hf`` JSON's extra keys are used (a note of every ``hf`` document), with the auto class that loads
    the model (``model/inventory.auto_model_class``: ``AutoModelForImageTextToText`` for a vision-language model
    transformers has no causal-LM class for)."""
    from oomdoctor.execute.build import hf_config
    from oomdoctor.model.inventory import auto_model_class

    auto = auto_model_class(hf_config(spec, plan)).__name__
    return (f"model, quantization, LoRA and data are the script's: {auto}.from_pretrained("
            "model_name_or_path, **model_init_kwargs, quantization_config=BitsAndBytesConfig(**quantization_config)), "
            "peft.get_peft_model(model, LoraConfig(**peft_config)), load_dataset(**dataset) tokenized to max_length")


@dataclass(frozen=True)
class EmitRequest:
    """What a foreign config is built from."""

    plan: Plan
    """The tuned plan (micro-batch and accumulation set)."""
    model: str
    """``model_name_or_path``: a hub id or a local directory (resolved)."""
    spec: ModelSpec
    """The model's spec: its linear module names, when ``all-linear`` plus the head must be spelled out."""
    dataset: str | None = None
    """Data file, directory or hub id; None writes :data:`DATASET_PLACEHOLDER` (and a note)."""
    output_dir: str = TrainConfig().output_dir
    """Where the tool writes checkpoints."""
    header: tuple[str, ...] = ()
    """Lines describing the tune result (capacity, plan, predicted peak), first in the file's header."""
    model_has_weights: bool = True
    """False for a config-only model (``config.json``): the foreign tools need real weights (a note says so)."""
    gpus_per_node: int | None = None
    """GPUs per machine (None: every rank on one machine)."""

    @property
    def machines(self) -> int:
        return self.plan.world_size // (self.gpus_per_node or self.plan.world_size)


@dataclass(frozen=True)
class Emitted:
    """One foreign config."""

    target: str
    """``trl``, ``hf``, ``axolotl`` or ``accelerate``."""
    text: str
    """The file's content."""
    notes: tuple[str, ...] = ()
    """Plan knobs the target cannot express, or expresses differently, and placeholders to fill in."""

    def command(self, path: str | os.PathLike) -> str:
        """How to run (``hf``: load) the written file."""
        return run_command(self.target, path)


def run_command(target: str, path: str | os.PathLike) -> str:
    """The command that runs a ``target`` config written to ``path`` (for ``hf`` the Python that loads it)."""
    p = shlex.quote(str(path))
    if target == "trl":
        return f"trl sft --config {p}"
    if target == "axolotl":
        return f"axolotl train {p}"
    if target == "accelerate":
        return f"accelerate launch --config_file {p} train.py"
    if target == "hf":
        code = ("from transformers import HfArgumentParser, TrainingArguments; (args,) = HfArgumentParser("
                f"TrainingArguments).parse_json_file({json.dumps(str(path))}, allow_extra_keys=True); print(args)")
        return f"python -c {shlex.quote(code)}"
    raise BadInput(f"--emit {target!r}: use one of {', '.join(EMIT_TARGETS)}")


# ---------------------------------------------------------------------------------------------- shared mappings


@dataclass(frozen=True)
class _Precision:
    bf16: bool
    """``bf16: true`` (bf16 autocast; with pure bf16 weights as well)."""
    fp16: bool
    """``fp16: true`` (fp16 autocast on fp32 weights)."""
    dtype: str
    """Weight (load) dtype: float32 unless the plan is pure bf16."""


def _precision(plan: Plan) -> _Precision:
    """fp32 -> no bf16/fp16; fp16-/bf16-mixed -> fp16/bf16 autocast on fp32 weights; bf16 -> bfloat16 weights."""
    return _Precision(bf16=plan.precision in ("bf16-mixed", "bf16"), fp16=plan.precision == "fp16-mixed",
                      dtype="bfloat16" if plan.precision == "bf16" else "float32")


@dataclass(frozen=True)
class _Optim:
    name: str
    """``TrainingArguments.optim`` value."""
    args: str | None
    """``optim_args`` (SGD momentum) or None."""
    notes: tuple[str, ...]
    """What the HF name cannot say (the kernel)."""


def _optim(plan: Plan) -> _Optim:
    """The HF ``optim`` name of the plan's optimizer (and kernel, for AdamW) and ``optim_args``."""
    name = HF_OPTIM_NAMES[plan.optimizer]
    notes: list[str] = []
    if plan.optimizer == "adamw":
        name = "adamw_torch_fused" if plan.optimizer_impl == "fused" else HF_OPTIM_NAMES["adamw"]
        if plan.optimizer_impl == "for-loop":
            notes.append(f"optimizer_impl for-loop (written as {name}: torch's default foreach kernel)")
    elif plan.optimizer == "sgd" and plan.optimizer_impl != "foreach":
        notes.append(f"optimizer_impl {plan.optimizer_impl} (sgd runs torch's default foreach kernel)")
    args = f"momentum={plan.sgd_momentum}" if plan.optimizer == "sgd" and plan.sgd_momentum else None
    return _Optim(name, args, tuple(notes))


def lora_targets(plan: Plan, spec: ModelSpec) -> str | list[str]:
    """peft ``target_modules``: what the executor hands peft for this plan (``memory.context.executor_targets``):
    ``all-linear`` as is, else the sorted leaf names (all-linear expanded without what peft cannot adapt, the
    head with ``lora_on_head``); on a vision-language model one regex for those names outside its towers
    (``model/inventory.text_side_targets``: the executor's ``exclude_modules``, which TRL and axolotl lack)."""
    from oomdoctor.memory.context import all_linear_names, executor_targets

    names = executor_targets(spec, plan)
    if spec.towers:
        from oomdoctor.model.inventory import text_side_targets

        return text_side_targets(all_linear_names(spec) if names is None else names, spec.towers)
    return ALL_LINEAR if names is None else sorted(names)


def decoder_layer_class(spec: ModelSpec) -> str | None:
    """The decoder layer class FSDP wraps (``_no_split_modules`` of the model class transformers builds for the
    config's ``architectures``), None when transformers does not name one."""
    arch = (spec.config.get("architectures") or [None])[0]
    if not arch:
        return None
    import transformers

    cls = getattr(transformers, arch, None)
    names = list(getattr(cls, "_no_split_modules", None) or [])
    return names[0] if names else None


def deepspeed_config(plan: Plan, spec: ModelSpec) -> dict[str, Any]:
    """The DeepSpeed config HF Trainer fills (``oomdoctor.execute.zero.zero_config`` with ``auto`` batch, precision
    and clipping): the same builder ``train`` runs."""
    from oomdoctor.execute.zero import zero_config

    return zero_config(plan, spec.hidden_size)


def _trainer_topology(req: EmitRequest, tool: str) -> tuple[dict[str, Any], list[str]]:
    """TrainingArguments keys for the plan's strategy (FSDP2 ``fsdp``/``fsdp_config`` or a ``deepspeed`` dict) and
    the notes: how to launch it, and what TrainingArguments cannot express."""
    p = req.plan
    if p.world_size == 1 and p.strategy == "single":
        return {}, []
    nodes = f" --nnodes {req.machines}" if req.machines > 1 else ""
    notes = [f"{p.world_size} GPUs: launch the script with `torchrun --nproc-per-node "
             f"{p.world_size // req.machines}{nodes}`; per_device_train_batch_size is per GPU"]
    doc: dict[str, Any] = {}
    if p.strategy == "fsdp":
        layer = decoder_layer_class(req.spec)
        cfg: dict[str, Any] = {"version": 2, "reshard_after_forward": p.reshard_after_forward,
                               "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "cpu_ram_efficient_loading": True,
                               "state_dict_type": "SHARDED_STATE_DICT", "cpu_offload": p.offload_params}
        if layer:
            cfg["transformer_layer_cls_to_wrap"] = [layer]
        else:
            notes.append("fsdp: set fsdp_config.transformer_layer_cls_to_wrap to the model's decoder layer class")
        doc.update(fsdp=True, fsdp_config=cfg)
        if p.shard_group:
            notes.append(f"shard_group {p.shard_group} (HSDP): not expressible in {tool}'s fsdp_config; use "
                         "`--emit accelerate` (parallelism_config dp_replicate/dp_shard)")
    elif p.strategy in DEEPSPEED:
        doc["deepspeed"] = deepspeed_config(p, req.spec)
        notes.append("deepspeed: `pip install deepspeed`; the offload knobs are in its zero_optimization")
    return doc, notes


def _dataset_kwargs(path: str | None) -> dict[str, Any]:
    """``load_dataset`` kwargs: a local file through its builder (``json`` for .jsonl), else a directory/hub id."""
    p = path or DATASET_PLACEHOLDER
    builder = DATA_BUILDERS.get(Path(p).suffix.lower())
    if builder:
        return {"path": builder, "data_files": p, "split": "train"}
    return {"path": p, "split": "train"}


def _schedule() -> dict[str, Any]:
    """The ``oomdoctor train`` defaults of the keys every HF-based tool shares (no memory effect)."""
    d = TrainConfig()
    out: dict[str, Any] = {"learning_rate": d.learning_rate}
    if d.max_steps is not None:
        out["max_steps"] = d.max_steps
    else:
        out["num_train_epochs"] = d.num_train_epochs
    out.update(lr_scheduler_type=d.lr_scheduler_type, warmup_steps=d.warmup_steps, weight_decay=d.weight_decay,
               max_grad_norm=d.max_grad_norm, seed=d.seed, logging_steps=d.logging_steps, save_steps=d.save_steps,
               save_total_limit=d.save_total_limit)
    return out


def _common_notes(req: EmitRequest, tool: str) -> list[str]:
    """Placeholders and knobs no single-process HF tool expresses."""
    notes = []
    if req.dataset is None:
        notes.append(f"dataset is a placeholder ({DATASET_PLACEHOLDER}): point it at your data (or pass --dataset)")
    if not req.model_has_weights:
        notes.append(f"{req.model} is a config without weights: point the model at real weights")
    p = req.plan
    sharded_offload = p.strategy in SHARDED  # written in fsdp_config / the deepspeed dict
    if p.offload_optimizer and not sharded_offload:
        notes.append(f"offload_optimizer: not expressible in {tool} (DeepSpeed ZeRO-Offload does it: "
                     "`--emit accelerate` writes that launch config)")
    if p.offload_params and not sharded_offload:
        notes.append(f"offload_params: not expressible in {tool} (DeepSpeed ZeRO-3 parameter offload: "
                     "`--emit accelerate`)")
    if p.tiled_mlp:
        notes.append(f"tiled_mlp: not expressible in {tool} (axolotl's tiled_mlp: true, `--emit axolotl`; or "
                     "patch the MLP forward with DeepSpeed's TiledMLP)")
    if req.spec.towers and p.method == "full":
        notes.append(f"priced as text-only fine-tuning with {', '.join(req.spec.towers)} frozen and never run: "
                     f"{tool} has no key for it — set requires_grad=False on them (DDP refuses trainable "
                     "parameters that get no gradient)")
    return notes


def _header(req: EmitRequest, tool: str, run: str, notes: list[str]) -> str:
    lines = [f"Written by `oomdoctor tune --emit` for {tool}."] + list(req.header) + [f"Run: {run}"]
    if notes:
        lines.append(f"Not expressible in {tool} or to fill in:")
        lines += [f"  - {n}" for n in notes]
    return "".join(f"# {ln}\n" for ln in lines)


def _yaml(doc: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)


# ---------------------------------------------------------------------------------------------- targets


def emit_trl(req: EmitRequest) -> Emitted:
    """``trl sft --config FILE``: ModelConfig (model, dtype, attention, peft, bitsandbytes), SFTConfig (batch,
    precision, checkpointing, activation offloading, optimizer, max_length, schedule), DatasetMixtureConfig."""
    p, prec, opt = req.plan, _precision(req.plan), _optim(req.plan)
    notes = _common_notes(req, "TRL") + list(opt.notes)
    doc: dict[str, Any] = {
        "model_name_or_path": req.model,
        "dtype": prec.dtype,
        "attn_implementation": HF_ATTN_NAMES[p.attn],
        "datasets": [_dataset_kwargs(req.dataset)],
        "max_length": p.seq_len,
        "packing": False,
        "output_dir": req.output_dir,
        "per_device_train_batch_size": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "bf16": prec.bf16,
        "fp16": prec.fp16,
        "gradient_checkpointing": p.gradient_checkpointing,
        "activation_offloading": p.offload_activations,
        "optim": opt.name,
    }
    if opt.args:
        doc["optim_args"] = opt.args
    doc["use_peft"] = p.uses_lora
    if p.uses_lora:
        targets = lora_targets(p, req.spec)
        if isinstance(targets, list) and len(targets) == 1:
            # TRL passes a one-element list to peft as a string, which peft full-matches against the module path
            targets = rf".*\.{targets[0]}"
        doc.update(lora_r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout,
                   lora_target_modules=targets)
        trl_dtype = "bf16" if p.quant is not None else "fp32"  # SFTTrainer casts a quantized model's adapters
        if p.adapter_dtype != trl_dtype:
            notes.append(f"adapter_dtype {p.adapter_dtype}: not expressible in TRL (SFTTrainer keeps {trl_dtype} "
                         f"adapters {'on a quantized' if p.quant else 'on an unquantized'} base)")
    doc["load_in_4bit"] = p.quant in ("nf4", "fp4")
    doc["load_in_8bit"] = p.quant == "int8"
    if p.quant in ("nf4", "fp4"):
        doc["bnb_4bit_quant_type"] = p.quant
        doc["use_bnb_nested_quant"] = p.double_quant
        if p.compute_dtype != prec.dtype:
            notes.append(f"bnb_4bit_compute_dtype {p.compute_dtype}: TRL computes 4-bit layers in the model dtype "
                         f"({prec.dtype})")
    doc.update(_schedule())
    doc["report_to"] = "none"
    topo, topo_notes = _trainer_topology(req, "TRL")
    doc.update(topo)
    notes += topo_notes
    run = run_command("trl", "THIS.yaml")
    return Emitted("trl", _header(req, "TRL", run, notes) + _yaml(doc), tuple(notes))


def emit_hf(req: EmitRequest) -> Emitted:
    """TrainingArguments JSON plus the ``from_pretrained`` / ``BitsAndBytesConfig`` / ``LoraConfig`` kwargs."""
    p, prec, opt = req.plan, _precision(req.plan), _optim(req.plan)
    notes = _common_notes(req, "HF TrainingArguments") + list(opt.notes)
    if p.offload_activations:
        notes.append("offload_activations: not expressible in HF TrainingArguments (run the training step under "
                     "torch.autograd.graph.save_on_cpu(pin_memory=True), or use TRL's activation_offloading)")
    doc: dict[str, Any] = {
        "output_dir": req.output_dir,
        "per_device_train_batch_size": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "bf16": prec.bf16,
        "fp16": prec.fp16,
        "gradient_checkpointing": p.gradient_checkpointing,
        "optim": opt.name,
    }
    if opt.args:
        doc["optim_args"] = opt.args
    doc.update(_schedule())
    doc["report_to"] = "none"
    topo, topo_notes = _trainer_topology(req, "HF TrainingArguments")
    doc.update(topo)
    notes += topo_notes
    quant: dict[str, Any] | None = None
    if p.quant == "int8":
        quant = {"load_in_8bit": True}
    elif p.quant in ("nf4", "fp4"):
        quant = {"load_in_4bit": True, "bnb_4bit_quant_type": p.quant, "bnb_4bit_use_double_quant": p.double_quant,
                 "bnb_4bit_compute_dtype": p.compute_dtype}
    peft = None
    if p.uses_lora:
        peft = {"r": p.lora_r, "lora_alpha": p.lora_alpha, "lora_dropout": p.lora_dropout,
                "target_modules": lora_targets(p, req.spec), "bias": "none", "task_type": "CAUSAL_LM"}
        if p.adapter_dtype == "bf16":
            notes.append(f"adapter_dtype bf16: {BF16_ADAPTERS}")
    notes.append(hf_usage(req.spec, p))
    run = run_command("hf", "THIS.json")
    doc.update({
        "model_name_or_path": req.model,
        "model_init_kwargs": {"dtype": prec.dtype, "attn_implementation": HF_ATTN_NAMES[p.attn]},
        "quantization_config": quant,
        "peft_config": peft,
        "dataset": _dataset_kwargs(req.dataset),
        "max_length": p.seq_len,
        "oomdoctor": {"about": f"Written by `oomdoctor tune --emit hf`. Load: {run}", "header": list(req.header),
                      "notes": notes},
    })
    return Emitted("hf", json.dumps(doc, indent=2) + "\n", tuple(notes))


def emit_axolotl(req: EmitRequest) -> Emitted:
    """axolotl's YAML schema (``axolotl.utils.schemas.config.AxolotlInputConfig``)."""
    p, prec, opt = req.plan, _precision(req.plan), _optim(req.plan)
    notes = _common_notes(req, "axolotl") + list(opt.notes)
    ds = dict(_dataset_kwargs(req.dataset))
    data = {"path": ds.pop("data_files", ds["path"]), "split": "train", "type": "completion"}
    if ds["path"] in DATA_BUILDERS.values():
        data["ds_type"] = ds["path"]
    doc: dict[str, Any] = {"base_model": req.model}
    doc["load_in_8bit"] = p.quant == "int8"
    doc["load_in_4bit"] = p.quant in ("nf4", "fp4")
    if p.uses_lora:
        doc["adapter"] = "qlora" if p.quant in ("nf4", "fp4") else "lora"
        doc.update(lora_r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout)
        if p.adapter_dtype == "bf16":
            notes.append(f"adapter_dtype bf16: not expressible in axolotl's config ({BF16_ADAPTERS})")
        targets = lora_targets(p, req.spec)
        if targets == ALL_LINEAR:
            doc["lora_target_linear"] = True
        else:
            doc["lora_target_modules"] = targets
    if p.quant in ("nf4", "fp4"):
        doc["bnb_config_kwargs"] = {"bnb_4bit_quant_type": p.quant, "bnb_4bit_use_double_quant": p.double_quant,
                                    "bnb_4bit_compute_dtype": p.compute_dtype}
    doc.update(datasets=[data], output_dir=req.output_dir, sequence_len=p.seq_len, sample_packing=False,
               micro_batch_size=p.micro_batch, gradient_accumulation_steps=p.grad_accum)
    s = _schedule()
    if "max_steps" in s:
        doc["max_steps"] = s["max_steps"]
    else:
        doc["num_epochs"] = s["num_train_epochs"]
    doc["optimizer"] = opt.name
    if opt.args:
        doc["optim_args"] = opt.args
    doc.update(learning_rate=s["learning_rate"], lr_scheduler=s["lr_scheduler_type"], warmup_steps=s["warmup_steps"],
               weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"])
    doc["bf16"] = prec.bf16
    doc["fp16"] = prec.fp16
    if prec.bf16 and prec.dtype == "float32":
        notes.append("bf16-mixed: axolotl's bf16: true also loads the weights in bfloat16 (no fp32 master copy; "
                     "less weight memory than planned for full fine-tuning)")
    if prec.fp16:
        notes.append("fp16-mixed: axolotl's fp16: true also loads the weights in float16")
    if p.quant == "int8" and not prec.fp16:
        notes.append("int8: axolotl loads an 8-bit base with float16 non-quantized weights")
    doc["gradient_checkpointing"] = p.gradient_checkpointing
    if p.offload_activations and not p.gradient_checkpointing:
        notes.append("offload_activations without gradient checkpointing: not expressible in axolotl (its "
                     "activation_offloading requires gradient_checkpointing)")
    else:
        doc["activation_offloading"] = p.offload_activations
    doc["attn_implementation"] = HF_ATTN_NAMES[p.attn]
    if p.tiled_mlp:
        doc["tiled_mlp"] = True  # axolotl's ALST tiled MLP
    doc.update(seed=s["seed"], logging_steps=s["logging_steps"], save_steps=s["save_steps"],
               save_total_limit=s["save_total_limit"])
    if p.strategy != "single":
        notes.append(f"strategy {p.strategy} on {p.world_size} GPUs: not written for axolotl (set its fsdp_config / "
                     "deepspeed keys: `--emit hf` has the values; launch with accelerate or torchrun)")
    run = run_command("axolotl", "THIS.yaml")
    return Emitted("axolotl", _header(req, "axolotl", run, notes) + _yaml(doc), tuple(notes))


def _accelerate_strategy(req: EmitRequest) -> tuple[dict[str, Any], list[str]]:
    """``distributed_type`` and the plugin section for the plan's strategy: DDP (``MULTI_GPU``), the FSDP2 plugin
    (``fsdp_version: 2``, per-decoder-layer wrapping, ``reshard_after_forward``, CPU offload; HSDP through
    ``parallelism_config``), or the DeepSpeed plugin (ZeRO stage, offload); on one GPU DeepSpeed ZeRO-Offload for
    the offload knobs, else nothing."""
    p = req.plan
    notes: list[str] = []
    if p.strategy == "fsdp":
        layer = decoder_layer_class(req.spec)
        fsdp: dict[str, Any] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": p.reshard_after_forward,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_offload_params": p.offload_params,
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": False,
        }
        if layer:
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = layer
        else:
            notes.append("fsdp: set fsdp_transformer_layer_cls_to_wrap to the model's decoder layer class")
        doc: dict[str, Any] = {"distributed_type": "FSDP", "fsdp_config": fsdp}
        if p.shard_group:
            doc["parallelism_config"] = {"parallelism_config_dp_replicate_size": p.world_size // p.shard_group,
                                         "parallelism_config_dp_shard_size": p.shard_group}
        if p.gradient_checkpointing:
            notes.append("gradient checkpointing: the plan uses the model's own (model.gradient_checkpointing_enable"
                         "(gradient_checkpointing_kwargs={'use_reentrant': False}) in train.py), not "
                         "fsdp_activation_checkpointing")
        return doc, notes
    if p.strategy in DEEPSPEED:
        b = p.bucket_elems(req.spec.hidden_size)
        doc = {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "gradient_accumulation_steps": p.grad_accum,
            "offload_optimizer_device": "cpu" if p.offload_optimizer else "none",
            "offload_param_device": "cpu" if p.offload_params else "none",
            "zero3_init_flag": p.strategy == "zero3", "zero_stage": 3 if p.strategy == "zero3" else 2}}
        if p.bucket_size is None:
            notes.append(f"DeepSpeed buckets: accelerate fills reduce_bucket_size 'auto' with hidden^2 = {b:,} "
                         "elements, as priced")
        else:
            notes.append(f"bucket_size {b:,}: not expressible in an accelerate launch config; write "
                         "reduce_bucket_size/allgather_bucket_size in a deepspeed_config_file (`--emit hf` has the "
                         "dict)")
        return doc, notes
    if p.strategy == "ddp":
        return {"distributed_type": "MULTI_GPU"}, notes
    if p.offload_optimizer or p.offload_params:  # one GPU: DeepSpeed ZeRO-Offload
        return {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "gradient_accumulation_steps": p.grad_accum,
            "offload_optimizer_device": "cpu" if p.offload_optimizer else "none",
            "offload_param_device": "cpu" if p.offload_params else "none",
            "zero3_init_flag": False, "zero_stage": 3 if p.offload_params else 2}}, [
            "offload: DeepSpeed ZeRO-Offload (`pip install deepspeed`) keeps the optimizer state and step on the "
            "CPU" + (" and streams the parameters from it" if p.offload_params else "")]
    return {"distributed_type": "NO"}, notes


def emit_accelerate(req: EmitRequest) -> Emitted:
    """An accelerate launch config (``ClusterConfig``): the plan's processes and machines, mixed precision and
    strategy (:func:`_accelerate_strategy`). Everything else is the training script's: the header lists the values
    it must use."""
    p, prec, opt = req.plan, _precision(req.plan), _optim(req.plan)
    strategy, strategy_notes = _accelerate_strategy(req)
    doc: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": strategy.pop("distributed_type"),
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "bf16" if prec.bf16 else ("fp16" if prec.fp16 else "no"),
        "num_machines": req.machines,
        "num_processes": p.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    doc.update(strategy)
    if req.machines > 1:
        doc["main_process_ip"] = "MAIN_NODE_IP"
        doc["main_process_port"] = 29500
    notes = []
    if req.dataset is None:
        notes.append(f"dataset is a placeholder ({DATASET_PLACEHOLDER}): point your script at your data")
    if req.machines > 1:
        notes.append(f"{req.machines} machines: set main_process_ip and run the launch on each with its "
                     "machine_rank")
    notes += strategy_notes
    if prec.dtype == "bfloat16":
        notes.append("pure bf16: mixed_precision bf16 only autocasts; load the model with dtype=torch.bfloat16")
    script = [f"model {req.model}", f"dtype {prec.dtype}", f"attn_implementation {HF_ATTN_NAMES[p.attn]}",
              f"per_device_train_batch_size {p.micro_batch}", f"gradient_accumulation_steps {p.grad_accum}",
              f"max_length {p.seq_len}", f"gradient_checkpointing {p.gradient_checkpointing}", f"optim {opt.name}"
              + (f" ({opt.args})" if opt.args else "")]
    if p.uses_lora:
        script.append(f"LoRA r {p.lora_r}, lora_alpha {p.lora_alpha}, lora_dropout {p.lora_dropout}, "
                      f"target_modules {lora_targets(p, req.spec)}"
                      + (f", adapter_dtype bf16 ({BF16_ADAPTERS})" if p.adapter_dtype == "bf16" else ""))
    if p.quant:
        script.append("BitsAndBytesConfig(" + ("load_in_8bit=True" if p.quant == "int8" else
                      f"load_in_4bit=True, bnb_4bit_quant_type={p.quant}, bnb_4bit_use_double_quant="
                      f"{p.double_quant}, bnb_4bit_compute_dtype={p.compute_dtype}") + ")")
    if p.offload_activations:
        script.append("offload_activations: run the step under torch.autograd.graph.save_on_cpu(pin_memory=True)")
    if p.tiled_mlp:
        script.append("tiled_mlp: patch each block's MLP forward with DeepSpeed's TiledMLP")
    notes.append("the training knobs are train.py's (a launch config does not carry them): " + "; ".join(script))
    notes += list(opt.notes)
    run = run_command("accelerate", "THIS.yaml")
    return Emitted("accelerate", _header(req, "an accelerate launch config", run, notes) + _yaml(doc), tuple(notes))


EMITTERS: dict[str, Callable[[EmitRequest], Emitted]] = {
    "trl": emit_trl, "hf": emit_hf, "axolotl": emit_axolotl, "accelerate": emit_accelerate,
}


def emit(target: str, req: EmitRequest) -> Emitted:
    """The ``target`` document for ``req`` (BadInput for an unknown target; ``oomdoctor`` is ``tuner.write_config``'s)."""
    if target not in EMITTERS:
        raise BadInput(f"--emit {target!r}: use one of {', '.join(EMIT_TARGETS)}")
    return EMITTERS[target](req)


# ---------------------------------------------------------------------------------------------- from a tune result


def request_from_result(result: TuneResult, model_ref: str, dataset: str | None = None) -> EmitRequest:
    """An :class:`EmitRequest` for a :class:`oomdoctor.tune.tuner.TuneResult`: a local model is resolved to an
    absolute path; the header carries capacity, plan, batch and the predicted peak."""
    p = Path(model_ref).expanduser()
    local = p.exists()
    has_weights = not local or (p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin"))))
    ref = str(p.resolve()) if local else model_ref
    if local and p.is_file():
        ref = str(p.resolve().parent)
    m, plan = result.memory, result.plan
    header = (
        f"Tuned for {result.spec.name} on {format_bytes(result.capacity_bytes)} ({result.capacity_source}), "
        f"margin {format_bytes(result.budget.margin_bytes)}, seq_len {result.seq_len}.",
        f"Plan: {plan.label()}; micro-batch {plan.micro_batch} x {plan.grad_accum} accumulation = effective batch "
        f"{plan.effective_batch}.",
        f"Predicted {result.budget.counted.replace('_', ' ')} {format_bytes(result.budget.needed(m))} of "
        f"{format_bytes(result.budget_bytes)} budget (verification: {result.verification}).",
    )
    return EmitRequest(plan=plan, model=ref, spec=result.spec, dataset=dataset, header=header,
                       model_has_weights=has_weights, gpus_per_node=result.topology.gpus_per_node)


def default_emit_path(target: str, directory: str | os.PathLike = ".") -> Path:
    """``./oomdoctor-TARGET.yaml`` (``.json`` for hf), or the first free ``-2``, ``-3``... sibling."""
    d, suffix = Path(directory), SUFFIXES[target]
    p, n = d / f"oomdoctor-{target}{suffix}", 2
    while p.exists():
        p, n = d / f"oomdoctor-{target}-{n}{suffix}", n + 1
    return p


@dataclass(frozen=True)
class EmitWritten:
    """A foreign config on disk."""

    emitted: Emitted
    path: Path
    command: str
    """How to run (``hf``: load) it."""


def write_emitted(result: TuneResult, model_ref: str, target: str, path: str | os.PathLike | None = None, *,
                  overwrite: bool = False, dataset: str | None = None) -> EmitWritten:
    """Build the ``target`` document for a tune result and write it (``path=None``: :func:`default_emit_path`)."""
    em = emit(target, request_from_result(result, model_ref, dataset))
    out = write_text_atomic(path if path is not None else default_emit_path(target), em.text, overwrite=overwrite)
    env = "" if target == "hf" else f"PYTORCH_CUDA_ALLOC_CONF={result.alloc_conf} "
    return EmitWritten(em, out, env + em.command(out))


__all__ = [
    "DATASET_PLACEHOLDER", "EMITTERS", "EMIT_TARGETS", "EmitRequest", "EmitWritten", "Emitted",
    "decoder_layer_class", "deepspeed_config", "default_emit_path", "emit", "emit_accelerate", "emit_axolotl",
    "emit_hf", "emit_trl", "lora_targets", "request_from_result",
    "run_command", "write_emitted",
]
