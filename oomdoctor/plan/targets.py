"""What each trainer can run: for every knob of the technique table, the key(s) that carry it in the trainer's own
config, or why the trainer cannot run that value.

One job, over 600 lines: the rule table (one :class:`Rule` per knob and trainer) and the few functions that read it.

Trainers (``Plan.trainer``, the ``tune --emit`` targets): ``oomdoctor`` (``oomdoctor train``), ``trl`` (TRL's
``SFTTrainer`` through ``trl sft --config``), ``hf`` (transformers' ``Trainer`` driven by the JSON ``tune --emit hf``
writes, ``python -m oomdoctor.execute.trainers.hf``), ``axolotl`` (``axolotl train``) and ``accelerate`` (the user's
``train.py`` under ``accelerate launch --config_file``).

One rule per (knob, trainer), :class:`Rule`: the document keys that carry the knob (dotted for nested keys, as in
``model_init_kwargs.dtype``), a sentence when no key does (``TRL's fused LM head: SFTTrainer's only loss``), and the
values the trainer cannot run (:attr:`Rule.refuse`). Besides the rules, a trainer may *fix* a knob — run it one way
whatever a config says (TRL casts a quantized model's adapters to bf16 and never calls peft's k-bit preparation):
:func:`fixed`. ``tune --emit X`` searches ``adapt(plan, X)`` for every enumerated plan and keeps those with no
:func:`refusals`; a knob the user pins that X fixes otherwise or refuses is an error naming it
(``oomdoctor.tune.tuner``). The header of an emitted file lists every knob of the plan with the key that carries it
(``oomdoctor.tune.emit``). The versions a trainer is priced for are :data:`PRICED_VERSIONS`; another installed version
is a note (:func:`version_notes`), not a silent guess.

Sources, at the versions priced: trl 1.16 ``trainer/sft_trainer.py`` (its fused LM head, the bf16 cast of a quantized
model's trainable parameters, no ``prepare_model_for_kbit_training``, the refusal of a PEFT adapter on ``lm_head``),
``trainer/utils.py`` (``get_quantization_config``: 4-bit layers compute in the model's ``dtype``); transformers 5.24
``trainer_optimizer.py`` (``optim`` names; ``adamw_torch`` is torch's default foreach kernel, ``adamw_torch_fused``
``fused=True``; SGD reads ``optim_args`` momentum), ``training_args.py``; axolotl 0.19 and liger-kernel 0.8 (read,
not installable here: axolotl pins older transformers/peft/trl).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.plan.plan import DEEPSPEED, SHARDED, Plan, validate
from oomdoctor.plan.techniques import TECHNIQUES, TORCH_OPTIMIZERS, TRAINERS

#: A trainer's config cannot run this value of the knob: why (None: it can).
Refuse = Callable[[Plan], "str | None"]


@dataclass(frozen=True)
class Rule:
    """How one trainer runs one knob."""

    keys: tuple[str, ...] = ()
    """The document keys that carry the knob (dotted: nested, ``fsdp_config.reshard_after_forward``); the header
    shows those present in the document with their values."""
    how: str = ""
    """How the trainer runs the knob when no key carries it, or what the keys mean there."""
    refuse: Refuse | None = None
    """Why the trainer cannot run the plan's value of this knob (None: it can)."""


@dataclass(frozen=True)
class Refusal:
    """A knob value a trainer cannot run."""

    knob: str
    value: Any
    why: str

    def __str__(self) -> str:
        return f"{self.knob} {_show(self.value)}: {self.why}"


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, tuple):
        return ",".join(v)
    return "none" if v is None else str(v)


def _when(test: Callable[[Plan], bool], why: str) -> Refuse:
    return lambda p: why if test(p) else None


#: Knobs that matter only for some plans (LoRA knobs without LoRA...): :func:`applies`.
_APPLIES: dict[str, Callable[[Plan], bool]] = {
    **{
        k: (lambda p: p.uses_lora)
        for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_on_head", "adapter_dtype")
    },
    "quant": lambda p: p.quant is not None,
    "double_quant": lambda p: p.quant in ("nf4", "fp4"),
    "kbit_upcast": lambda p: p.quant is not None,
    "optimizer_impl": lambda p: p.optimizer in TORCH_OPTIMIZERS,
    "sgd_momentum": lambda p: p.optimizer == "sgd",
    "shard_group": lambda p: p.strategy == "fsdp",
    "reshard_after_forward": lambda p: p.strategy == "fsdp",
    "bucket_size": lambda p: p.strategy in DEEPSPEED,
    "trainer": lambda p: False,
}


