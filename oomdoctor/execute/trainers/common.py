"""What every trainer's document is built from, and the mappings they share (precision, optimizer names, LoRA targets,
data files, the multi-GPU keys of TrainingArguments)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.plan.techniques import ALL_LINEAR, HF_OPTIM_NAMES

#: Dataset written when no data file was given (the bundled sample only exists inside this package).
DATASET_PLACEHOLDER = "PATH/TO/YOUR/train.jsonl"
#: ``load_dataset`` builder for a local data file, by suffix.
DATA_BUILDERS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
#: Directory the trainers write checkpoints to when none is given.
DEFAULT_OUTPUT_DIR = "runs/train"


@dataclass(frozen=True)
class DocumentRequest:
    """What a trainer's config is built from."""

    plan: Plan
    """The plan (micro-batch and accumulation set); ``plan.trainer`` is the trainer the document is for."""
    spec: ModelSpec
    """The model's spec: linear module names (LoRA targets), decoder layer class (FSDP), hidden size (buckets)."""
    model: str
    """``model_name_or_path``: a hub id or a local directory."""
    dataset: str | None = None
    """Data file, directory or hub id; None writes :data:`DATASET_PLACEHOLDER` (and a note)."""
    output_dir: str = DEFAULT_OUTPUT_DIR
    """Where the trainer writes checkpoints."""
    schedule: dict[str, Any] = field(default_factory=dict)
    """Keys with no memory effect every HF-based trainer shares (learning_rate, num_train_epochs or max_steps,
    lr_scheduler_type, warmup_steps, weight_decay, max_grad_norm, seed, logging_steps, save_steps,
    save_total_limit): ``oomdoctor train``'s defaults, so a foreign run trains like ``oomdoctor train`` would."""
    model_has_weights: bool = True
    """False for a config-only model: the trainers need real weights (a note says so)."""
    gpus_per_node: int | None = None
    """GPUs per machine (None: every rank on one machine)."""

    @property
    def machines(self) -> int:
        return self.plan.world_size // (self.gpus_per_node or self.plan.world_size)


@dataclass(frozen=True)
class Document:
    """A trainer's config: the data its file holds and what a reader must know or fill in."""

    data: dict[str, Any]
    """The file's content as a mapping (YAML or JSON)."""
    notes: tuple[str, ...] = ()
    """Placeholders to fill in and how to launch (what the trainer cannot run is never written: see
    ``oomdoctor.plan.targets``)."""


@dataclass(frozen=True)
class Precision:
    """The plan's precision as HF trainers spell it."""

    bf16: bool
    """``bf16: true`` (bf16 autocast; with pure bf16 weights as well)."""
    fp16: bool
    """``fp16: true`` (fp16 autocast on fp32 weights)."""
    dtype: str
    """Weight (load) dtype: float32 unless the plan is pure bf16."""


def precision(plan: Plan) -> Precision:
    """fp32 -> no bf16/fp16; fp16-/bf16-mixed -> fp16/bf16 autocast on fp32 weights; bf16 -> bfloat16 weights."""
    return Precision(
        bf16=plan.precision in ("bf16-mixed", "bf16"),
        fp16=plan.precision == "fp16-mixed",
        dtype="bfloat16" if plan.precision == "bf16" else "float32",
    )


def hf_optim(plan: Plan) -> tuple[str, str | None]:
    """The HF ``optim`` name of the plan's optimizer (AdamW: ``adamw_torch_fused`` for the fused kernel,
    ``adamw_torch`` for foreach) and ``optim_args`` (SGD momentum) or None."""
    name = HF_OPTIM_NAMES[plan.optimizer]
    if plan.optimizer == "adamw" and plan.optimizer_impl == "fused":
        name = "adamw_torch_fused"
    args = f"momentum={plan.sgd_momentum}" if plan.optimizer == "sgd" and plan.sgd_momentum else None
    return name, args


