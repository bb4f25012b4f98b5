"""axolotl: a YAML in axolotl's config schema (``axolotl.utils.schemas.config.AxolotlInputConfig``) for
``axolotl train FILE``. axolotl pins older transformers/peft/trl than oomdoctor's, so it is not installed next to it:
its plans are priced by ``oomdoctor.plan.targets``' rules (as axolotl 0.19 runs them, read from its source), not by
replaying its step.

Keys written against axolotl's defaults so that its step is the priced one (axolotl 0.19, read from its source):
``gradient_checkpointing_kwargs.use_reentrant: false`` (its default is true), ``lora_*_kernel: false`` (its fused LoRA
kernels, on by default for lora/qlora, save other activations than peft's layers), ``pad_to_sequence_len: true``
(every batch padded to ``sequence_len``), ``tiled_mlp_num_shards`` (its own default is one shard per 32k tokens), the
Liger plugin with the fused loss alone."""

from __future__ import annotations

from typing import Any

from oomdoctor.execute.trainers.common import (
    DATA_BUILDERS,
    Document,
    DocumentRequest,
    common_notes,
    dataset_kwargs,
    decoder_layer_class,
    deepspeed_config,
    hf_optim,
    lora_targets,
    precision,
)
from oomdoctor.model.execution import num_tiles
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.plan.techniques import ALL_LINEAR, HF_ATTN_NAMES

#: The command that runs an axolotl document.
COMMAND = "axolotl train {path}"


def document(req: DocumentRequest) -> Document:
    """base model, quantization, adapter, data, batch, schedule, precision, checkpointing, offloading, attention,
    tiled MLP."""
    p, prec = req.plan, precision(req.plan)
    optim, optim_args = hf_optim(p)
    notes = common_notes(req)
    ds = dict(dataset_kwargs(req.dataset))
    data = {"path": ds.pop("data_files", ds["path"]), "split": "train", "type": "completion"}
    if ds["path"] in DATA_BUILDERS.values():
        data["ds_type"] = ds["path"]
    doc: dict[str, Any] = {"base_model": req.model}
    doc["load_in_8bit"] = p.quant == "int8"
    doc["load_in_4bit"] = p.quant in ("nf4", "fp4")
    if p.uses_lora:
        doc["adapter"] = "qlora" if p.quant in ("nf4", "fp4") else "lora"
        doc.update(lora_r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout)
        targets = lora_targets(p, req.spec)
        if targets == ALL_LINEAR:
            doc["lora_target_linear"] = True
        else:
            doc["lora_target_modules"] = targets
    if p.quant in ("nf4", "fp4"):
        doc["bnb_config_kwargs"] = {
            "bnb_4bit_quant_type": p.quant,
            "bnb_4bit_use_double_quant": p.double_quant,
            "bnb_4bit_compute_dtype": p.compute_dtype,
        }
    if p.uses_lora:  # on by default for lora/qlora: they save other activations than peft's layers, as priced
        doc.update(lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False, lora_embedding_kernel=False)
    doc.update(
        datasets=[data],
        output_dir=req.output_dir,
        sequence_len=p.seq_len,
        sample_packing=False,
        pad_to_sequence_len=True,
        micro_batch_size=p.micro_batch,
        gradient_accumulation_steps=p.grad_accum,
    )
    s = dict(req.schedule)
    if "max_steps" in s:
        doc["max_steps"] = s["max_steps"]
    elif "num_train_epochs" in s:
        doc["num_epochs"] = s["num_train_epochs"]
    doc["optimizer"] = optim
    if optim_args:
        doc["optim_args"] = optim_args
    doc.update({k: s[k] for k in ("learning_rate", "warmup_steps", "weight_decay", "max_grad_norm") if k in s})
    if "lr_scheduler_type" in s:
        doc["lr_scheduler"] = s["lr_scheduler_type"]
    doc["bf16"] = prec.bf16
    doc["fp16"] = prec.fp16
    doc["gradient_checkpointing"] = p.gradient_checkpointing
    if p.gradient_checkpointing:
        doc["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    doc["activation_offloading"] = p.offload_activations
    doc["attn_implementation"] = HF_ATTN_NAMES[p.attn]
    if p.tiled_mlp:  # axolotl's TiledMLP, as many shards as the plan's tiles (its own default: one per 32k tokens)
        doc.update(tiled_mlp=True, tiled_mlp_num_shards=num_tiles(p.tokens_per_micro_batch, req.spec.hidden_size))
        notes.append("tiled_mlp: axolotl imports deepspeed for it (`pip install deepspeed`)")
    if p.loss == "chunked":  # the fused loss alone: the other Liger kernels would change the blocks' activations
        doc["plugins"] = ["axolotl.integrations.liger.LigerPlugin"]
        doc["liger_fused_linear_cross_entropy"] = True
        notes.append("liger_fused_linear_cross_entropy: liger-kernel's Triton kernels need a CUDA GPU")
    doc.update({k: s[k] for k in ("seed", "logging_steps", "save_steps", "save_total_limit") if k in s})
    topo, topo_notes = _topology(req)
    doc.update(topo)
    return Document(doc, tuple(notes + topo_notes))


def _topology(req: DocumentRequest) -> tuple[dict[str, Any], list[str]]:
    """FSDP2 (``fsdp_version: 2`` + ``fsdp_config``) or DeepSpeed (an inline ``deepspeed`` dict, the one HF Trainer
    gets), and how to launch on N GPUs (``axolotl train FILE -- --num_processes N``, accelerate launch)."""
    p = req.plan
    if p.world_size == 1 and p.strategy == "single":
        return {}, []
    notes = [
        f"{p.world_size} GPUs: `axolotl train THIS.yaml -- --num_processes {p.world_size}` "
        "(micro_batch_size is per GPU)"
    ]
    doc: dict[str, Any] = {}
    if p.strategy == "fsdp":
        cfg: dict[str, Any] = {
            "reshard_after_forward": p.reshard_after_forward,
            "offload_params": p.offload_params,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "state_dict_type": "SHARDED_STATE_DICT",
        }
        layer = decoder_layer_class(req.spec)
        if layer:
            cfg["transformer_layer_cls_to_wrap"] = layer
        else:
            notes.append("fsdp: set fsdp_config.transformer_layer_cls_to_wrap to the model's decoder layer class")
        if p.quant is None:  # axolotl refuses FSDP2 + 4-bit with cpu_ram_efficient_loading
            cfg["cpu_ram_efficient_loading"] = True
        doc.update(fsdp_version=2, fsdp_config=cfg)
    elif p.strategy in DEEPSPEED:
        doc["deepspeed"] = deepspeed_config(p, req.spec)
        notes.append("deepspeed: `pip install deepspeed`")
    return doc, notes


__all__ = ["COMMAND", "document"]
