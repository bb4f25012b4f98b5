"""The training plan: every memory knob of one fine-tuning run, as a typed, validated dataclass.

A plan is what ``diagnose`` prices, what ``tune`` searches over and what ``train`` executes. It already carries
``world_size`` and ``sharding`` so that scale-out (DDP, FSDP, ZeRO through accelerate/torchrun) slots in without
changing the data path; today only ``world_size=1, sharding="none"`` is executed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

from oomdoctor.errors import BadInput

Method = Literal["full", "lora", "qlora"]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16"]
Optimizer = Literal["adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "adafactor", "sgd", "lion"]
Attn = Literal["eager", "sdpa", "flash"]
Quant = Literal["int8", "nf4", "fp4"]
OptimizerImpl = Literal["foreach", "fused", "for-loop"]
Sharding = Literal["none", "ddp", "fsdp", "zero2", "zero3"]

METHODS: tuple[str, ...] = ("full", "lora", "qlora")
PRECISIONS: tuple[str, ...] = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "adafactor", "sgd", "lion")
ATTNS: tuple[str, ...] = ("eager", "sdpa", "flash")
QUANTS: tuple[str, ...] = ("int8", "nf4", "fp4")
OPTIMIZER_IMPLS: tuple[str, ...] = ("foreach", "fused", "for-loop")
SHARDINGS: tuple[str, ...] = ("none", "ddp", "fsdp", "zero2", "zero3")

#: HF ``TrainingArguments.optim`` names for each optimizer (what ``train`` configs and emitted YAML use).
HF_OPTIM_NAMES: dict[str, str] = {
    "adamw": "adamw_torch",
    "adamw-8bit": "adamw_bnb_8bit",
    "paged-adamw": "paged_adamw_32bit",
    "paged-adamw-8bit": "paged_adamw_8bit",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "lion": "lion_32bit",
}

DEFAULT_LORA_TARGETS: tuple[str, ...] = ("all-linear",)


@dataclass(frozen=True)
class Plan:
    """One training plan. Sizes are per device; ``micro_batch * grad_accum`` is the effective batch per device."""

    method: Method = "full"
    """``full``: every weight trains. ``lora``: Low-Rank Adaptation (peft) adapters train, the base is frozen.
    ``qlora``: LoRA on a bitsandbytes-quantized frozen base (``quant``, default nf4)."""
    precision: Precision = "bf16-mixed"
    """``fp32``; ``fp16-mixed``/``bf16-mixed``: fp32 weights under autocast (the fp32 weights are the master copy);
    ``bf16``: pure bf16 weights, gradients and optimizer states (no fp32 master copy)."""
    optimizer: Optimizer = "adamw"
    """AdamW keeps exactly Adam's two states (exp_avg, exp_avg_sq): decoupled weight decay costs no memory.
    Leaner: 8-bit / paged AdamW (bitsandbytes), Adafactor (factored second moment), SGD, Lion (one state)."""
    optimizer_impl: OptimizerImpl = "foreach"
    """torch optimizers' implementation: ``foreach`` (the CUDA default; temporaries the size of a parameter group)
    or ``fused`` (one kernel, no group-sized temporaries). Ignored by bitsandbytes and Adafactor."""
    sgd_momentum: float = 0.0
    """SGD momentum; > 0 keeps one momentum buffer per trainable parameter."""
    attn: Attn = "sdpa"
    """Attention implementation: ``eager`` materializes the seq x seq score and probability matrices;
    ``sdpa`` / ``flash`` (memory-efficient kernels) do not."""
    gradient_checkpointing: bool = False
    """Keep only each layer's input in forward and recompute the rest in backward: the biggest activation saver,
    at about one third more compute."""
    lora_r: int = 16
    """LoRA rank: each adapted linear (in, out) adds r*(in+out) trainable parameters."""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r); no memory effect."""
    lora_dropout: float = 0.05
    """Dropout on the adapter input; > 0 saves one dropout mask/copy of the input per adapted module."""
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """Module names to adapt (``q_proj``, ``v_proj``...) or ``all-linear`` (every linear but the output head)."""
    lora_on_head: bool = False
    """Also adapt the output head (``lm_head``)."""
    quant: Quant | None = None
    """bitsandbytes quantization of the frozen base: ``int8`` (LLM.int8()), ``nf4`` or ``fp4`` (4-bit, QLoRA)."""
    double_quant: bool = False
    """QLoRA double quantization: quantize the 4-bit absmax constants again (saves ~0.37 bit per parameter)."""
    micro_batch: int = 1
    """Sequences per forward/backward pass (per device)."""
    seq_len: int = 2048
    """Tokens per sequence (the longest batch decides the peak)."""
    grad_accum: int = 1
    """Gradient accumulation steps: micro-batches summed before one optimizer step. No memory cost beyond the
    gradients that exist anyway; effective batch = micro_batch * grad_accum * world_size."""
    offload_optimizer: bool = False
    """Optimizer states (and the step) live on the CPU; the GPU keeps weights, gradients and activations."""
    offload_activations: bool = False
    """Tensors saved for backward are moved to pinned CPU memory (torch.autograd.graph.save_on_cpu)."""
    offload_params: bool = False
    """Frozen/base weights live on the CPU and are streamed in per layer (accelerate/DeepSpeed style)."""
    world_size: int = 1
    """Number of data-parallel processes (accelerate / torchrun). Only 1 is executed today."""
    sharding: Sharding = "none"
    """Sharding strategy for world_size > 1: DDP (none), FSDP, ZeRO-2/3 via accelerate/DeepSpeed."""

    # ------------------------------------------------------------------ derived views
    @property
    def uses_lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def weight_dtype_bytes(self) -> int:
        """Bytes per element of the (unquantized) stored weights."""
        return 2 if self.precision == "bf16" else 4

    @property
    def compute_dtype(self) -> str:
        """dtype that matmuls run in."""
        return {"fp32": "float32", "fp16-mixed": "float16", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}[
            self.precision
        ]

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def optimizer_is_paged(self) -> bool:
        return self.optimizer.startswith("paged")

    def label(self) -> str:
        """Short human label, e.g. ``qlora-nf4 r16 | bf16-mixed | GC | paged-adamw-8bit``."""
        parts = []
        if self.method == "full":
            parts.append("full")
        else:
            tgt = "all" if self.lora_targets == DEFAULT_LORA_TARGETS else ",".join(self.lora_targets)
            m = "lora" if self.method == "lora" else f"qlora-{self.quant}{'+dq' if self.double_quant else ''}"
            parts.append(f"{m} r{self.lora_r}:{tgt}{'+head' if self.lora_on_head else ''}")
        parts.append(self.precision)
        parts.append(self.optimizer + ("" if self.optimizer_impl == "foreach" or self.optimizer.startswith(("adamw-8", "paged", "adafactor")) else f"({self.optimizer_impl})"))
        if self.gradient_checkpointing:
            parts.append("GC")
        offl = [n for n, on in (("opt", self.offload_optimizer), ("act", self.offload_activations), ("params", self.offload_params)) if on]
        if offl:
            parts.append("offload:" + "+".join(offl))
        if self.attn != "sdpa":
            parts.append(self.attn)
        return " | ".join(parts)

    def settings(self) -> dict:
        """JSON-friendly settings (the ``settings`` object of diagnose/tune JSON)."""
        d = asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        d["micro_batch_size"] = self.micro_batch
        d["gradient_accumulation_steps"] = self.grad_accum
        d["effective_batch_size"] = self.effective_batch
        return d

    def with_(self, **changes) -> "Plan":
        """A copy with ``changes`` applied and the result validated."""
        return validate(replace(self, **changes))