def lora_targets(plan: Plan, spec: ModelSpec) -> str | list[str]:
    """peft ``target_modules``: what the executor hands peft for this plan (``model/lora_targets.target_modules``):
    ``all-linear`` as is, else the sorted leaf names (all-linear expanded without what peft cannot adapt, the
    head with ``lora_on_head``); on a vision-language model one regex for those names outside its towers
    (``model/inventory.text_side_targets``: the executor's ``exclude_modules``, which TRL and axolotl lack)."""
    from oomdoctor.model.lora_targets import all_linear_names, target_modules

    targets = target_modules(spec, plan)
    if spec.towers:
        from oomdoctor.model.inventory import text_side_targets

        return text_side_targets(all_linear_names(spec) if targets == ALL_LINEAR else set(targets), spec.towers)
    return targets


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


def training_args_topology(req: DocumentRequest) -> tuple[dict[str, Any], list[str]]:
    """TrainingArguments keys for the plan's strategy (FSDP2 ``fsdp``/``fsdp_config`` or a ``deepspeed`` dict) and
    the notes: how to launch it. HSDP and single-GPU offload are refused before (``plan.targets``)."""
    p = req.plan
    if p.world_size == 1 and p.strategy == "single":
        return {}, []
    nodes = f" --nnodes {req.machines}" if req.machines > 1 else ""
    notes = [
        f"{p.world_size} GPUs: launch with `torchrun --nproc-per-node {p.world_size // req.machines}{nodes}` "
        "(per_device_train_batch_size is per GPU)"
    ]
    doc: dict[str, Any] = {}
    if p.strategy == "fsdp":
        layer = decoder_layer_class(req.spec)
        cfg: dict[str, Any] = {
            "version": 2,
            "reshard_after_forward": p.reshard_after_forward,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "cpu_ram_efficient_loading": True,
            "state_dict_type": "SHARDED_STATE_DICT",
            "cpu_offload": p.offload_params,
        }
        if layer:
            cfg["transformer_layer_cls_to_wrap"] = [layer]
        else:
            notes.append("fsdp: set fsdp_config.transformer_layer_cls_to_wrap to the model's decoder layer class")
        doc.update(fsdp=True, fsdp_config=cfg)
    elif p.strategy in DEEPSPEED:
        doc["deepspeed"] = deepspeed_config(p, req.spec)
        notes.append("deepspeed: `pip install deepspeed`; the offload knobs are in its zero_optimization")
    return doc, notes


def dataset_kwargs(path: str | None) -> dict[str, Any]:
    """``load_dataset`` kwargs: a local file through its builder (``json`` for .jsonl), else a directory/hub id."""
    p = path or DATASET_PLACEHOLDER
    builder = DATA_BUILDERS.get(Path(p).suffix.lower())
    if builder:
        return {"path": builder, "data_files": p, "split": "train"}
    return {"path": p, "split": "train"}


def common_notes(req: DocumentRequest) -> list[str]:
    """Placeholders to fill in, and what no key expresses: a VLM's towers frozen in a full fine-tune."""
    notes = []
    if req.dataset is None:
        notes.append(f"dataset is a placeholder ({DATASET_PLACEHOLDER}): point it at your data (or pass --dataset)")
    if not req.model_has_weights:
        notes.append(f"{req.model} is a config without weights: point the model at real weights")
    if req.spec.towers and req.plan.method == "full":
        notes.append(
            f"priced as text-only fine-tuning with {', '.join(req.spec.towers)} frozen and never run: set "
            "requires_grad=False on them (DDP refuses trainable parameters that get no gradient)"
        )
    return notes


__all__ = [
    "DATASET_PLACEHOLDER",
    "DATA_BUILDERS",
    "DEFAULT_OUTPUT_DIR",
    "Document",
    "DocumentRequest",
    "Precision",
    "common_notes",
    "dataset_kwargs",
    "decoder_layer_class",
    "deepspeed_config",
    "hf_optim",
    "lora_targets",
    "precision",
    "training_args_topology",
]
