"""TRL: the YAML ``trl sft --config FILE`` reads (TrlParser over ScriptArguments, SFTConfig, ModelConfig and
DatasetMixtureConfig: every key below is a field of one of them, checked by tests/test_emit.py with TRL's parser),
and :func:`build_trainer`, the ``SFTTrainer`` ``trl sft`` builds from such a file (trl 1.16 ``scripts/sft.py``).

What SFTTrainer runs that no key turns off (``oomdoctor.plan.targets`` fixes these knobs for ``trainer: trl``): the
loss through its fused LM head, bf16 adapters on a quantized model, no k-bit preparation, and 4-bit layers computing
in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
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
        doc.update(lora_r=p.lora_r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout, lora_target_modules=targets)
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


# ---------------------------------------------------------------------------------------------- trl sft


def parse(data: dict[str, Any], **overrides: Any) -> tuple:
    """``(ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig)`` as ``trl sft --config FILE`` parses them
    (``TrlParser.parse_args_and_config`` over the YAML file ``data`` is written to); ``overrides`` are the keys a
    user would add on the command line (``use_cpu=True``), which take precedence over the file as they do there."""
    import os
    import tempfile

    import yaml
    from trl.scripts.sft import make_parser

    with tempfile.TemporaryDirectory(prefix="oomdoctor-trl-") as tmp:
        path = os.path.join(tmp, "trl.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({**data, **overrides}, f, sort_keys=False)
        return make_parser().parse_args_and_config(["--config", path])


def model_init_kwargs(training_args, model_args) -> dict[str, Any]:
    """The ``model_init_kwargs`` ``trl sft`` hands SFTTrainer (trl 1.16 ``scripts/sft.py`` ``main``: revision,
    trust_remote_code, attn_implementation, dtype, then ``SFTConfig.model_init_kwargs``)."""
    kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        kwargs.update(training_args.model_init_kwargs)
    return kwargs


def from_pretrained_kwargs(init_kwargs: dict[str, Any], quantization_config=None) -> dict[str, Any]:
    """What SFTTrainer passes ``from_pretrained`` for a model id (trl 1.16 ``trainer/utils.py``
    ``create_model_from_path``, lines 1332-1341): ``dtype`` float32 when absent, a dtype name as the torch dtype
    (``"auto"`` and None as given); plus the trainer's ``quantization_config``."""
    import torch

    kwargs = dict(init_kwargs)
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype in ("bfloat16", "float16", "float32"):
        kwargs["dtype"] = getattr(torch, dtype)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    return kwargs


def build_trainer(
    data: dict[str, Any],
    *,
    load: Callable[[str, dict[str, Any]], Any] | None = None,
    tokenizer=None,
    train_dataset=None,
    **overrides: Any,
):
    """The ``SFTTrainer`` ``trl sft --config FILE`` builds from ``data`` (trl 1.16 ``scripts/sft.py`` ``main``):
    the file parsed by TRL's own parser (:func:`parse`, ``overrides`` as command-line keys), the model created from
    ``model_name_or_path`` with the ``model_init_kwargs``, ``get_quantization_config`` and ``get_peft_config``
    of the parsed ``ModelConfig``, the train split of the dataset mixture, no eval set unless ``eval_strategy``
    asks. ``load(model_id, from_pretrained_kwargs)`` replaces the model creation (the simulated engine builds the
    same model on the meta device); ``tokenizer`` / ``train_dataset`` replace the processor load / the dataset."""
    from trl import SFTTrainer, get_dataset, get_peft_config, get_quantization_config

    _script, training_args, model_args, dataset_args = parse(data, **overrides)
    training_args.model_init_kwargs = model_init_kwargs(training_args, model_args)
    quantization_config = get_quantization_config(model_args)
    model: Any = model_args.model_name_or_path
    if load is not None:
        model = load(model, from_pretrained_kwargs(training_args.model_init_kwargs, quantization_config))
        training_args.model_init_kwargs, quantization_config = None, None  # used above, as SFTTrainer would
    eval_dataset = None
    if train_dataset is None:
        dataset = get_dataset(dataset_args)
        train_dataset = dataset[_script.dataset_train_split]
        if training_args.eval_strategy != "no":
            eval_dataset = dataset[_script.dataset_test_split]
    return SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        quantization_config=quantization_config,
        peft_config=get_peft_config(model_args),
    )


__all__ = ["COMMAND", "build_trainer", "document", "from_pretrained_kwargs", "model_init_kwargs", "parse"]