def applies(knob: str, plan: Plan) -> bool:
    """Whether ``knob`` means anything for ``plan`` (the header lists only those)."""
    return _APPLIES.get(knob, lambda p: True)(plan)


# ---------------------------------------------------------------------------------------------- shared refusals

_NO_OIB = _when(
    lambda p: p.optimizer_in_backward,
    "no optimizer-in-backward in transformers' Trainer (it steps after backward, with clipping)",
)
_NO_TILED = _when(lambda p: p.tiled_mlp, "no tiled MLP in transformers' Trainer (axolotl's tiled_mlp has one)")


def _hf_optim_impl(p: Plan) -> str | None:
    """transformers' ``optim`` names: AdamW fused (``adamw_torch_fused``) or foreach (``adamw_torch``); SGD is torch's
    default (foreach) kernel."""
    if p.optimizer == "adamw" and p.optimizer_impl == "for-loop":
        return "HF optim names run AdamW fused (adamw_torch_fused) or foreach (adamw_torch), not a for-loop"
    if p.optimizer == "sgd" and p.optimizer_impl != "foreach":
        return "HF's sgd optim runs torch's default (foreach) kernel"
    return None


_NO_HSDP = _when(
    lambda p: p.shard_group is not None,
    "TrainingArguments' fsdp_config has no shard group (HSDP); `--emit accelerate` writes one",
)
_SINGLE_OFFLOAD = (
    "TrainingArguments offloads only through DeepSpeed or FSDP: plan it with --strategy zero2/zero3 "
    "(DeepSpeed ZeRO-Offload, priced as such) or fsdp"
)
_NO_SINGLE_OPT_OFFLOAD = _when(lambda p: p.offload_optimizer and p.strategy not in SHARDED, _SINGLE_OFFLOAD)
_NO_SINGLE_PARAM_OFFLOAD = _when(lambda p: p.offload_params and p.strategy not in SHARDED, _SINGLE_OFFLOAD)


def _first(*refusers: Refuse) -> Refuse:
    def refuse(p: Plan) -> str | None:
        return next((why for r in refusers if (why := r(p))), None)

    return refuse


# ---------------------------------------------------------------------------------------------- the table

_TRAINING_ARGS_TOPOLOGY: dict[str, Rule] = {
    "world_size": Rule(how="torchrun --nproc-per-node (per_device_train_batch_size is per GPU)"),
    "strategy": Rule(
        ("fsdp", "fsdp_config.version", "deepspeed.zero_optimization.stage"),
        "ddp: torchrun alone (Trainer wraps the model in DDP)",
    ),
    "shard_group": Rule(refuse=_NO_HSDP),
    "reshard_after_forward": Rule(("fsdp_config.reshard_after_forward",)),
    "bucket_size": Rule(
        ("deepspeed.zero_optimization.reduce_bucket_size", "deepspeed.zero_optimization.allgather_bucket_size")
    ),
    "offload_optimizer": Rule(
        ("fsdp_config.cpu_offload", "deepspeed.zero_optimization.offload_optimizer.device"),
        refuse=_NO_SINGLE_OPT_OFFLOAD,
    ),
    "offload_params": Rule(
        ("fsdp_config.cpu_offload", "deepspeed.zero_optimization.offload_param.device"), refuse=_NO_SINGLE_PARAM_OFFLOAD
    ),
}

_BATCH = {"micro_batch": Rule(("per_device_train_batch_size",)), "grad_accum": Rule(("gradient_accumulation_steps",))}

_TRL_QUANT_COMPUTE = (
    "with a 4-bit base: TRL computes 4-bit layers in the model's dtype (get_quantization_config) "
    "and a *-mixed plan loads float32, so its 4-bit matmuls would run in fp32 — use pure bf16"
)

