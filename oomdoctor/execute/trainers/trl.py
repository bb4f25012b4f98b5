"""TRL: the YAML ``trl sft --config FILE`` reads (TrlParser over ScriptArguments, SFTConfig, ModelConfig and
DatasetMixtureConfig: every key below is a field of one of them, checked by tests/test_emit.py with TRL's parser).

What SFTTrainer runs that no key turns off (``oomdoctor.plan.targets`` fixes these knobs for ``trainer: trl``): the
loss through its fused LM head, bf16 adapters on a quantized model, no k-bit preparation, and 4-bit layers computing
in the model's dtype.
"""

from __future__ import annotations

from typing import Any

from oomdoctor.execute.trainers.common import (Document, DocumentRequest, common_notes, dataset_kwargs, hf_optim,
                                               lora_targets, precision, training_args_topology)
from oomdoctor.plan.techniques import HF_ATTN_NAMES

#: The command that runs a TRL document.
COMMAND = "trl sft --config {path}"


def document(req: DocumentRequest) -> Document:
    """ModelConfig (model, dtype, attention, peft, bitsandbytes), SFTConfig (batch, precision, checkpointing,
    activation offloading, optimizer, max_length, schedule, topology), DatasetMixtureConfig (datasets)."""
    p, prec = req.plan, precision(req.plan)
    optim, optim_args = hf_optim(p)
    notes = common_notes(req)
    doc: dict[str, Any] = {
        "model_name_or_path": req.model,
        "dtype": prec.dtype,
        "attn_implementation": HF_ATTN_NAMES[p.attn],
        "datasets": [dataset_kwargs(req.dataset)],
        "max_length": p.seq_len,
        "packing": False,
        "output_dir": req.output_dir,
        "per_device_train_batch_size": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "bf16": prec.bf16,
        "fp16": prec.fp16,
        # transformers 5 names (gradient_checkpointing* are its deprecated aliases, mirrored from these)
        "activation_checkpointing": p.gradient_checkpointing,
    }
    if p.gradient_checkpointing:
        doc["activation_checkpointing_kwargs"] = {"use_reentrant": False}
    doc["activation_offloading"] = p.offload_activations
    doc["optim"] = optim
    if optim_args:
        doc["optim_args"] = optim_args
    doc["use_peft"] = p.uses_lora
    if p.uses_lora:
        targets = lora_targets(p, req.spec)
        if isinstance(targets, list) and len(targets) == 1:
            # TRL passes a one-element list to peft as a string, which peft full-matches against the module path
            targets = rf".*\.{targets[0]}"
        doc.update(lora_r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout,
                   lora_target_modules=targets)
    doc["load_in_4bit"] = p.quant in ("nf4", "fp4")
    doc["load_in_8bit"] = p.quant == "int8"
    if p.quant in ("nf4", "fp4"):
        doc["bnb_4bit_quant_type"] = p.quant
        doc["use_bnb_nested_quant"] = p.double_quant
    doc.update(req.schedule)
    doc["report_to"] = "none"
    topo, topo_notes = training_args_topology(req)
    doc.update(topo)
    return Document(doc, tuple(notes + topo_notes))


__all__ = ["COMMAND", "document"]