def _check_choice(problems: list[str], name: str, value, choices) -> None:
    if value not in choices:
        problems.append(f"{name}={value!r} is not one of {', '.join(map(str, choices))}")


def validate(plan: Plan) -> Plan:
    """Normalize and check a plan; returns the normalized plan or raises BadInput listing every problem.

    Normalizations: ``qlora`` without ``quant`` means nf4; ``lora`` with ``quant`` is QLoRA; ``double_quant``
    only applies to 4-bit. Impossible combinations are errors (a quantized base cannot be fully fine-tuned:
    bitsandbytes int8/4-bit weights are frozen storage, not trainable parameters).
    """
    problems: list[str] = []
    _check_choice(problems, "method", plan.method, METHODS)
    _check_choice(problems, "precision", plan.precision, PRECISIONS)
    _check_choice(problems, "optimizer", plan.optimizer, OPTIMIZERS)
    _check_choice(problems, "optimizer_impl", plan.optimizer_impl, OPTIMIZER_IMPLS)
    _check_choice(problems, "attn", plan.attn, ATTNS)
    _check_choice(problems, "sharding", plan.sharding, SHARDINGS)
    if plan.quant is not None:
        _check_choice(problems, "quant", plan.quant, QUANTS)
    changes: dict = {}
    if plan.method == "full" and plan.quant is not None:
        problems.append(
            f"--quant {plan.quant} cannot be combined with --method full: bitsandbytes-quantized weights are frozen; "
            "train adapters on them with --method qlora (QLoRA)"
        )
    if plan.method == "lora" and plan.quant is not None:
        changes["method"] = "qlora"
    if plan.method == "qlora" and plan.quant is None:
        changes["quant"] = "nf4"
    quant = changes.get("quant", plan.quant)
    if plan.double_quant and quant not in ("nf4", "fp4"):
        if quant is None:
            problems.append("--double-quant needs a 4-bit base (--method qlora / --quant nf4|fp4)")
        else:
            problems.append("--double-quant applies to 4-bit (nf4/fp4) quantization only, not int8")
    if plan.precision == "fp32" and quant is not None:
        # bnb computes in the compute dtype; fp32 compute is allowed (bnb_4bit_compute_dtype=float32).
        pass
    for name in ("micro_batch", "seq_len", "grad_accum", "lora_r", "world_size"):
        v = getattr(plan, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"{name} must be a positive integer, got {v!r}")
    if plan.sgd_momentum < 0 or plan.sgd_momentum >= 1:
        problems.append(f"sgd_momentum must be in [0, 1), got {plan.sgd_momentum}")
    if not plan.lora_targets:
        problems.append("lora_targets is empty; name modules (q_proj,v_proj) or use all-linear")
    if plan.world_size == 1 and plan.sharding not in ("none", "ddp"):
        problems.append(f"sharding={plan.sharding} needs world_size > 1")
    if plan.world_size > 1:
        problems.append("world_size > 1 (DDP/FSDP/ZeRO) is not supported yet; plan for one GPU")
    if plan.offload_params and plan.method != "full" and quant is not None:
        problems.append("offload_params with a bitsandbytes-quantized base is not supported by bitsandbytes")
    if problems:
        if len(problems) == 1:
            raise BadInput(problems[0], "run `oomdoctor diagnose --help` for the accepted values")
        raise BadInput("invalid plan:\n" + "\n".join(f"  - {p}" for p in problems), "run `oomdoctor diagnose --help`")
    return replace(plan, **changes) if changes else plan


def plan_field_names() -> list[str]:
    return [f.name for f in fields(Plan)]


__all__ = ["Plan", "validate", "HF_OPTIM_NAMES", "plan_field_names"] + [
    n for n in ("METHODS", "PRECISIONS", "OPTIMIZERS", "ATTNS", "QUANTS", "OPTIMIZER_IMPLS", "SHARDINGS")
]

