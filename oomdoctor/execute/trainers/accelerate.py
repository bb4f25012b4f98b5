"""accelerate: a launch config (``ClusterConfig``) for ``accelerate launch --config_file FILE train.py`` — processes
and machines, mixed precision, the strategy (DDP, the FSDP2 plugin, the DeepSpeed plugin). The training knobs are the
script's: the document's notes list the values ``train.py`` must use (the plan is priced as oomdoctor's own step,
which is the plain recipe such a script runs)."""

from __future__ import annotations

from typing import Any

from oomdoctor.execute.trainers.common import (
    DATASET_PLACEHOLDER,
    Document,
    DocumentRequest,
    decoder_layer_class,
    hf_optim,
    lora_targets,
    precision,
)
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.plan.techniques import HF_ATTN_NAMES

#: The command that runs an accelerate document.
COMMAND = "accelerate launch --config_file {path} train.py"


def _fsdp(req: DocumentRequest) -> tuple[dict[str, Any], list[str]]:
    """The FSDP2 plugin: per-decoder-layer wrapping, ``reshard_after_forward``, CPU offload; HSDP through
    ``parallelism_config``."""
    p = req.plan
    notes: list[str] = []
    layer = decoder_layer_class(req.spec)
    fsdp: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": p.reshard_after_forward,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_offload_params": p.offload_params,
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_activation_checkpointing": False,
    }
    if layer:
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = layer
    else:
        notes.append("fsdp: set fsdp_transformer_layer_cls_to_wrap to the model's decoder layer class")
    doc: dict[str, Any] = {"distributed_type": "FSDP", "fsdp_config": fsdp}
    if p.shard_group:
        doc["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": p.world_size // p.shard_group,
            "parallelism_config_dp_shard_size": p.shard_group,
        }
    if p.gradient_checkpointing:
        notes.append(
            "gradient checkpointing: the model's own (model.gradient_checkpointing_enable(gradient_"
            "checkpointing_kwargs={'use_reentrant': False}) in train.py), not fsdp_activation_checkpointing"
        )
    return doc, notes


def _strategy(req: DocumentRequest) -> tuple[dict[str, Any], list[str]]:
    """``distributed_type`` and the plugin section for the plan's strategy."""
    p = req.plan
    if p.strategy == "fsdp":
        return _fsdp(req)
    if p.strategy in DEEPSPEED:
        b = p.bucket_elems(req.spec.hidden_size)
        return {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "gradient_accumulation_steps": p.grad_accum,
                "offload_optimizer_device": "cpu" if p.offload_optimizer else "none",
                "offload_param_device": "cpu" if p.offload_params else "none",
                "zero3_init_flag": p.strategy == "zero3",
                "zero_stage": 3 if p.strategy == "zero3" else 2,
            },
        }, [
            f"DeepSpeed buckets: accelerate fills reduce_bucket_size 'auto' with hidden^2 = {b:,} elements, as priced",
            "deepspeed: `pip install deepspeed`",
        ]
    if p.strategy == "ddp":
        return {"distributed_type": "MULTI_GPU"}, []
    return {"distributed_type": "NO"}, []


def script_values(req: DocumentRequest) -> list[str]:
    """The values ``train.py`` must use: what a launch config does not carry."""
    p, prec = req.plan, precision(req.plan)
    optim, optim_args = hf_optim(p)
    values = [
        f"model {req.model}",
        f"dtype {prec.dtype}",
        f"attn_implementation {HF_ATTN_NAMES[p.attn]}",
        f"per_device_train_batch_size {p.micro_batch}",
        f"gradient_accumulation_steps {p.grad_accum}",
        f"max_length {p.seq_len}",
        f"gradient_checkpointing {p.gradient_checkpointing} (use_reentrant False)",
        f"optim {optim}" + (f" ({optim_args})" if optim_args else ""),
    ]
    if p.uses_lora:
        values.append(
            f"LoRA r {p.lora_r}, lora_alpha {p.lora_alpha}, lora_dropout {p.lora_dropout}, "
            f"target_modules {lora_targets(p, req.spec)}"
            + (", adapters cast to bf16 after get_peft_model" if p.adapter_dtype == "bf16" else "")
        )
    if p.quant:
        values.append(
            "BitsAndBytesConfig("
            + (
                "load_in_8bit=True"
                if p.quant == "int8"
                else f"load_in_4bit=True, bnb_4bit_quant_type={p.quant}, bnb_4bit_use_double_quant="
                f"{p.double_quant}, bnb_4bit_compute_dtype={p.compute_dtype}"
            )
            + ")"
            + (
                "; peft.prepare_model_for_kbit_training"
                if p.upcasts_kbit
                else "; no prepare_model_for_kbit_training (the unquantized weights stay in the load dtype)"
            )
        )
    if p.loss == "chunked":
        values.append(
            "loss: Liger's fused linear cross-entropy alone (liger_kernel.transformers."
            "_apply_liger_kernel_to_instance(model, fused_linear_cross_entropy=True, rope=False, "
            "rms_norm=False, swiglu=False, cross_entropy=False))"
        )
    if p.offload_activations:
        values.append(
            "offload_activations: run forward and backward under torch.autograd.graph.save_on_cpu(pin_memory=True)"
        )
    return values


def document(req: DocumentRequest) -> Document:
    """The launch config: the plan's processes and machines, mixed precision and strategy; the notes list the values
    ``train.py`` must use."""
    p, prec = req.plan, precision(req.plan)
    strategy, notes = _strategy(req)
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
        notes.insert(
            0, f"{req.machines} machines: set main_process_ip and run the launch on each with its machine_rank"
        )
    if req.dataset is None:
        notes.insert(0, f"dataset is a placeholder ({DATASET_PLACEHOLDER}): point your script at your data")
    if prec.dtype == "bfloat16":
        notes.append("pure bf16: mixed_precision bf16 only autocasts; load the model with dtype=torch.bfloat16")
    notes.append(
        "the training knobs are train.py's (a launch config does not carry them): " + "; ".join(script_values(req))
    )
    return Document(doc, tuple(notes))


__all__ = ["COMMAND", "document", "script_values"]
