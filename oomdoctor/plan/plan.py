"""The training plan: every memory knob of one fine-tuning run, as a typed, validated dataclass.

A plan is what ``diagnose`` prices, what ``tune`` searches over and what ``train`` executes. It carries the topology
(``world_size`` ranks, the ``strategy`` that shares the work among them, FSDP's ``shard_group`` and
``reshard_after_forward``, the communication ``bucket_size``): sizes are per rank (per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from oomdoctor.errors import BadInput
from oomdoctor.plan.techniques import DEFAULTS, EFFECTIVE_BATCH, PAGED_OPTIMIZERS, TECHNIQUES, TORCH_OPTIMIZERS, choices

Method = Literal["full", "lora", "qlora"]
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16"]
Optimizer = Literal["adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "adafactor", "sgd", "lion"]
Attn = Literal["eager", "sdpa", "flash"]
Quant = Literal["int8", "nf4", "fp4"]
OptimizerImpl = Literal["foreach", "fused", "for-loop"]
Strategy = Literal["single", "ddp", "fsdp", "zero2", "zero3"]
Loss = Literal["standard", "chunked"]
AdapterDtype = Literal["fp32", "bf16"]
Trainer = Literal["oomdoctor", "trl", "hf", "axolotl", "accelerate"]

METHODS: tuple[str, ...] = choices("method")
PRECISIONS: tuple[str, ...] = choices("precision")
OPTIMIZERS: tuple[str, ...] = choices("optimizer")
ATTNS: tuple[str, ...] = choices("attn")
QUANTS: tuple[str, ...] = choices("quant")
OPTIMIZER_IMPLS: tuple[str, ...] = choices("optimizer_impl")
STRATEGIES: tuple[str, ...] = choices("strategy")
#: Strategies that shard model states across the ranks.
SHARDED: tuple[str, ...] = ("fsdp", "zero2", "zero3")
#: Strategies DeepSpeed runs.
DEEPSPEED: tuple[str, ...] = ("zero2", "zero3")
LOSSES: tuple[str, ...] = choices("loss")
ADAPTER_DTYPES: tuple[str, ...] = choices("adapter_dtype")
TRAINERS: tuple[str, ...] = choices("trainer")

DEFAULT_LORA_TARGETS: tuple[str, ...] = DEFAULTS["lora_targets"]
#: Every dtype a plan or a train YAML names (``compute_dtype``, ``bnb_4bit_compute_dtype``), as torch attribute names.
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: The dtype matmuls run in under each precision (one of :data:`DTYPE_NAMES`).
COMPUTE_DTYPES: dict[str, str] = {
    "fp32": "float32",
    "fp16-mixed": "float16",
    "bf16-mixed": "bfloat16",
    "bf16": "bfloat16",
}


@dataclass(frozen=True)
class Plan:
    """One training plan. Sizes are per device; ``micro_batch * grad_accum`` is the effective batch per device.

    Every field is a knob of :data:`oomdoctor.plan.techniques.TECHNIQUES` (same name, in the same order): its help,
    default (and where the default comes from), the Hugging Face names a train YAML accepts for it and its memory
    note live there, once.
    """

    method: Method = DEFAULTS["method"]
    """See ``TECHNIQUES``: full | lora | qlora."""
    precision: Precision = DEFAULTS["precision"]
    """See ``TECHNIQUES``: fp32 | fp16-mixed | bf16-mixed | bf16."""
    optimizer: Optimizer = DEFAULTS["optimizer"]
    """See ``TECHNIQUES``: the optimizer (HF ``optim`` names in ``techniques.OPTIMIZERS``)."""
    optimizer_impl: OptimizerImpl = DEFAULTS["optimizer_impl"]
    """See ``TECHNIQUES``: torch optimizer kernel."""
    sgd_momentum: float = DEFAULTS["sgd_momentum"]
    """See ``TECHNIQUES``: SGD momentum."""
    attn: Attn = DEFAULTS["attn"]
    """See ``TECHNIQUES``: attention kernel."""
    gradient_checkpointing: bool = DEFAULTS["gradient_checkpointing"]
    """See ``TECHNIQUES``: recompute activations in backward."""
    loss: Loss = DEFAULTS["loss"]
    """See ``TECHNIQUES``: standard | chunked cross-entropy."""
    tiled_mlp: bool = DEFAULTS["tiled_mlp"]
    """See ``TECHNIQUES``: MLP over token tiles, each recomputed in backward."""
    lora_r: int = DEFAULTS["lora_r"]
    """See ``TECHNIQUES``: LoRA rank."""
    lora_alpha: int = DEFAULTS["lora_alpha"]
    """See ``TECHNIQUES``: LoRA scale numerator."""
    lora_dropout: float = DEFAULTS["lora_dropout"]
    """See ``TECHNIQUES``: dropout on the adapter input."""
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """See ``TECHNIQUES``: modules that get adapters."""
    lora_on_head: bool = DEFAULTS["lora_on_head"]
    """See ``TECHNIQUES``: also adapt the output head."""
    adapter_dtype: AdapterDtype = DEFAULTS["adapter_dtype"]
    """See ``TECHNIQUES``: dtype of the LoRA adapter weights."""
    quant: Quant | None = DEFAULTS["quant"]
    """See ``TECHNIQUES``: bitsandbytes quantization of the frozen base."""
    double_quant: bool = DEFAULTS["double_quant"]
    """See ``TECHNIQUES``: QLoRA double quantization."""
    kbit_upcast: bool = DEFAULTS["kbit_upcast"]
    """See ``TECHNIQUES``: a quantized base's unquantized weights cast to fp32 (peft's k-bit preparation)."""
    micro_batch: int = DEFAULTS["micro_batch"]
    """See ``TECHNIQUES``: sequences per forward/backward."""
    seq_len: int = DEFAULTS["seq_len"]
    """See ``TECHNIQUES``: tokens per sequence."""
    grad_accum: int = DEFAULTS["grad_accum"]
    """See ``TECHNIQUES``: gradient accumulation steps."""
    optimizer_in_backward: bool = DEFAULTS["optimizer_in_backward"]
    """See ``TECHNIQUES``: per-parameter optimizer steps inside backward."""
    offload_optimizer: bool = DEFAULTS["offload_optimizer"]
    """See ``TECHNIQUES``: optimizer states on the CPU."""
    offload_activations: bool = DEFAULTS["offload_activations"]
    """See ``TECHNIQUES``: saved activations on the CPU."""
    offload_params: bool = DEFAULTS["offload_params"]
    """See ``TECHNIQUES``: frozen weights on the CPU."""
    world_size: int = DEFAULTS["world_size"]
    """See ``TECHNIQUES``: data-parallel ranks (GPUs)."""
    strategy: Strategy = DEFAULTS["strategy"]
    """See ``TECHNIQUES``: single | ddp | fsdp | zero2 | zero3."""
    shard_group: int | None = DEFAULTS["shard_group"]
    """See ``TECHNIQUES``: FSDP shard-group size (None: every rank; fewer than world_size: HSDP)."""
    reshard_after_forward: bool = DEFAULTS["reshard_after_forward"]
    """See ``TECHNIQUES``: FSDP frees gathered weights after each layer's forward."""
    bucket_size: int | None = DEFAULTS["bucket_size"]
    """See ``TECHNIQUES``: elements per communication bucket (None: the engine default)."""
    trainer: Trainer = DEFAULTS["trainer"]
    """See ``TECHNIQUES``: the code that runs the step (oomdoctor, trl, hf, axolotl, accelerate)."""

    # ------------------------------------------------------------------ derived views
    @property
    def uses_lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def shards(self) -> int:
        """Ranks one copy of the sharded states is divided over (1 when nothing is sharded)."""
        if self.strategy not in SHARDED:
            return 1
        return self.shard_group or self.world_size

    def bucket_elems(self, hidden_size: int) -> int:
        """Elements per DeepSpeed reduce / all-gather bucket: ``bucket_size``, or hidden² (Hugging Face's ``auto``
        for ``reduce_bucket_size``; DeepSpeed's own 5e8 costs ~1 GB bf16 per rank, multi-gpu.md §3). What the
        memory model prices, ``train`` runs and ``tune --emit`` writes."""
        return self.bucket_size or hidden_size**2

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
        return COMPUTE_DTYPES[self.precision]

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def optimizer_is_paged(self) -> bool:
        return self.optimizer in PAGED_OPTIMIZERS

    @property
    def upcasts_kbit(self) -> bool:
        """Whether peft's k-bit preparation casts the unquantized weights of a quantized base to fp32 (it changes
        bytes only where they load in 16 bits: pure bf16)."""
        return self.quant is not None and self.kbit_upcast

    def label(self) -> str:
        """Short human label, e.g. ``qlora-nf4 r16 | bf16-mixed | GC | paged-adamw-8bit``."""
        parts = []
        if self.method == "full":
            parts.append("full")
        else:
            tgt = "all" if self.lora_targets == DEFAULT_LORA_TARGETS else ",".join(self.lora_targets)
            m = "lora" if self.method == "lora" else f"qlora-{self.quant}{'+dq' if self.double_quant else ''}"
            parts.append(
                f"{m} r{self.lora_r}:{tgt}{'+head' if self.lora_on_head else ''}"
                + (f" {self.adapter_dtype}-adapters" if self.adapter_dtype != DEFAULTS["adapter_dtype"] else "")
                + (" no-upcast" if self.quant is not None and not self.kbit_upcast else "")
            )
        parts.append(self.precision)
        shows_impl = self.optimizer in TORCH_OPTIMIZERS and self.optimizer_impl != DEFAULTS["optimizer_impl"]
        parts.append(self.optimizer + (f"({self.optimizer_impl})" if shows_impl else ""))
        if self.gradient_checkpointing:
            parts.append("GC")
        if self.optimizer_in_backward:
            parts.append("opt-in-bwd")
        if self.loss == "chunked":
            parts.append("chunked-CE")
        if self.tiled_mlp:
            parts.append("tiled-MLP")
        offl = [
            n
            for n, on in (
                ("opt", self.offload_optimizer),
                ("act", self.offload_activations),
                ("params", self.offload_params),
            )
            if on
        ]
        if offl:
            parts.append("offload:" + "+".join(offl))
        if self.attn != "sdpa":
            parts.append(self.attn)
        if self.strategy != "single":
            topo = f"{self.strategy}({self.world_size})"
            if self.shard_group and self.shard_group < self.world_size:
                topo += f" hsdp {self.world_size // self.shard_group}x{self.shard_group}"
            if not self.reshard_after_forward:
                topo += " keep-gathered"
            parts.append(topo)
        if self.trainer != DEFAULTS["trainer"]:
            parts.append(f"@{self.trainer}")
        return " | ".join(parts)

    def settings(self) -> dict:
        """JSON-friendly settings (the ``settings`` object of diagnose/tune JSON): one key per knob of the technique
        table, plus the derived ``effective_batch_size``. Every key is also a top-level key of a train YAML with the
        same meaning, so the object can be pasted into one (with ``model:`` and ``dataset:``)."""
        d = {}
        for t in TECHNIQUES:
            v = getattr(self, t.name)
            d[t.setting] = list(v) if isinstance(v, tuple) else v
        d[EFFECTIVE_BATCH] = self.effective_batch
        return d

    def with_(self, **changes) -> "Plan":
        """A copy with ``changes`` applied and the result validated."""
        return validate(replace(self, **changes))


