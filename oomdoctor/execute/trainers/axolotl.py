"""axolotl: a YAML in axolotl's config schema (``axolotl.utils.schemas.config.AxolotlInputConfig``) for
``axolotl train FILE``. axolotl pins older transformers/peft/trl than oomdoctor's, so it is not installed next to it:
its plans are priced by ``oomdoctor.plan.targets``' rules (as axolotl 0.19 runs them, read from its source), not by
replaying its step."""

from __future__ import annotations

from typing import Any

from oomdoctor.execute.trainers.common import (DATA_BUILDERS, Document, DocumentRequest, common_notes, dataset_kwargs,
                                               hf_optim, lora_targets, precision)
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
        doc["bnb_config_kwargs"] = {"bnb_4bit_quant_type": p.quant, "bnb_4bit_use_double_quant": p.double_quant,
                                    "bnb_4bit_compute_dtype": p.compute_dtype}
    if p.quant is not None:
        doc["skip_prepare_model_for_kbit_training"] = not p.kbit_upcast
    doc.update(datasets=[data], output_dir=req.output_dir, sequence_len=p.seq_len, sample_packing=False,
               micro_batch_size=p.micro_batch, gradient_accumulation_steps=p.grad_accum)
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
    if p.tiled_mlp:
        doc["tiled_mlp"] = True  # axolotl's ALST tiled MLP
    if p.loss == "chunked":
        doc["plugins"] = ["axolotl.integrations.liger.LigerPlugin"]
        doc["liger_fused_linear_cross_entropy"] = True
    doc.update({k: s[k] for k in ("seed", "logging_steps", "save_steps", "save_total_limit") if k in s})
    return Document(doc, tuple(notes))


__all__ = ["COMMAND", "document"]
