"""The technique table: every memory knob of a fine-tuning run, described once.

Each :class:`Technique` names a knob the way the plan does (``Plan`` field, key of the JSON ``settings``, stem of
the ``diagnose``/``tune`` flag), the Hugging Face names a train YAML also accepts for it
(``per_device_train_batch_size``, ``optim``, ``target_modules``...), its kind and choices, its default (what a
Hugging Face user gets when they do not set it, with the source), a help text and a note on what it costs in memory.

Derived from this table: :class:`oomdoctor.plan.Plan`'s defaults, the train YAML's validation, aliases and comments
(``oomdoctor.train.config``), the help and defaults of the diagnose/tune/train options (``oomdoctor.cli``), the
``settings`` JSON, and the way advice names a change (:func:`how`: flags for diagnose/tune, YAML keys for train).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: The plan's optimizers, each with its Hugging Face ``TrainingArguments.optim`` name (the first one is what a
#: train YAML writes) and the other ``optim`` spellings accepted for it, mapped to the implementation they fix
#: (``None``: the one given by ``optim_impl``). The only place optimizer names are spelled.
OPTIMIZERS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "adamw": (("adamw_torch", None), ("adamw_torch_fused", "fused"), ("adamw_torch_foreach", "foreach")),
    "adamw-8bit": (("adamw_bnb_8bit", None), ("adamw_8bit", None)),
    "paged-adamw": (("paged_adamw_32bit", None), ("paged_adamw", None)),
    "paged-adamw-8bit": (("paged_adamw_8bit", None),),
    "adafactor": (("adafactor", None),),
    "sgd": (("sgd", None),),
    "lion": (("lion_32bit", None), ("lion", None)),
}
#: HF ``optim`` name a plan optimizer is written as.
HF_OPTIM_NAMES: dict[str, str] = {ours: names[0][0] for ours, names in OPTIMIZERS.items()}
#: Every accepted ``optim`` value (HF names and the plan's own) -> (plan optimizer, implementation it fixes or None).
OPTIM_VALUES: dict[str, tuple[str, str | None]] = {
    **{hf: (ours, impl) for ours, names in OPTIMIZERS.items() for hf, impl in names},
    **{ours: (ours, None) for ours in OPTIMIZERS},
}
#: Optimizers whose state bitsandbytes keeps in paged (unified) memory.
PAGED_OPTIMIZERS: tuple[str, ...] = tuple(o for o in OPTIMIZERS if o.startswith("paged"))
#: Optimizers torch implements (where ``optimizer_impl`` matters).
TORCH_OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")

#: Plan attention names -> ``attn_implementation`` (transformers) values.
HF_ATTN_NAMES: dict[str, str] = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
#: The LoRA target meaning every linear layer but the output head (peft).
ALL_LINEAR = "all-linear"
#: The training code that can run a plan (``trainer``; ``tune --emit`` targets): oomdoctor's own executor, TRL's
#: SFTTrainer, transformers' Trainer, axolotl, a user's script under ``accelerate launch``. What each one can
#: express and run is ``oomdoctor.plan.targets``.
TRAINERS: tuple[str, ...] = ("oomdoctor", "trl", "hf", "axolotl", "accelerate")

Kind = Literal["choice", "bool", "int>=1", "int>=1|null", "prob", "targets"]


@dataclass(frozen=True)
class Technique:
    """One memory knob of a plan."""

    name: str
    """Plan field, key in the ``settings`` JSON, and (dashed) the diagnose/tune flag: ``micro_batch``."""
    kind: Kind
    """``choice`` (one of ``choices``), ``bool``, ``int>=1``, ``int>=1|null`` (unset: the engine's default), ``prob``
    (a float in [0, 1)) or ``targets`` (module names, a comma-separated string or a list)."""
    default: Any
    """The value when nothing is said: what a Hugging Face user gets by default."""
    default_source: str
    """Where the default comes from (the library default it mirrors)."""
    help: str
    """What the knob does, in one or two sentences (flag help, docs)."""
    memory: str
    """What it costs or saves in memory (the comment the emitted YAML carries)."""
    choices: tuple[Any, ...] = ()
    """Accepted values of a ``choice`` knob (``None`` among them: the knob may be unset)."""
    yaml_key: str | None = None
    """Key a train YAML writes it under (Hugging Face name); None: the plan name, ``""``: expressed through other
    keys (``quant`` is ``load_in_4bit``/``load_in_8bit``/``bnb_4bit_quant_type``)."""
    aliases: tuple[str, ...] = ()
    """Other top-level train YAML keys accepted for it (HF / torchtune / axolotl spellings)."""
    flag: str | None = None
    """diagnose/tune flag; None: ``--`` + the dashed name. ``""``: no flag."""
    train_executes: bool = True
    """False: plans price it but ``train`` cannot run it yet (only the default is accepted in a train YAML)."""
    json_key: str | None = None
    """Key in the ``settings`` / ``plan`` JSON; None: the plan name. The batch knobs keep the Hugging Face names the
    JSON has always used (``micro_batch_size``, ``gradient_accumulation_steps``): train YAML keys as well."""

    @property
    def key(self) -> str:
        """The train YAML key (``micro_batch_size`` for ``micro_batch``)."""
        return self.yaml_key if self.yaml_key else self.name

    @property
    def setting(self) -> str:
        """The key in the ``settings`` JSON."""
        return self.json_key or self.name

    @property
    def option(self) -> str:
        """The command-line flag (``--micro-batch``)."""
        return self.flag if self.flag is not None else "--" + self.name.replace("_", "-")

    def flag_help(self, unset: str | None = None) -> str:
        """Help of the flag: choices, help text, and the default (or, for a pinning flag, what ``unset`` means)."""
        shown = [str(c) for c in self.choices if c is not None]
        head = " | ".join(shown) + ". " if self.kind == "choice" else ""
        tail = f"unset: {unset}" if unset is not None else f"default {_show(self.default)}"
        return f"{head}{self.help} ({tail})"


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, tuple):
        return ",".join(v)
    return "none" if v is None else str(v)


_PEFT = "peft LoraConfig default (peft 0.21: r=8, lora_alpha=8, lora_dropout=0.0)"

TECHNIQUES: tuple[Technique, ...] = (
    Technique(
        "method",
        "choice",
        "full",
        "transformers.Trainer trains every weight",
        "full: every weight trains; lora: Low-Rank Adaptation (peft) adapters train on a frozen base; "
        "qlora: LoRA on a bitsandbytes-quantized frozen base (quant, default nf4)",
        "full: weights+grads+optimizer for every parameter (~16 B/param with AdamW fp32); lora: only adapters "
        "train (grads/optimizer tiny), base frozen; qlora: base stored 4-bit (~0.5 B/param)",
        choices=("full", "lora", "qlora"),
    ),
    Technique(
        "precision",
        "choice",
        "fp32",
        "TrainingArguments: bf16=False, fp16=False",
        "fp32; fp16-mixed / bf16-mixed: fp32 weights under autocast (the fp32 weights are the master copy; "
        "HF bf16: true / fp16: true); bf16: pure bf16 weights, gradients and optimizer states",
        "fp32 (4 B/param weights) | bf16-mixed / fp16-mixed (fp32 weights + low-precision copies, activations "
        "halved) | bf16 (pure: 2 B/param weights, grads, optimizer state)",
        choices=("fp32", "fp16-mixed", "bf16-mixed", "bf16"),
    ),
    Technique(
        "optimizer",
        "choice",
        "adamw",
        "TrainingArguments.optim: adamw_torch_fused on CUDA",
        "AdamW keeps exactly Adam's two states (decoupled weight decay costs no memory); leaner: 8-bit / paged "
        "AdamW (bitsandbytes, CUDA), Adafactor, SGD, Lion. A train YAML also takes the HF optim names ("
        + ", ".join(h for names in OPTIMIZERS.values() for h, _ in names)
        + ")",
        "adamw: 8 B/trainable param of state | adamw-8bit: 2 B | paged-*: state in unified memory, paged to the "
        "CPU under pressure (shown, not counted as resident) | adafactor: factored (~0) | sgd: 0 (4 B with "
        "momentum) | lion: 4 B",
        choices=tuple(OPTIMIZERS),
        yaml_key="optim",
    ),
    Technique(
        "optimizer_impl",
        "choice",
        "fused",
        "TrainingArguments.optim adamw_torch_fused (torch fused=True)",
        "torch optimizer kernel: fused (one kernel), foreach (multi-tensor) or for-loop; ignored by bitsandbytes "
        "and Adafactor",
        "fused: no group-sized temporaries | foreach: temporaries the size of a parameter group at the step | "
        "for-loop: one parameter's",
        choices=("fused", "foreach", "for-loop"),
        yaml_key="optim_impl",
    ),
    Technique(
        "sgd_momentum",
        "prob",
        0.0,
        "torch.optim.SGD momentum=0",
        "SGD momentum",
        "> 0 adds one buffer per trainable parameter",
        flag="",
    ),
    Technique(
        "attn",
        "choice",
        "sdpa",
        "transformers attn_implementation: sdpa when torch provides it",
        "attention kernel: eager materializes the seq x seq scores; sdpa / flash (flash_attention_2) do not",
        "eager: seq x seq scores and probabilities per head in memory | sdpa / flash: none",
        choices=tuple(HF_ATTN_NAMES) + ("flash_attention_2",),
        yaml_key="attn_implementation",
    ),
    Technique(
        "gradient_checkpointing",
        "bool",
        False,
        "TrainingArguments.gradient_checkpointing=False",
        "recompute activations in backward, keeping only each layer's input",
        "true: activations drop ~L-fold for ~33% more compute (the biggest activation saver)",
        flag="--gradient-checkpointing/--no-gradient-checkpointing",
    ),
    Technique(
        "loss",
        "choice",
        "standard",
        "transformers ForCausalLMLoss (logits of every token, upcast to fp32)",
        "causal-LM loss: standard materializes batch x seq x vocab logits (+ fp32 upcast, log-probabilities); "
        "chunked runs the LM head and cross-entropy over token chunks, each recomputed in backward (the memory "
        "of Liger's fused linear cross-entropy / Apple's cut-cross-entropy, in pure torch)",
        "standard: ~12 B x tokens x vocab at the loss (often the peak with 128k-256k vocabularies) | chunked: "
        "one chunk of about tokens x hidden logits; costs one more LM-head forward",
        choices=("standard", "chunked"),
    ),
    Technique(
        "tiled_mlp",
        "bool",
        False,
        "transformers runs each MLP over the whole sequence (axolotl tiled_mlp: false)",
        "run each decoder block's MLP over tiles of about hidden_size tokens, recomputing each tile in backward "
        "(Arctic Long Sequence Training's TiledMLP, as DeepSpeed, axolotl and unsloth ship it): for contexts of "
        "tens of thousands of tokens; one GPU, dense MLPs",
        "the MLP's intermediates (gate, up, product: several x tokens x intermediate) shrink to one tile of "
        "~hidden_size tokens; costs one more MLP forward per step",
        flag="--tiled-mlp/--no-tiled-mlp",
    ),
    Technique(
        "lora_r",
        "int>=1",
        8,
        _PEFT,
        "LoRA rank r",
        "r x (in+out) trainable params per adapted linear (grads + optimizer state on those only)",
        yaml_key="r",
    ),
    Technique(
        "lora_alpha", "int>=1", 8, _PEFT, "LoRA scale numerator (scale = lora_alpha / r)", "no memory effect", flag=""
    ),
    Technique(
        "lora_dropout",
        "prob",
        0.0,
        _PEFT,
        "dropout on the adapter input",
        "> 0 keeps one mask/copy of each adapted input for backward",
        flag="",
    ),
    Technique(
        "lora_targets",
        "targets",
        (ALL_LINEAR,),
        "peft target_modules='all-linear' (every linear but the head)",
        "modules that get LoRA adapters: q_proj,v_proj,... or all-linear",
        "more targets = more adapter params and adapter activations",
        yaml_key="target_modules",
        aliases=("lora_target_modules",),
    ),
    Technique(
        "lora_on_head",
        "bool",
        False,
        "peft all-linear excludes the output head",
        "also adapt the output head (lm_head)",
        "its adapter input/grad spans the vocabulary projection",
        yaml_key="",
        flag="--lora-on-head",
    ),
    Technique(
        "adapter_dtype",
        "choice",
        "fp32",
        "peft get_peft_model(autocast_adapter_dtype=True): fp32 adapters",
        "dtype of the LoRA adapter weights: fp32 (peft's default under every precision) or bf16 (the QLoRA paper's "
        "recipe; TRL's SFTTrainer casts the adapters of a quantized model to bf16)",
        "bf16: adapters, their gradients and AdamW states at 2 B/param instead of 4, and the adapters' matmuls in "
        "bf16 (no fp32 copies of their inputs)",
        choices=("fp32", "bf16"),
    ),
    Technique(
        "quant",
        "choice",
        None,
        "from_pretrained without a quantization_config",
        "bitsandbytes quantization of the frozen base: int8 (LLM.int8()), nf4 or fp4 (4-bit, QLoRA); in a train "
        "YAML also load_in_4bit + bnb_4bit_quant_type / load_in_8bit",
        "nf4/fp4: ~0.5 B/param instead of 2-4 | int8: ~1 B/param",
        choices=(None, "int8", "nf4", "fp4"),
        yaml_key="",
    ),
    Technique(
        "double_quant",
        "bool",
        False,
        "BitsAndBytesConfig.bnb_4bit_use_double_quant=False",
        "QLoRA double quantization: quantize the 4-bit absmax constants again",
        "saves ~0.37 bit/param (~0.3 GB on 7B)",
        yaml_key="bnb_4bit_use_double_quant",
        flag="--double-quant",
    ),
    Technique(
        "kbit_upcast",
        "bool",
        True,
        "peft prepare_model_for_kbit_training (peft's QLoRA recipe; TRL's SFTTrainer does not call it)",
        "quantized base: cast the weights bitsandbytes leaves unquantized (embeddings, norms, head, biases) to fp32 "
        "as peft's prepare_model_for_kbit_training does; off keeps them in the load dtype (TRL's SFTTrainer, "
        "axolotl's skip_prepare_model_for_kbit_training, unsloth)",
        "on, under pure bf16: the unquantized weights at 4 B/param (+4 GiB on a 70B: embeddings and head) and the "
        "residual stream in fp32 | off: they stay bf16 | no effect on fp32 / *-mixed plans (loaded in fp32)",
        flag="--kbit-upcast/--no-kbit-upcast",
    ),
    Technique(
        "micro_batch",
        "int>=1",
        1,
        "TrainingArguments.per_device_train_batch_size=8 (oomdoctor: 1, the floor)",
        "sequences per forward/backward per device (train YAML: also 'auto', the largest that fits)",
        "activations and logits scale linearly with it",
        yaml_key="micro_batch_size",
        aliases=("per_device_train_batch_size",),
        json_key="micro_batch_size",
    ),
    Technique(
        "seq_len",
        "int>=1",
        2048,
        "min(2048, the model's max_position_embeddings) on the command line",
        "tokens per sequence (longer samples are truncated)",
        "activations grow linearly (quadratically with eager attention), logits by seq_len x vocab x ~10 B",
        aliases=("max_seq_length", "max_seq_len", "sequence_len"),
    ),
    Technique(
        "grad_accum",
        "int>=1",
        1,
        "TrainingArguments.gradient_accumulation_steps=1",
        "micro-batches accumulated per optimizer step",
        "no extra memory; multiplies the effective batch",
        yaml_key="gradient_accumulation_steps",
        flag="",
        json_key="gradient_accumulation_steps",
    ),
    Technique(
        "optimizer_in_backward",
        "bool",
        False,
        "Trainer steps after backward (torchtune optimizer_in_bwd=False)",
        "step each parameter's optimizer in its post-accumulate-grad hook during backward (torchtune's "
        "optimizer_in_bwd, LOMO): a gradient is freed as soon as it is used; no gradient accumulation, no clipping",
        "gradients drop from one per trainable parameter to about the largest one (-2 B/param in bf16, -4 in fp32)",
    ),
    Technique(
        "offload_optimizer",
        "bool",
        False,
        "no offload (DeepSpeed/FSDP offload is opt-in)",
        "optimizer states and the optimizer step live on the CPU",
        "frees 8-12 B per trainable param on the GPU, costs PCIe copies every step",
        flag="--offload",
    ),
    Technique(
        "offload_activations",
        "bool",
        False,
        "no offload",
        "tensors saved for backward go to pinned CPU memory (torch.autograd.graph.save_on_cpu)",
        "activations leave the GPU, costs PCIe copies",
        flag="--offload",
    ),
    Technique(
        "offload_params",
        "bool",
        False,
        "no offload",
        "frozen/base weights live on the CPU and are streamed in per layer (accelerate/DeepSpeed style)",
        "weights leave the GPU but for one layer at a time",
        flag="--offload",
    ),
    Technique(
        "world_size",
        "int>=1",
        1,
        "one process (torchrun --nproc-per-node 1)",
        "data-parallel ranks: every GPU of every node (diagnose/tune --gpus; train runs them through torchrun "
        "--nproc-per-node)",
        "memory is priced per rank; the sharding strategies divide model states by it",
        flag="--gpus",
    ),
    Technique(
        "strategy",
        "choice",
        "single",
        "one process; under torchrun HF Trainer wraps the model in DDP",
        "how the ranks share the work: single (one GPU), ddp (a full replica per rank, gradients all-reduced), "
        "fsdp (torch FSDP2 fully_shard per decoder layer: weights, gradients and optimizer states sharded), zero2 / "
        "zero3 (DeepSpeed ZeRO stage 2 / 3). world_size > 1 with single means ddp",
        "ddp: single + one gradient-sized all-reduce bucket | fsdp: model states / shard group + the gathered "
        "layers | zero2: weights + (gradients + optimizer states) / N + buckets | zero3: every model state / N + "
        "the gathered layer + buckets",
        choices=("single", "ddp", "fsdp", "zero2", "zero3"),
    ),
    Technique(
        "shard_group",
        "int>=1|null",
        None,
        "FSDP2 shards over every rank (a 1-D device mesh)",
        "fsdp: ranks that share one sharded copy of the model states; fewer than world_size is HSDP (shard inside "
        "the group, replicate across world_size / shard_group groups, e.g. one group per node)",
        "sharded states divide by shard_group, not world_size",
    ),
    Technique(
        "reshard_after_forward",
        "bool",
        True,
        "torch FSDP2 fully_shard(reshard_after_forward=True)",
        "fsdp: free each layer's gathered weights after its forward and gather them again in backward; false keeps "
        "them from forward to backward (FSDP1 SHARD_GRAD_OP, ZeRO-2-like): fewer all-gathers",
        "false: + every layer's unsharded weights between forward and backward",
        flag="--reshard-after-forward/--no-reshard-after-forward",
    ),
    Technique(
        "bucket_size",
        "int>=1|null",
        None,
        "DeepSpeed reduce/allgather bucket = hidden^2 (Hugging Face's 'auto')",
        "zero2/zero3: elements per DeepSpeed communication bucket (reduce_bucket_size, allgather_bucket_size, "
        "stage3_prefetch_bucket_size)",
        "each bucket is a buffer of this many elements; DeepSpeed's own default 5e8 costs 1 GB (bf16) per rank",
    ),
    Technique(
        "trainer",
        "choice",
        "oomdoctor",
        "oomdoctor train runs the plan",
        "the code that runs the step, priced as it runs it: oomdoctor (oomdoctor train), trl (TRL's SFTTrainer, "
        "trl sft), hf (transformers' Trainer), axolotl, accelerate (your train.py under accelerate launch); "
        "tune --emit sets it and searches only the knobs that trainer runs (oomdoctor.plan.targets)",
        "trl: the loss through TRL's fused LM head (per-token log-probs, entropy and top-1 over vocabulary chunks, "
        "no full logits) and TRL's activation offloading | hf, axolotl, accelerate: a chunked loss is Liger's fused "
        "linear cross-entropy | oomdoctor: its own step",
        choices=TRAINERS,
        train_executes=False,
    ),
)

BY_NAME: dict[str, Technique] = {t.name: t for t in TECHNIQUES}
#: Plan knob -> its default (what :class:`oomdoctor.plan.Plan` uses).
DEFAULTS: dict[str, Any] = {t.name: t.default for t in TECHNIQUES}
#: Derived, read-only key of ``settings``: ``micro_batch * grad_accum * world_size`` (a train YAML reads it as
#: ``global_batch_size``).
EFFECTIVE_BATCH = "effective_batch_size"


def technique(name: str) -> Technique:
    return BY_NAME[name]


def choices(name: str) -> tuple[Any, ...]:
    """The accepted values of a ``choice`` knob, without ``None`` (and without transformers spellings for attn)."""
    if name == "attn":
        return tuple(HF_ATTN_NAMES)
    return tuple(c for c in BY_NAME[name].choices if c is not None)


Style = Literal["flags", "yaml"]


def _yaml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def how_yaml(name: str, value: Any, targets: tuple[str, ...] = (ALL_LINEAR,)) -> str:
    """``name = value`` written as train YAML keys (``targets``: the plan's current LoRA targets)."""
    if name == "optimizer":
        return f"optim: {HF_OPTIM_NAMES[value]}"
    if name == "attn":
        return f"model.attn_implementation: {HF_ATTN_NAMES[value]}"
    if name == "quant":
        if value is None:
            return "load_in_4bit: false, load_in_8bit: false"
        if value == "int8":
            return "load_in_8bit: true, load_in_4bit: false"
        return f"load_in_4bit: true, load_in_8bit: false, bnb_4bit_quant_type: {value}"
    if name == "lora_on_head":
        mods = [t for t in targets if t != "lm_head"] + (["lm_head"] if value else [])
        return f"target_modules: {_yaml_value(mods)}"
    return f"{BY_NAME[name].key}: {_yaml_value(value)}"


def how_flag(name: str, value: Any) -> str | None:
    """``name = value`` written as a diagnose/tune flag (None: the commands have no flag for it)."""
    t = BY_NAME[name]
    if t.option == "":
        return None
    if t.option == "--offload":
        part = name.removeprefix("offload_")
        return f"--offload {part}" if value else f"--offload without {part}"
    if t.kind == "bool":
        pos, _, neg = t.option.partition("/")
        if value:
            return pos
        return neg or f"drop {pos}"
    if isinstance(value, (tuple, list)):
        value = ",".join(value)
    return f"{t.option} {value}"


def how(changes: dict[str, Any], style: Style, targets: tuple[str, ...] = (ALL_LINEAR,)) -> str:
    """The plan ``changes`` as the command's own words: flags (diagnose, tune) or train YAML keys (train)."""
    parts: list[str] = []
    for name, value in changes.items():
        if style == "yaml":
            parts.append(how_yaml(name, value, targets))
        else:
            text = how_flag(name, value)
            if text is not None:
                parts.append(text)
    return ", ".join(parts) if style == "yaml" else " ".join(parts)


__all__ = [
    "ALL_LINEAR",
    "BY_NAME",
    "DEFAULTS",
    "EFFECTIVE_BATCH",
    "HF_ATTN_NAMES",
    "HF_OPTIM_NAMES",
    "OPTIMIZERS",
    "OPTIM_VALUES",
    "PAGED_OPTIMIZERS",
    "TECHNIQUES",
    "TORCH_OPTIMIZERS",
    "TRAINERS",
    "Technique",
    "choices",
    "how",
    "how_flag",
    "how_yaml",
    "technique",
]