def _check_choice(problems: list[str], name: str, value, choices) -> None:
    if value not in choices:
        problems.append(f"{name}={value!r} is not one of {', '.join(map(str, choices))}")


def _check_topology(plan: Plan, problems: list[str], changes: dict) -> None:
    """world_size / strategy / shard_group / reshard_after_forward / bucket_size / offload, as the engines run them.

    Normalizations: more than one rank with ``single`` is ``ddp`` (what torchrun + HF Trainer do); ``ddp`` on one
    rank is ``single``; ``offload_params`` on one GPU runs as FSDP2 with ``CPUOffloadPolicy`` (``fsdp`` at world
    size 1), which offloads the optimizer states too; ``shard_group == world_size`` is no HSDP.
    """
    ws = plan.world_size
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        return  # reported with the other positive integers
    strategy = plan.strategy
    if strategy == "single" and ws > 1:
        strategy = "ddp"
    elif strategy == "ddp" and ws == 1:
        strategy = "single"
    if plan.offload_params:
        if strategy == "single":
            strategy = "fsdp"
        if strategy not in ("fsdp", "zero3"):
            problems.append(
                f"offload_params needs strategy fsdp (FSDP2 CPUOffloadPolicy) or zero3 (ZeRO-3 "
                f"offload_param), not {strategy}"
            )
        if strategy == "fsdp" and not plan.offload_optimizer:
            changes["offload_optimizer"] = True
    elif plan.offload_optimizer and strategy == "fsdp":
        problems.append(
            "FSDP2 offloads parameters, gradients and optimizer states together (CPUOffloadPolicy): "
            "set offload_params too, or use zero2/zero3 for optimizer-only offload"
        )
    if strategy != plan.strategy:
        changes["strategy"] = strategy
    sg = plan.shard_group
    if sg is not None:
        if strategy != "fsdp":
            problems.append(f"shard_group applies to strategy fsdp (HSDP), not {strategy}")
        elif not isinstance(sg, int) or isinstance(sg, bool) or sg < 1 or ws % sg:
            problems.append(f"shard_group must be a positive divisor of world_size {ws}, got {sg!r}")
        elif sg == ws:
            changes["shard_group"] = None
    if not plan.reshard_after_forward and strategy != "fsdp":
        problems.append(f"reshard_after_forward applies to strategy fsdp, not {strategy}")
    if plan.bucket_size is not None:
        if strategy not in DEEPSPEED:
            problems.append(
                f"bucket_size applies to zero2 and zero3, DeepSpeed's buckets (strategy {strategy} has no "
                "buckets to size: train sums DDP gradients once per step, FSDP has none)"
            )
        elif not isinstance(plan.bucket_size, int) or isinstance(plan.bucket_size, bool) or plan.bucket_size < 1:
            problems.append(f"bucket_size must be a positive number of elements, got {plan.bucket_size!r}")


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
    _check_choice(problems, "loss", plan.loss, LOSSES)
    _check_choice(problems, "adapter_dtype", plan.adapter_dtype, ADAPTER_DTYPES)
    _check_choice(problems, "attn", plan.attn, ATTNS)
    _check_choice(problems, "strategy", plan.strategy, STRATEGIES)
    _check_choice(problems, "trainer", plan.trainer, TRAINERS)
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
    if quant is None and not plan.kbit_upcast:
        changes["kbit_upcast"] = True  # nothing to prepare without a quantized base: one plan, not two
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
    if plan.adapter_dtype != DEFAULTS["adapter_dtype"] and plan.method == "full":
        problems.append(
            f"adapter_dtype {plan.adapter_dtype} applies to LoRA adapters (--method lora or qlora), "
            "not to a full fine-tune"
        )
    if plan.adapter_dtype == "bf16" and plan.precision == "fp16-mixed":
        problems.append(
            "adapter_dtype bf16 under fp16-mixed: autocast would cast the bf16 adapters to fp16 in every "
            "matmul; use bf16-mixed, or fp32 adapters"
        )
    _check_topology(plan, problems, changes)
    if plan.optimizer_in_backward:
        if plan.grad_accum > 1:
            problems.append(
                "optimizer_in_backward steps during backward: it cannot accumulate gradients "
                "(grad_accum must be 1; raise the micro-batch instead)"
            )
        if plan.offload_optimizer:
            problems.append("optimizer_in_backward and offload_optimizer: choose one")
        if plan.precision == "fp16-mixed":
            problems.append("optimizer_in_backward cannot run fp16's loss scaler (it unscales all gradients at once)")
        if changes.get("strategy", plan.strategy) != "single":
            problems.append(
                "optimizer_in_backward steps each parameter before its gradient is reduced across "
                "ranks: one GPU only (strategy single)"
            )
    if plan.tiled_mlp:
        if changes.get("strategy", plan.strategy) != "single":
            problems.append(
                "tiled_mlp accumulates each MLP gradient tile by tile, while DDP/FSDP/ZeRO reduce a "
                "gradient once: one GPU only (strategy single)"
            )
        if plan.optimizer_in_backward:
            problems.append(
                "tiled_mlp and optimizer_in_backward: the optimizer would step on the first tile's share "
                "of a gradient; choose one"
            )
    if plan.offload_params and plan.method != "full" and quant is not None:
        problems.append("offload_params with a bitsandbytes-quantized base is not supported by bitsandbytes")
    if problems:
        if len(problems) == 1:
            raise BadInput(problems[0], "run `oomdoctor diagnose --help` for the accepted values")
        raise BadInput("invalid plan:\n" + "\n".join(f"  - {p}" for p in problems), "run `oomdoctor diagnose --help`")
    return replace(plan, **changes) if changes else plan


__all__ = ["Plan", "validate", "DEFAULT_LORA_TARGETS"] + [
    n for n in ("METHODS", "PRECISIONS", "OPTIMIZERS", "ATTNS", "QUANTS", "OPTIMIZER_IMPLS", "STRATEGIES", "SHARDED")
]