TRL: dict[str, Rule] = {
    "method": Rule(("use_peft", "load_in_4bit", "load_in_8bit")),
    "precision": Rule(
        ("dtype", "bf16", "fp16"), refuse=_when(lambda p: p.quant in ("nf4", "fp4") and p.is_mixed, _TRL_QUANT_COMPUTE)
    ),
    "optimizer": Rule(("optim",)),
    "optimizer_impl": Rule(("optim",), refuse=_hf_optim_impl),
    "sgd_momentum": Rule(("optim_args",)),
    "attn": Rule(("attn_implementation",)),
    "gradient_checkpointing": Rule(("activation_checkpointing", "activation_checkpointing_kwargs.use_reentrant")),
    "loss": Rule(
        how="TRL's fused LM head (SFTTrainer's only loss: per-token log-probs, entropy and top-1 over "
        "vocabulary chunks; no full logits)",
        refuse=_when(
            lambda p: p.loss != "chunked",
            "SFTTrainer always computes the loss through its fused LM head (never the full logits)",
        ),
    ),
    "tiled_mlp": Rule(refuse=_NO_TILED),
    "lora_r": Rule(("lora_r",)),
    "lora_alpha": Rule(("lora_alpha",)),
    "lora_dropout": Rule(("lora_dropout",)),
    "lora_targets": Rule(("lora_target_modules",)),
    "lora_on_head": Rule(
        ("lora_target_modules",),
        refuse=_when(
            lambda p: p.lora_on_head,
            "SFTTrainer refuses a PEFT adapter on lm_head (its fused head reads lm_head.weight directly)",
        ),
    ),
    "adapter_dtype": Rule(
        how="SFTTrainer casts a quantized model's trainable parameters to bf16; peft keeps fp32 "
        "adapters on an unquantized base",
        refuse=_when(
            lambda p: p.adapter_dtype != ("bf16" if p.quant else "fp32"),
            "SFTTrainer casts a quantized model's adapters to bf16 and keeps fp32 ones on an unquantized base",
        ),
    ),
    "quant": Rule(("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type")),
    "double_quant": Rule(("use_bnb_nested_quant",)),
    "kbit_upcast": Rule(
        how="SFTTrainer never calls peft's prepare_model_for_kbit_training: the unquantized weights "
        "stay in the load dtype",
        refuse=_when(lambda p: p.upcasts_kbit, "SFTTrainer never calls peft's prepare_model_for_kbit_training"),
    ),
    "seq_len": Rule(
        ("max_length",), "padding to the longest sequence of each batch, truncated at max_length: priced at max_length"
    ),
    **_BATCH,
    "optimizer_in_backward": Rule(refuse=_NO_OIB),
    "offload_activations": Rule(
        ("activation_offloading",), "TRL's own activation offloading (torchtune's OffloadActivations)"
    ),
    **_TRAINING_ARGS_TOPOLOGY,
    "trainer": Rule(),
}

HF: dict[str, Rule] = {
    "method": Rule(("peft_config", "quantization_config")),
    "precision": Rule(("model_init_kwargs.dtype", "bf16", "fp16")),
    "optimizer": Rule(("optim",)),
    "optimizer_impl": Rule(("optim",), refuse=_hf_optim_impl),
    "sgd_momentum": Rule(("optim_args",)),
    "attn": Rule(("model_init_kwargs.attn_implementation",)),
    "gradient_checkpointing": Rule(("activation_checkpointing", "activation_checkpointing_kwargs.use_reentrant")),
    "loss": Rule(
        ("use_liger_kernel", "liger_kernel_config.fused_linear_cross_entropy"),
        "standard: transformers' loss over the full logits | chunked: Liger's fused linear cross-entropy "
        "alone (`pip install liger-kernel`, CUDA)",
    ),
    "tiled_mlp": Rule(refuse=_NO_TILED),
    "lora_r": Rule(("peft_config.r",)),
    "lora_alpha": Rule(("peft_config.lora_alpha",)),
    "lora_dropout": Rule(("peft_config.lora_dropout",)),
    "lora_targets": Rule(("peft_config.target_modules",)),
    "lora_on_head": Rule(("peft_config.target_modules",)),
    "adapter_dtype": Rule(
        ("adapter_dtype",), "bf16: the script casts the trainable parameters to bfloat16 after get_peft_model"
    ),
    "quant": Rule(
        (
            "quantization_config.load_in_4bit",
            "quantization_config.load_in_8bit",
            "quantization_config.bnb_4bit_quant_type",
        )
    ),
    "double_quant": Rule(("quantization_config.bnb_4bit_use_double_quant",)),
    "kbit_upcast": Rule(("prepare_model_for_kbit_training",)),
    "seq_len": Rule(("max_length",), "the script tokenizes to max_length (truncation)"),
    **_BATCH,
    "optimizer_in_backward": Rule(refuse=_NO_OIB),
    "offload_activations": Rule(
        refuse=_when(
            lambda p: p.offload_activations,
            "transformers' Trainer has no activation offloading (TRL's activation_offloading does: `--emit trl`)",
        )
    ),
    **_TRAINING_ARGS_TOPOLOGY,
    "trainer": Rule(),
}

