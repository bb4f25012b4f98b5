"""transformers' ``Trainer`` from one JSON file: TrainingArguments keys plus the keys of the script that builds the
model, the adapters and the data — and that script.

The file: every TrainingArguments key (``HfArgumentParser(TrainingArguments).parse_dict(doc,
allow_extra_keys=True)`` reads it) and :data:`EXTRA_KEYS`, which TrainingArguments does not have. The script
(:func:`build_trainer`, run by ``python -m oomdoctor.execute.trainers.hf FILE``) is the plain Hugging Face recipe,
with nothing of oomdoctor's in the training step:

1. ``from_pretrained(model_name_or_path, **model_init_kwargs, quantization_config=BitsAndBytesConfig(...))`` with
   the auto class transformers has for the config (``AutoModelForImageTextToText`` for a vision-language model);
2. a quantized base: ``peft.prepare_model_for_kbit_training`` when ``prepare_model_for_kbit_training`` is true (it
   casts the unquantized weights to fp32), gradient checkpointing left to the Trainer;
3. ``peft.get_peft_model(model, LoraConfig(**peft_config))``; ``adapter_dtype: bf16`` casts the trainable
   parameters to bfloat16 (what TRL does for a quantized model);
4. ``load_dataset(**dataset)``, each record's ``text`` tokenized and truncated to ``max_length``;
   ``DataCollatorForLanguageModeling(mlm=False)`` pads each batch to its longest sequence (the plan is priced at
   ``max_length``: the longest batch sets the peak);
5. ``Trainer(model, args, train_dataset, data_collator).train()``, then ``save_model()``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomdoctor.execute.trainers.common import (
    Document,
    DocumentRequest,
    common_notes,
    dataset_kwargs,
    hf_optim,
    lora_targets,
    precision,
    training_args_topology,
)
from oomdoctor.plan.techniques import HF_ATTN_NAMES

#: Keys of the file that are the script's, not TrainingArguments'.
EXTRA_KEYS: tuple[str, ...] = (
    "model_name_or_path",
    "model_init_kwargs",
    "quantization_config",
    "prepare_model_for_kbit_training",
    "peft_config",
    "adapter_dtype",
    "dataset",
    "max_length",
    "oomdoctor",
)
#: ``liger_kernel_config`` for Liger's fused linear cross-entropy and none of its other kernels (keys a model's
#: ``apply_liger_kernel_to_*`` does not take are dropped by liger-kernel).
LIGER_LOSS_ONLY: dict[str, bool] = {
    "fused_linear_cross_entropy": True,
    "cross_entropy": False,
    "rope": False,
    "rms_norm": False,
    "layer_norm": False,
    "swiglu": False,
    "geglu": False,
}
#: The command that runs an HF document.
COMMAND = "python -m oomdoctor.execute.trainers.hf {path}"


def document(req: DocumentRequest) -> Document:
    """TrainingArguments (batch, precision, checkpointing, optimizer, Liger, schedule, topology) and the script's
    keys (model, quantization, k-bit preparation, LoRA, adapter dtype, data)."""
    p, prec = req.plan, precision(req.plan)
    optim, optim_args = hf_optim(p)
    notes = common_notes(req)
    doc: dict[str, Any] = {
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
    doc["optim"] = optim
    if optim_args:
        doc["optim_args"] = optim_args
    if p.loss == "chunked":  # the fused loss alone: Liger's norm/MLP/RoPE kernels would change the blocks' memory
        doc["use_liger_kernel"] = True
        doc["liger_kernel_config"] = dict(LIGER_LOSS_ONLY)
        notes.append("use_liger_kernel: `pip install liger-kernel` (Triton kernels: a CUDA GPU)")
    doc.update(req.schedule)
    doc["report_to"] = "none"
    topo, topo_notes = training_args_topology(req)
    doc.update(topo)
    notes += topo_notes
    quant: dict[str, Any] | None = None
    if p.quant == "int8":
        quant = {"load_in_8bit": True}
    elif p.quant in ("nf4", "fp4"):
        quant = {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": p.quant,
            "bnb_4bit_use_double_quant": p.double_quant,
            "bnb_4bit_compute_dtype": p.compute_dtype,
        }
    peft = None
    if p.uses_lora:
        peft = {
            "r": p.lora_r,
            "lora_alpha": p.lora_alpha,
            "lora_dropout": p.lora_dropout,
            "target_modules": lora_targets(p, req.spec),
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }
    doc.update(
        {
            "model_name_or_path": req.model,
            "model_init_kwargs": {"dtype": prec.dtype, "attn_implementation": HF_ATTN_NAMES[p.attn]},
            "quantization_config": quant,
            "prepare_model_for_kbit_training": p.upcasts_kbit,
            "peft_config": peft,
            "adapter_dtype": p.adapter_dtype if p.uses_lora else None,
            "dataset": dataset_kwargs(req.dataset),
            "max_length": p.seq_len,
        }
    )
    return Document(doc, tuple(notes))


# ---------------------------------------------------------------------------------------------- the script


def training_arguments(doc: dict[str, Any], **overrides: Any):
    """The TrainingArguments of ``doc`` (its extra keys ignored), with ``overrides`` (e.g. ``use_cpu=True``)."""
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_dict({**doc, **overrides}, allow_extra_keys=True)
    return args


def from_pretrained_kwargs(doc: dict[str, Any]) -> dict[str, Any]:
    """Step 1's ``from_pretrained`` kwargs: ``model_init_kwargs`` (a dtype name as the torch dtype, ``"auto"`` as
    given) and the ``BitsAndBytesConfig`` of ``quantization_config``."""
    import torch
    from transformers import BitsAndBytesConfig

    kwargs = dict(doc.get("model_init_kwargs") or {})
    if isinstance(kwargs.get("dtype"), str) and kwargs["dtype"] != "auto":
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    quant = doc.get("quantization_config")
    if quant:
        q = dict(quant)
        if isinstance(q.get("bnb_4bit_compute_dtype"), str):
            q["bnb_4bit_compute_dtype"] = getattr(torch, q["bnb_4bit_compute_dtype"])
        kwargs["quantization_config"] = BitsAndBytesConfig(**q)
    return kwargs


def load_model(doc: dict[str, Any], load: Callable[[str, dict[str, Any]], Any] | None = None):
    """Step 1-3 of the recipe: the model as the Trainer gets it (quantized, prepared, peft-wrapped). ``load(model_id,
    from_pretrained_kwargs)`` replaces step 1's ``from_pretrained`` (the simulated engine builds the same model on
    the meta device)."""
    from transformers import AutoConfig

    from oomdoctor.model.inventory import auto_model_class

    name, kwargs = doc["model_name_or_path"], from_pretrained_kwargs(doc)
    if load is not None:
        return prepare_model(load(name, kwargs), doc)
    model = auto_model_class(AutoConfig.from_pretrained(name)).from_pretrained(name, **kwargs)
    return prepare_model(model, doc)


def prepare_model(model, doc: dict[str, Any]):
    """Steps 2-3 on a loaded model: k-bit preparation, LoRA, the adapters' dtype."""
    import torch

    if doc.get("quantization_config") and doc.get("prepare_model_for_kbit_training"):
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if doc.get("peft_config"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**doc["peft_config"]))
        if doc.get("adapter_dtype") == "bf16":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    return model


