"""Writing a train config: from a plan (what ``tune`` emits) and as commented YAML (comments from ``schema``)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.plan import Plan, validate
from oomdoctor.plan.techniques import HF_ATTN_NAMES, HF_OPTIM_NAMES
from oomdoctor.train.config.schema import DATASET, GROUPS, MODEL, NO_MEMORY, TOP_KEYS, Key, default
from oomdoctor.train.config.sections import DatasetConfig, ModelConfig, TrainConfig
from oomdoctor.units import format_bytes, parse_size


def config_from_plan(model: str, plan: Plan, **extra: Any) -> TrainConfig:
    """A :class:`TrainConfig` that executes ``plan`` on ``model`` (what ``tune`` emits).

    ``model``: a weights directory or hub id (``init: pretrained``), or pass ``init="random"`` (+ ``tokenizer=``)
    to build from a config. ``extra``: any top-level TrainConfig key (``max_steps``, ``learning_rate``,
    ``global_batch_size``, ``dataset=DatasetConfig(...)`` or ``dataset="path"``...), plus ``init``/``tokenizer``.
    """
    plan = validate(plan)
    init = extra.pop("init", "pretrained")
    tok = extra.pop("tokenizer", None)
    mcfg = ModelConfig(
        path=model if init == "pretrained" else None,
        config=model if init == "random" else None,
        init=init,
        tokenizer=tok,
        attn_implementation=HF_ATTN_NAMES[plan.attn],
    )
    ds = extra.pop("dataset", None)
    dcfg = DatasetConfig(path=ds) if isinstance(ds, (str, list)) else (ds or DatasetConfig())
    optim = HF_OPTIM_NAMES[plan.optimizer]
    if plan.optimizer == "adamw" and plan.optimizer_impl == "fused":
        optim = "adamw_torch_fused"
    quant = plan.quant
    cfg = TrainConfig(
        model=mcfg,
        dataset=dcfg,
        method=plan.method,
        precision=plan.precision,
        micro_batch_size=plan.micro_batch,
        gradient_accumulation_steps=plan.grad_accum,
        global_batch_size=plan.effective_batch,
        seq_len=plan.seq_len,
        optim=optim,
        optim_impl=plan.optimizer_impl,
        sgd_momentum=plan.sgd_momentum,
        gradient_checkpointing=plan.gradient_checkpointing,
        loss=plan.loss,
        r=plan.lora_r,
        lora_alpha=plan.lora_alpha,
        lora_dropout=plan.lora_dropout,
        target_modules=list(plan.lora_targets)
        + (["lm_head"] if plan.lora_on_head and "lm_head" not in plan.lora_targets else []),
        adapter_dtype=plan.adapter_dtype,
        load_in_4bit=quant in ("nf4", "fp4"),
        load_in_8bit=quant == "int8",
        bnb_4bit_quant_type=quant if quant in ("nf4", "fp4") else "nf4",
        bnb_4bit_use_double_quant=plan.double_quant,
        kbit_upcast=plan.kbit_upcast,
        optimizer_in_backward=plan.optimizer_in_backward,
        max_grad_norm=None if plan.optimizer_in_backward else default("max_grad_norm"),
        tiled_mlp=plan.tiled_mlp,
        offload_optimizer=plan.offload_optimizer,
        offload_activations=plan.offload_activations,
        offload_params=plan.offload_params,
        world_size=plan.world_size,
        strategy=plan.strategy,
        shard_group=plan.shard_group,
        reshard_after_forward=plan.reshard_after_forward,
        bucket_size=plan.bucket_size,
    )
    unknown = [k for k in extra if k not in {f.name for f in fields(TrainConfig)}]
    if unknown:
        raise BadInput(f"config_from_plan: unknown keys {', '.join(unknown)}")
    if "gpu_mem" in extra and isinstance(extra["gpu_mem"], str):
        extra["gpu_mem"] = parse_size(extra["gpu_mem"], what="gpu_mem")
    if "micro_batch_size" in extra or "gradient_accumulation_steps" in extra:
        cfg = replace(cfg, global_batch_size=None)
    return replace(cfg, **extra)


def _y(v: Any) -> str:
    """One YAML scalar / flow value."""
    import yaml

    if isinstance(v, list):
        return "[" + ", ".join(_y(x) for x in v) + "]"
    s = yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()
    if s.endswith("\n..."):
        s = s[: -len("\n...")]
    if s.endswith("..."):
        s = s[:-3].strip()
    return s


def _comment(key: Key) -> str:
    """The comment of a key: its memory note (its help when it has none, marked so in the memory groups), with
    the choices in front unless the text already names them."""
    if key.memory != NO_MEMORY:
        note = key.memory
    else:
        note = key.help + (" (no memory effect)" if key.group.startswith("memory") else "")
    if isinstance(key.kind, tuple) and not any(str(c) in note for c in key.kind[1]):
        return " | ".join(map(str, key.kind[1])) + ". " + note
    return note


def comment_lines(lines: list[str]) -> list[str]:
    """``lines`` as YAML comments (an empty line a bare ``#``)."""
    return [f"# {ln}" if ln else "#" for ln in lines]


def render_yaml(cfg: TrainConfig, header: str | None = None) -> str:
    """The config as YAML with every key commented with its effect (memory first), from ``schema``. Round-trips
    through :func:`oomdoctor.train.config.load_train_config`."""
    lines: list[str] = comment_lines(header.splitlines()) if header else []
    lines.append("# oomdoctor train config: run `oomdoctor train THIS.yaml` (--dry-run to check it fits first).")
    lines.append("# Keys follow Hugging Face TrainingArguments / peft LoraConfig / BitsAndBytesConfig names.")

    def section(name: str, obj: Any, keys: dict[str, Key]) -> None:
        lines.append(f"{name}:")
        for f in fields(obj):
            v = getattr(obj, f.name)
            if (
                v is None
                and keys[f.name].kind == "str|null"
                or v is None
                and f.name in ("pad_to_multiple_of", "max_samples")
            ):
                continue
            lines.append(f"  {f.name}: {_y(v)}  # {_comment(keys[f.name])}")

    section("model", cfg.model, MODEL)
    section("dataset", cfg.dataset, DATASET)
    for group in GROUPS:
        lines.append("")
        lines.append(f"# --- {group}" + (" (no memory effect)" if group == "schedule" else ""))
        for key in TOP_KEYS:
            if key.group != group:
                continue
            v = getattr(cfg, key.name)
            if key.name == "gpu_mem" and v is not None:
                lines.append(f"{key.name}: {v}B  # {format_bytes(v)}; {_comment(key)}")
                continue
            lines.append(f"{key.name}: {_y(v)}  # {_comment(key)}")
    return "\n".join(lines) + "\n"


__all__ = ["config_from_plan", "render_yaml"]