ACCELERATE: dict[str, Rule] = {
    "method": Rule(how="train.py: peft.get_peft_model (LoRA) on a BitsAndBytesConfig-loaded base (QLoRA)"),
    "precision": Rule(("mixed_precision",), "train.py loads the weights in the plan's dtype"),
    "optimizer": Rule(how="train.py builds the optimizer (torch / bitsandbytes)"),
    "optimizer_impl": Rule(how="train.py: torch's fused= / foreach= argument"),
    "sgd_momentum": Rule(how="train.py: torch.optim.SGD(momentum=...)"),
    "attn": Rule(how="train.py: from_pretrained(attn_implementation=...)"),
    "gradient_checkpointing": Rule(
        how="train.py: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"
    ),
    "loss": Rule(
        how="standard: the model's own loss | chunked: train.py applies Liger's fused linear cross-entropy "
        "(liger_kernel.transformers.apply_liger_kernel_to_<model>)"
    ),
    "tiled_mlp": Rule(
        refuse=_when(lambda p: p.tiled_mlp, "no tiled MLP in a plain accelerate script (axolotl's tiled_mlp has one)")
    ),
    **{
        k: Rule(how="train.py: peft.LoraConfig")
        for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_on_head")
    },
    "adapter_dtype": Rule(how="train.py: bf16 adapters are a cast of the trainable parameters after get_peft_model"),
    "quant": Rule(how="train.py: BitsAndBytesConfig"),
    "double_quant": Rule(how="train.py: BitsAndBytesConfig(bnb_4bit_use_double_quant=...)"),
    "kbit_upcast": Rule(how="train.py: peft.prepare_model_for_kbit_training (on) or not (off)"),
    "seq_len": Rule(how="train.py tokenizes to max_length"),
    "micro_batch": Rule(how="train.py's DataLoader batch size (per GPU)"),
    "grad_accum": Rule(
        ("deepspeed_config.gradient_accumulation_steps",), "train.py: Accelerator(gradient_accumulation_steps=...)"
    ),
    "optimizer_in_backward": Rule(
        refuse=_when(lambda p: p.optimizer_in_backward, "no optimizer-in-backward in a plain accelerate script")
    ),
    "offload_activations": Rule(
        how="train.py runs forward and backward under torch.autograd.graph.save_on_cpu(pin_memory=True)"
    ),
    "offload_optimizer": Rule(
        ("deepspeed_config.offload_optimizer_device", "fsdp_config.fsdp_offload_params"),
        refuse=_when(
            lambda p: p.offload_optimizer and p.strategy not in SHARDED,
            "accelerate offloads through DeepSpeed or FSDP: plan it with --strategy "
            "zero2/zero3 (ZeRO-Offload, priced as such) or fsdp",
        ),
    ),
    "offload_params": Rule(
        ("deepspeed_config.offload_param_device", "fsdp_config.fsdp_offload_params"),
        refuse=_when(
            lambda p: p.offload_params and p.strategy not in SHARDED,
            "accelerate offloads parameters through DeepSpeed ZeRO-3 or FSDP",
        ),
    ),
    "world_size": Rule(("num_processes", "num_machines")),
    "strategy": Rule(("distributed_type", "deepspeed_config.zero_stage")),
    "shard_group": Rule(("parallelism_config.parallelism_config_dp_shard_size",)),
    "reshard_after_forward": Rule(("fsdp_config.fsdp_reshard_after_forward",)),
    "bucket_size": Rule(
        refuse=_when(
            lambda p: p.bucket_size is not None,
            "an accelerate launch config has no DeepSpeed bucket keys (accelerate fills "
            "'auto' with hidden^2, which is what an unset bucket_size prices)",
        )
    ),
    "trainer": Rule(),
}