def load_data(doc: dict[str, Any], tokenizer, dataset: str | None = None):
    """Step 4: the training split, each record's ``text`` tokenized to at most ``max_length`` tokens (``dataset``:
    another data file or hub id than the document's)."""
    from datasets import load_dataset

    kwargs = dataset_kwargs(dataset) if dataset else dict(doc["dataset"])
    data = load_dataset(**kwargs)
    max_length = int(doc["max_length"])
    return data.map(
        lambda rec: tokenizer(rec["text"], truncation=True, max_length=max_length), remove_columns=data.column_names
    )


def build_trainer(
    doc: dict[str, Any],
    *,
    model=None,
    load: Callable[[str, dict[str, Any]], Any] | None = None,
    tokenizer=None,
    train_dataset=None,
    **overrides: Any,
):
    """The Trainer of the recipe (module docstring) for ``doc``; ``model`` replaces steps 1-3 (a prepared model),
    ``load`` step 1 only (:func:`load_model`), ``tokenizer`` / ``train_dataset`` the tokenizer load / step 4,
    ``overrides`` TrainingArguments keys (``use_cpu=True``)."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    args = training_arguments(doc, **overrides)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(doc["model_name_or_path"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model is None:
        model = load_model(doc, load)
    if train_dataset is None:
        train_dataset = load_data(doc, tokenizer)
    return Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m oomdoctor.execute.trainers.hf FILE [--dataset PATH] [--use_cpu] [--output_dir DIR]
    [--max_steps N]``: train as the file says (``--use_cpu`` on a machine without a GPU; ``--dataset`` instead of the
    file's data)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m oomdoctor.execute.trainers.hf", description=main.__doc__)
    parser.add_argument("file", help="the JSON `oomdoctor tune --emit hf` wrote")
    parser.add_argument("--dataset", help="a data file (.jsonl/.json/.csv/.parquet/.txt) or hub id with a text field")
    parser.add_argument("--use_cpu", action="store_true", help="train on the CPU (TrainingArguments.use_cpu)")
    parser.add_argument("--output_dir", help="where checkpoints go (default: the file's output_dir)")
    parser.add_argument("--max_steps", type=int, help="stop after this many optimizer steps (a smoke run)")
    ns = parser.parse_args(argv)
    doc = json.loads(Path(ns.file).read_text())
    overrides: dict[str, Any] = {k: getattr(ns, k) for k in ("output_dir", "max_steps") if getattr(ns, k)}
    if ns.use_cpu:
        overrides["use_cpu"] = True
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(doc["model_name_or_path"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    trainer = build_trainer(doc, tokenizer=tokenizer, train_dataset=load_data(doc, tokenizer, ns.dataset), **overrides)
    trainer.train()
    trainer.save_model()
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "COMMAND",
    "EXTRA_KEYS",
    "LIGER_LOSS_ONLY",
    "build_trainer",
    "document",
    "from_pretrained_kwargs",
    "load_data",
    "load_model",
    "main",
    "prepare_model",
    "training_arguments",
]
