"""The technique matrix: which plans ``diagnose`` prices (and ``tune`` searches), given what the user pinned.

Every flag the user gives pins that dimension; the matrix spans the rest over curated values (the stacks people
actually run: full fine-tune in fp32 / AMP / pure bf16, LoRA, QLoRA; +/- gradient checkpointing; leaner
optimizers; optimizer offload; with ``--gpus N`` > 1, the strategies DDP, FSDP, ZeRO-2, ZeRO-3). When every technique
is pinned there is exactly one plan. peft's k-bit upcast stays on (peft's recipe) unless pinned: ``--no-kbit-upcast``
shows the quantized plans without it (one QLoRA row per stack, not two; tune searches both, and diagnose's advice
proposes it when it is what makes a plan fit).
"""

from __future__ import annotations

from dataclasses import fields, replace
from itertools import product
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.plan import DEFAULT_LORA_TARGETS, Plan, validate

#: Dimensions the matrix spans, with the curated values used when a dimension is not pinned.
#: Precision per method: pure fp32 LoRA/QLoRA are rare (pin --precision fp32 to see them).
PRECISIONS_BY_METHOD: dict[str, tuple[str, ...]] = {
    "full": ("fp32", "bf16-mixed", "bf16"),
    "lora": ("bf16-mixed", "bf16"),
    "qlora": ("bf16-mixed", "bf16"),
}
#: Optimizers per method. For LoRA the optimizer state is tiny (2 x adapter params), so only the QLoRA paper's
#: paged 8-bit AdamW is shown next to AdamW; full fine-tuning is where leaner optimizers pay.
OPTIMIZERS_BY_METHOD: dict[str, tuple[str, ...]] = {
    "full": ("adamw", "adamw-8bit", "adafactor", "lion", "sgd"),
    "lora": ("adamw", "paged-adamw-8bit"),
    "qlora": ("adamw", "paged-adamw-8bit"),
}
#: Quantization variants of the QLoRA base when not pinned: (quant, double_quant).
QUANT_VARIANTS: tuple[tuple[str, bool], ...] = (("nf4", True), ("int8", False))
#: Offload variants for full fine-tuning when not pinned (optimizer state to CPU, DeepSpeed/FSDP style).
OFFLOAD_OPTIMIZERS: tuple[str, ...] = ("adamw",)

LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_on_head", "adapter_dtype")
QUANT_FIELDS = ("quant", "double_quant")
OFFLOAD_FIELDS = ("offload_optimizer", "offload_activations", "offload_params")
#: Strategies spanned for more than one GPU when ``--strategy`` is not pinned: torch DDP and FSDP2, DeepSpeed
#: ZeRO-2 and ZeRO-3 (each priced per rank, ``oomdoctor.memory.sharding``).
MULTI_GPU_STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "zero2", "zero3")


def _strategies(pins: dict[str, Any]) -> tuple[str, ...]:
    if "strategy" in pins or pins.get("world_size", 1) <= 1:
        return (pins.get("strategy", Plan().strategy),)
    return MULTI_GPU_STRATEGIES


def _pinned_methods(pins: dict[str, Any]) -> tuple[str, ...]:
    if "method" in pins:
        return (pins["method"],)
    if any(k in pins for k in QUANT_FIELDS) or pins.get("kbit_upcast") is False:
        return ("qlora",)
    if any(k in pins for k in LORA_FIELDS):
        return ("lora", "qlora")
    return ("full", "lora", "qlora")


def enumerate_plans(pins: dict[str, Any] | None = None, base: Plan | None = None) -> list[Plan]:
    """All plans of the matrix, in display order (full, LoRA, QLoRA; most faithful first).

    ``pins`` maps Plan field names to the values the user gave; ``base`` supplies non-technique defaults
    (micro_batch, seq_len, LoRA rank...). Raises BadInput when the pinned combination is impossible.
    """
    pins = dict(pins or {})
    unknown = set(pins) - {f.name for f in fields(Plan)}
    if unknown:
        raise BadInput(f"unknown plan setting(s): {', '.join(sorted(unknown))}")
    base = replace(base or Plan(), **{k: v for k, v in pins.items()})
    plans: list[Plan] = []
    seen: set[Plan] = set()
    first_error: BadInput | None = None
    for method in _pinned_methods(pins):
        precisions = (pins["precision"],) if "precision" in pins else PRECISIONS_BY_METHOD[method]
        optimizers = (pins["optimizer"],) if "optimizer" in pins else OPTIMIZERS_BY_METHOD[method]
        gcs = (pins["gradient_checkpointing"],) if "gradient_checkpointing" in pins else (False, True)
        if method == "qlora" and not any(k in pins for k in QUANT_FIELDS):
            quants = QUANT_VARIANTS
        elif method == "qlora" or "quant" in pins:
            quants = ((pins.get("quant", base.quant or "nf4"), pins.get("double_quant", base.double_quant)),)
        else:
            quants = ((None, False),)
        pinned_offload = any(k in pins for k in OFFLOAD_FIELDS)
        for precision, gc, (quant, dq), optimizer, strategy in product(
            precisions, gcs, quants, optimizers, _strategies(pins)
        ):
            offloads = [False]
            # Offload is spanned only when neither it nor the optimizer is pinned, so that pinning every flag of
            # the documented interface leaves exactly one plan.
            if method == "full" and not pinned_offload and "optimizer" not in pins and optimizer in OFFLOAD_OPTIMIZERS:
                offloads.append(True)
            if strategy == "ddp":
                offloads = [False]  # DDP has no optimizer offload; ZeRO's is spanned with zero2/zero3
            for off in offloads:
                changes: dict[str, Any] = dict(
                    method=method,
                    precision=precision,
                    optimizer=optimizer,
                    gradient_checkpointing=gc,
                    quant=quant,
                    double_quant=dq,
                    strategy=strategy,
                )
                if not pinned_offload:
                    changes["offload_optimizer"] = off
                if method == "full":
                    changes.update(
                        lora_targets=DEFAULT_LORA_TARGETS if "lora_targets" not in pins else base.lora_targets
                    )
                try:
                    plan = validate(replace(base, **changes))
                except BadInput as exc:
                    first_error = first_error or exc
                    continue
                if plan not in seen:
                    seen.add(plan)
                    plans.append(plan)
    if not plans:
        raise first_error or BadInput("no plan matches the given flags")
    return plans