#: Every trainer's rules. ``oomdoctor`` runs every knob under its own name (the train YAML key of the technique
#: table); axolotl's rules are in ``AXOLOTL`` below.
OOMDOCTOR: dict[str, Rule] = {t.name: Rule((t.key,) if t.key else ()) for t in TECHNIQUES}


# ---------------------------------------------------------------------------------------------- fixed knobs


def _trl_fixed(p: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {"loss": "chunked", "kbit_upcast": False}
    if p.uses_lora:
        out["adapter_dtype"] = "bf16" if p.quant else "fp32"
    if p.optimizer == "sgd":
        out["optimizer_impl"] = "foreach"
    return out


def _hf_fixed(p: Plan) -> dict[str, Any]:
    return {"optimizer_impl": "foreach"} if p.optimizer == "sgd" else {}


#: Knobs a trainer runs one way whatever its config says, as a function of the plan.
_FIXED: dict[str, Callable[[Plan], dict[str, Any]]] = {"trl": _trl_fixed, "hf": _hf_fixed}


# ---------------------------------------------------------------------------------------------- axolotl

_AXOLOTL_PRECISION = (
    "axolotl's bf16: true / fp16: true load the weights in that dtype: no fp32 master copy "
    "under autocast (plan pure bf16, or fp32)"
)


def _axolotl_precision(p: Plan) -> str | None:
    """axolotl 0.19 loads in its bf16/fp16 dtype (loaders/model.py) and, for a full fine-tune with sdpa/eager
    attention and no FSDP, moves the norms, embeddings and head to fp32 (``_configure_embedding_dtypes``: a mix a plan
    does not price); an 8-bit base without bf16 keeps fp16 weights."""
    if p.is_mixed:
        return _AXOLOTL_PRECISION
    if p.method == "full" and p.precision == "bf16" and p.attn != "flash" and p.strategy != "fsdp":
        return (
            "axolotl keeps embed_tokens, lm_head and the norms in fp32 for a full fine-tune with sdpa/eager "
            "attention (pure bf16 with flash attention, FSDP, or fp32 are priced)"
        )
    if p.quant == "int8" and p.precision == "fp32":
        return "axolotl loads an 8-bit base's other weights in float16 unless bf16: true (plan pure bf16)"
    return None


AXOLOTL: dict[str, Rule] = {
    "method": Rule(("adapter", "load_in_4bit", "load_in_8bit")),
    "precision": Rule(("bf16", "fp16"), refuse=_axolotl_precision),
    "optimizer": Rule(
        ("optimizer",),
        refuse=_when(
            lambda p: p.strategy == "fsdp" and p.optimizer == "adamw-8bit",
            "axolotl refuses bitsandbytes 8-bit AdamW under FSDP2",
        ),
    ),
    "optimizer_impl": Rule(("optimizer",), refuse=_hf_optim_impl),
    "sgd_momentum": Rule(("optim_args",)),
    "attn": Rule(("attn_implementation",)),
    "gradient_checkpointing": Rule(
        ("gradient_checkpointing", "gradient_checkpointing_kwargs.use_reentrant"),
        "use_reentrant written false (axolotl's default is true)",
    ),
    "loss": Rule(
        ("plugins", "liger_fused_linear_cross_entropy"),
        "standard: transformers' loss | chunked: the Liger plugin's fused linear cross-entropy alone "
        "(liger-kernel 0.8.1, Triton: a CUDA GPU)",
    ),
    "tiled_mlp": Rule(
        ("tiled_mlp", "tiled_mlp_num_shards"),
        "axolotl's TiledMLP (DeepSpeed's rule: ceil(tokens / hidden) shards; needs `pip install deepspeed`)",
    ),
    "lora_r": Rule(("lora_r",)),
    "lora_alpha": Rule(("lora_alpha",)),
    "lora_dropout": Rule(("lora_dropout",)),
    "lora_targets": Rule(
        ("lora_target_linear", "lora_target_modules"),
        "axolotl's fused LoRA kernels are written off (lora_*_kernel: false): peft's layers run",
    ),
    "lora_on_head": Rule(("lora_target_modules",)),
    "adapter_dtype": Rule(
        refuse=_when(lambda p: p.adapter_dtype != "fp32", "axolotl keeps peft's fp32 adapters (no key casts them)")
    ),
    "quant": Rule(("load_in_4bit", "load_in_8bit", "bnb_config_kwargs.bnb_4bit_quant_type")),
    "double_quant": Rule(("bnb_config_kwargs.bnb_4bit_use_double_quant",)),
    "kbit_upcast": Rule(
        how="axolotl runs peft's k-bit preparation, then casts the norms, embeddings and head back to "
        "the load dtype (no key)",
        refuse=_when(lambda p: p.upcasts_kbit, "axolotl casts the upcast weights back to the load dtype"),
    ),
    "seq_len": Rule(
        ("sequence_len", "pad_to_sequence_len"),
        "every batch padded to sequence_len, a multiple of 64",
        refuse=_when(lambda p: p.seq_len % 64, "axolotl pads a batch to a multiple of 64 tokens"),
    ),
    "micro_batch": Rule(("micro_batch_size",)),
    "grad_accum": Rule(("gradient_accumulation_steps",)),
    "optimizer_in_backward": Rule(
        refuse=_when(lambda p: p.optimizer_in_backward, "no optimizer-in-backward in axolotl")
    ),
    "offload_activations": Rule(
        ("activation_offloading",),
        "TRL's OffloadActivations under the checkpointed layers",
        refuse=_when(
            lambda p: p.offload_activations and not p.gradient_checkpointing,
            "axolotl's activation_offloading requires gradient_checkpointing",
        ),
    ),
    "offload_optimizer": Rule(
        ("fsdp_config.offload_params", "deepspeed.zero_optimization.offload_optimizer.device"),
        refuse=_NO_SINGLE_OPT_OFFLOAD,
    ),
    "offload_params": Rule(
        ("fsdp_config.offload_params", "deepspeed.zero_optimization.offload_param.device"),
        refuse=_NO_SINGLE_PARAM_OFFLOAD,
    ),
    "world_size": Rule(how="axolotl train FILE -- --num_processes N (accelerate launch; micro_batch_size per GPU)"),
    "strategy": Rule(("fsdp_version", "deepspeed.zero_optimization.stage"), "ddp: the launch alone"),
    "shard_group": Rule(
        refuse=_when(
            lambda p: p.shard_group is not None,
            "not written for axolotl (its dp_shard_size/dp_replicate_size are untested "
            "here); `--emit accelerate` writes HSDP",
        )
    ),
    "reshard_after_forward": Rule(("fsdp_config.reshard_after_forward",)),
    "bucket_size": Rule(
        ("deepspeed.zero_optimization.reduce_bucket_size", "deepspeed.zero_optimization.allgather_bucket_size")
    ),
    "trainer": Rule(),
}


def _axolotl_fixed(p: Plan) -> dict[str, Any]:
    out = _hf_fixed(p)
    if p.quant is not None:
        out["kbit_upcast"] = False
    if p.seq_len % 64:
        out["seq_len"] = -(-p.seq_len // 64) * 64  # the collator pads to the next multiple of 64
    return out


_FIXED["axolotl"] = _axolotl_fixed

#: The rules of every trainer.
RULES: dict[str, dict[str, Rule]] = {
    "oomdoctor": OOMDOCTOR,
    "trl": TRL,
    "hf": HF,
    "axolotl": AXOLOTL,
    "accelerate": ACCELERATE,
}

# ---------------------------------------------------------------------------------------------- versions

#: The library versions each trainer's price assumes (major.minor): its step was read (and, for trl and hf,
#: replayed) at these versions.
PRICED_VERSIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "oomdoctor": (),
    "trl": (("trl", "1.16"), ("transformers", "5.24"), ("peft", "0.21")),
    "hf": (("transformers", "5.24"), ("peft", "0.21"), ("accelerate", "1.15")),
    "axolotl": (("axolotl", "0.19"),),
    "accelerate": (("accelerate", "1.15"), ("transformers", "5.24"), ("peft", "0.21")),
}
#: Libraries a plan's knobs add to its trainer's (Liger for a chunked loss outside TRL and oomdoctor).
LIGER = ("liger-kernel", "0.8")


def priced_versions(plan: Plan) -> tuple[tuple[str, str], ...]:
    """(distribution, major.minor) pairs the plan's price assumes."""
    extra = (LIGER,) if plan.loss == "chunked" and plan.trainer in ("hf", "axolotl", "accelerate") else ()
    return PRICED_VERSIONS[plan.trainer] + extra


def version_notes(plan: Plan) -> list[str]:
    """One note per assumed library whose installed version differs (major.minor) or that is not installed here."""
    from importlib.metadata import PackageNotFoundError, version

    notes = []
    for dist, priced in priced_versions(plan):
        try:
            have = version(dist)
        except PackageNotFoundError:
            notes.append(f"priced as {dist} {priced} runs it; {dist} is not installed here")
            continue
        if ".".join(have.split(".")[:2]) != priced:
            notes.append(f"priced as {dist} {priced} runs it; {dist} {have} is installed here: its step may differ")
    return notes


# ---------------------------------------------------------------------------------------------- plans


def fixed(plan: Plan, trainer: str) -> dict[str, Any]:
    """The knob values ``trainer`` runs whatever its config says, for this plan."""
    fix = _FIXED.get(trainer)
    return fix(plan) if fix else {}


def adapt(plan: Plan, trainer: str) -> Plan:
    """``plan`` as ``trainer`` runs it: ``trainer`` set and the knobs it fixes (:func:`fixed`) at its values."""
    plan = validate(plan)
    return plan.with_(trainer=trainer, **fixed(plan, trainer))


#: Model types liger-kernel's ``_apply_liger_kernel_to_instance`` patches (``MODEL_TYPE_TO_APPLY_LIGER_FN``,
#: liger-kernel 0.8.1, the version axolotl 0.19 pins); for any other type transformers' ``use_liger_kernel`` is a
#: silent no-op and the loss stays transformers' own.
LIGER_MODEL_TYPES_081: frozenset[str] = frozenset(
    (
        "deepseek_v4",
        "exaone4",
        "falcon_h1",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gemma4",
        "gemma4_text",
        "glm4",
        "glm4v",
        "glm4v_moe",
        "gpt_oss",
        "granite",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "internvl",
        "llama",
        "llama4",
        "llama4_text",
        "llava",
        "ministral",
        "mistral",
        "mixtral",
        "mllama",
        "mllama_text_model",
        "nemotron",
        "olmo2",
        "olmo3",
        "paligemma",
        "phi3",
        "pixtral",
        "qwen2",
        "qwen2_5_vl",
        "qwen2_5_vl_text",
        "qwen2_vl",
        "qwen2_vl_text",
        "qwen3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_vl_moe_text",
        "qwen3_vl_text",
        "smollm3",
        "smolvlm",
    )
)
#: The same list in liger-kernel 0.8.5 (what an HF Trainer or accelerate script installs today).
LIGER_MODEL_TYPES: frozenset[str] = LIGER_MODEL_TYPES_081 | {"deepseek_v2", "deepseek_v3", "muse_glimmer"}


def _model_refusals(plan: Plan, model_type: str) -> list[Refusal]:
    """What a trainer cannot run on this kind of model: Liger's fused loss where liger-kernel has no patch for it."""
    if plan.loss == "chunked" and plan.trainer in ("hf", "axolotl", "accelerate"):
        types = LIGER_MODEL_TYPES_081 if plan.trainer == "axolotl" else LIGER_MODEL_TYPES
        if model_type not in types:
            return [
                Refusal(
                    "loss",
                    plan.loss,
                    f"liger-kernel has no fused loss for model type {model_type!r} "
                    "(use_liger_kernel would silently keep the full logits)",
                )
            ]
    return []


def refusals(plan: Plan, model_type: str | None = None) -> list[Refusal]:
    """The knob values of ``plan`` that ``plan.trainer`` cannot run (empty: it runs the plan); with ``model_type``,
    also what it cannot run on that kind of model."""
    rules = RULES[plan.trainer]
    out = []
    for t in TECHNIQUES:
        rule = rules[t.name]
        why = rule.refuse(plan) if rule.refuse and applies(t.name, plan) else None
        if why:
            out.append(Refusal(t.name, getattr(plan, t.name), why))
    return out + (_model_refusals(plan, model_type) if model_type else [])


def conflict(knob: str, value: Any, plan: Plan) -> Refusal:
    """Why ``plan.trainer`` cannot run ``knob = value`` (a pinned value the trainer fixes or refuses)."""
    rule = RULES[plan.trainer][knob]
    probe = plan.with_(**{knob: value}) if knob != "trainer" else plan
    why = rule.refuse(probe) if rule.refuse else None
    return Refusal(knob, value, why or rule.how or f"{plan.trainer} runs {knob} {_show(getattr(plan, knob))} here")


def runnable(
    plans: Iterable[Plan], trainer: str, pins: Mapping[str, Any] | None = None, model_type: str | None = None
) -> list[Plan]:
    """``plans`` as ``trainer`` runs them (:func:`adapt`), without those it cannot run (:func:`refusals`, on
    ``model_type`` when given) or whose pinned knobs it would run otherwise, each once, in order. BadInput when none is
    left because of a pinned knob, naming every such knob and why (the user asked for what the trainer cannot run)."""
    pins = {k: v for k, v in (pins or {}).items() if k != "trainer"}
    out: list[Plan] = []
    blame: dict[str, Refusal] = {}
    for p in plans:
        try:
            q = adapt(p, trainer)
        except BadInput:
            continue
        moved = [k for k in pins if k in RULES[trainer] and getattr(q, k) != getattr(p, k)]
        for k in moved:
            blame[k] = conflict(k, getattr(p, k), q)
        refused = refusals(q, model_type)
        for r in refused:
            if r.knob in pins:
                blame[r.knob] = r
        if not moved and not refused and q not in out:
            out.append(q)
    if not out:
        if blame:
            raise BadInput(
                f"{trainer} cannot run what was pinned: " + "; ".join(map(str, blame.values())),
                "unpin those knobs, or emit for another trainer (`oomdoctor targets` lists what each runs)",
            )
        raise BadInput(f"{trainer} can run none of these plans", "unpin knobs or emit for another trainer")
    return out


#: Plans the table view probes each knob value on (one of each stack a trainer may refuse a value in).
_PROBES: tuple[Plan, ...] = (
    Plan(method="full", precision="fp32"),
    Plan(method="full", precision="bf16-mixed"),
    Plan(method="full", precision="bf16", optimizer="sgd"),
    Plan(method="lora", precision="bf16", gradient_checkpointing=True),
    Plan(method="qlora", quant="nf4", precision="bf16", gradient_checkpointing=True),
    Plan(method="qlora", quant="int8", precision="bf16-mixed"),
    Plan(method="full", precision="bf16-mixed", world_size=16, strategy="fsdp"),
    Plan(method="full", precision="bf16-mixed", world_size=8, strategy="zero2"),
)
#: Values probed for knobs that are not choices or switches.
_PROBE_VALUES: dict[str, tuple[Any, ...]] = {"shard_group": (8,), "bucket_size": (10**7,)}


def _probe_values(t: Any) -> tuple[Any, ...]:
    if t.kind == "bool":
        return (False, True)
    if t.kind == "choice":
        return tuple(c for c in t.choices if c != "flash_attention_2")
    return _PROBE_VALUES.get(t.name, ())


def refused_values(trainer: str, knob: str) -> dict[Any, str]:
    """The values of ``knob`` that ``trainer`` refuses on some probed plan, with why (the view ``oomdoctor targets``
    prints; the rules themselves decide plan by plan)."""
    t = next(t for t in TECHNIQUES if t.name == knob)
    out: dict[Any, str] = {}
    if knob == "trainer":
        return out
    for base in _PROBES:
        for value in _probe_values(t):
            try:
                plan = validate(base.with_(**{knob: value, "trainer": trainer}))
            except BadInput:
                continue
            for r in refusals(plan):
                if r.knob == knob and r.value not in out:
                    out[r.value] = r.why
    return out


def check_complete() -> list[str]:
    """(knob, trainer) pairs without a rule: none may be missing (tests)."""
    return [f"{name}: {t.name}" for name, rules in RULES.items() for t in TECHNIQUES if t.name not in rules]


__all__ = [
    "ACCELERATE",
    "AXOLOTL",
    "HF",
    "OOMDOCTOR",
    "PRICED_VERSIONS",
    "RULES",
    "Refusal",
    "Rule",
    "TRAINERS",
    "TRL",
    "adapt",
    "applies",
    "check_complete",
    "conflict",
    "fixed",
    "priced_versions",
    "refusals",
    "refused_values",
    "runnable",
    "version_notes",
]
