"""The typed train config: ``model:``, ``dataset:`` and the flat top-level keys.

Every field is a key of :mod:`oomdoctor.train.config.schema` (its help, memory note and default are described
there, once; the memory knobs come from the plan's technique table). No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomdoctor.errors import BadInput
from oomdoctor.plan import Plan, validate
from oomdoctor.plan.plan import COMPUTE_DTYPES
from oomdoctor.plan.techniques import HF_ATTN_NAMES, OPTIM_VALUES
from oomdoctor.train.config.schema import DATASET, MODEL, default

_ATTN_FROM_HF = {hf: ours for ours, hf in HF_ATTN_NAMES.items()}


@dataclass
class ModelConfig:
    """Where the model comes from (the ``model:`` section; keys in ``schema.MODEL_KEYS``)."""

    path: str | None = default("path", MODEL)
    """Weights directory or hub id."""
    config: str | None = default("config", MODEL)
    """Config for ``init: random``."""
    init: str = default("init", MODEL)
    """``pretrained`` or ``random``."""
    tokenizer: str | None = default("tokenizer", MODEL)
    """Tokenizer directory or file."""
    attn_implementation: str = default("attn_implementation", MODEL)
    """transformers ``attn_implementation`` (the plan's ``attn``)."""


@dataclass
class DatasetConfig:
    """Training data (the ``dataset:`` section; keys in ``schema.DATASET_KEYS``)."""

    path: str | list[str] | None = default("path", DATASET)
    """File, directory or list of files."""
    format: str = default("format", DATASET)
    """File format."""
    type: str = default("type", DATASET)
    """Sample type."""
    text_field: str = default("text_field", DATASET)
    """Text field (TRL ``dataset_text_field``)."""
    prompt_field: str = default("prompt_field", DATASET)
    """Prompt field."""
    completion_field: str = default("completion_field", DATASET)
    """Completion field (``response`` is read too when left at ``completion``)."""
    chat_template: str | None = default("chat_template", DATASET)
    """Jinja template, a file holding one, ``chatml``, or None (the tokenizer's, else chatml)."""
    assistant_only_loss: bool = default("assistant_only_loss", DATASET)
    """Loss only on assistant replies of conversations."""
    completion_only_loss: bool | None = default("completion_only_loss", DATASET)
    """Mask the prompt of prompt/completion records (None: true for prompt_completion)."""
    packing: bool = default("packing", DATASET)
    """Pack samples into rows of at most seq_len."""
    packing_strategy: str = default("packing_strategy", DATASET)
    """``bfd`` (isolated samples) or ``wrapped``."""
    shuffle: bool = default("shuffle", DATASET)
    """Shuffle each epoch."""
    pad_to_multiple_of: int | None = default("pad_to_multiple_of", DATASET)
    """Padding multiple."""
    add_eos: bool = default("add_eos", DATASET)
    """Append EOS."""
    max_samples: int | None = default("max_samples", DATASET)
    """Sample limit."""
    eval_split: float | None = default("eval_split", DATASET)
    """Fraction of the samples held back for eval."""
    eval_path: str | list[str] | None = default("eval_path", DATASET)
    """Separate eval data."""


@dataclass
class TrainConfig:
    """One training run. Flat keys use Hugging Face names (``schema.TOP_KEYS``); see docs/train.md."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The ``model:`` section."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """The ``dataset:`` section."""
    method: str = default("method")
    """Plan ``method``."""
    precision: str = default("precision")
    """Plan ``precision``."""
    micro_batch_size: int | str = default("micro_batch_size")
    """Plan ``micro_batch`` (or ``auto``)."""
    gradient_accumulation_steps: int = default("gradient_accumulation_steps")
    """Plan ``grad_accum``."""
    global_batch_size: int | None = default("global_batch_size")
    """Effective batch; fixes the accumulation."""
    seq_len: int = default("seq_len")
    """Plan ``seq_len``."""
    max_steps: int | None = default("max_steps")
    """Optimizer steps (overrides ``num_train_epochs``)."""
    num_train_epochs: float = default("num_train_epochs")
    """Passes over the data when ``max_steps`` is unset."""
    learning_rate: float = default("learning_rate")
    """Peak learning rate."""
    lr_scheduler_type: str = default("lr_scheduler_type")
    """Scheduler name."""
    warmup_steps: int = default("warmup_steps")
    """Warm-up steps."""
    weight_decay: float = default("weight_decay")
    """Weight decay."""
    adam_beta1: float = default("adam_beta1")
    """AdamW/Lion beta1."""
    adam_beta2: float = default("adam_beta2")
    """AdamW/Lion beta2."""
    adam_epsilon: float = default("adam_epsilon")
    """AdamW epsilon."""
    sgd_momentum: float = default("sgd_momentum")
    """Plan ``sgd_momentum``."""
    max_grad_norm: float | None = default("max_grad_norm")
    """Clipping norm."""
    optim: str = default("optim")
    """Plan ``optimizer``, as the HF ``optim`` name."""
    optim_impl: str = default("optim_impl")
    """Plan ``optimizer_impl``."""
    gradient_checkpointing: bool = default("gradient_checkpointing")
    """Plan ``gradient_checkpointing``."""
    loss: str = default("loss")
    """Plan ``loss``."""
    r: int = default("r")
    """Plan ``lora_r``."""
    lora_alpha: int = default("lora_alpha")
    """Plan ``lora_alpha``."""
    lora_dropout: float = default("lora_dropout")
    """Plan ``lora_dropout``."""
    target_modules: list[str] = field(default_factory=lambda: default("target_modules"))
    """Plan ``lora_targets`` (+ ``lm_head``: ``lora_on_head``)."""
    adapter_dtype: str = default("adapter_dtype")
    """Plan ``adapter_dtype``."""
    load_in_4bit: bool = default("load_in_4bit")
    """Plan ``quant`` nf4/fp4."""
    load_in_8bit: bool = default("load_in_8bit")
    """Plan ``quant`` int8."""
    bnb_4bit_quant_type: str = default("bnb_4bit_quant_type")
    """4-bit data type."""
    bnb_4bit_use_double_quant: bool = default("bnb_4bit_use_double_quant")
    """Plan ``double_quant``."""
    bnb_4bit_compute_dtype: str | None = default("bnb_4bit_compute_dtype")
    """4-bit compute dtype."""
    kbit_upcast: bool = default("kbit_upcast")
    """Plan ``kbit_upcast``."""
    optimizer_in_backward: bool = default("optimizer_in_backward")
    """Plan ``optimizer_in_backward``."""
    tiled_mlp: bool = default("tiled_mlp")
    """Plan ``tiled_mlp``."""
    offload_optimizer: bool = default("offload_optimizer")
    """Plan ``offload_optimizer``."""
    offload_activations: bool = default("offload_activations")
    """Plan ``offload_activations``."""
    offload_params: bool = default("offload_params")
    """Plan ``offload_params`` (FSDP2 ``CPUOffloadPolicy``; on one GPU the plan runs FSDP2 at world size 1)."""
    world_size: int = default("world_size")
    """Plan ``world_size``: 1 follows the launcher; more must equal the processes torchrun starts."""
    strategy: str = default("strategy")
    """Plan ``strategy`` (``train --strategy`` overrides it)."""
    shard_group: int | None = default("shard_group")
    """Plan ``shard_group`` (HSDP when smaller than ``world_size``)."""
    reshard_after_forward: bool = default("reshard_after_forward")
    """Plan ``reshard_after_forward``."""
    bucket_size: int | None = default("bucket_size")
    """Plan ``bucket_size`` (DeepSpeed buckets; zero2/zero3)."""
    output_dir: str = default("output_dir")
    """Run directory."""
    save_steps: int = default("save_steps")
    """Checkpoint interval."""
    save_total_limit: int | None = default("save_total_limit")
    """Checkpoints kept."""
    logging_steps: int = default("logging_steps")
    """Progress interval."""
    report_to: list[str] = field(default_factory=lambda: default("report_to"))
    """Metric sinks besides metrics.jsonl."""
    eval_steps: int | None = default("eval_steps")
    """Eval interval (None: at the end)."""
    per_device_eval_batch_size: int = default("per_device_eval_batch_size")
    """Eval micro-batch."""
    overwrite_output_dir: bool = default("overwrite_output_dir")
    """Replace a run already in ``output_dir``."""
    merge_adapter: bool = default("merge_adapter")
    """Also save the merged model (LoRA/QLoRA)."""
    seed: int = default("seed")
    """Seed."""
    gpu_mem: int | None = default("gpu_mem")
    """Memory cap in bytes."""
    max_oom_retries: int = default("max_oom_retries")
    """OOM recoveries allowed."""
    device: str = default("device")
    """``auto``, ``cuda`` or ``cpu``."""

    # ---------------------------------------------------------------------------------------- views
    @property
    def quant(self) -> str | None:
        if self.load_in_8bit:
            return "int8"
        if self.load_in_4bit or self.method == "qlora":  # qlora without a load_in_* key means 4-bit nf4
            return self.bnb_4bit_quant_type
        return None

    @property
    def compute_dtype(self) -> str:
        """The bnb 4-bit compute dtype (explicit, or following ``precision``)."""
        if self.bnb_4bit_compute_dtype:
            return self.bnb_4bit_compute_dtype
        return COMPUTE_DTYPES[self.precision]

    @property
    def plan_optimizer(self) -> str:
        return OPTIM_VALUES[self.optim][0]

    @property
    def plan_optimizer_impl(self) -> str:
        return OPTIM_VALUES[self.optim][1] or self.optim_impl

    @property
    def effective_batch_size(self) -> int | None:
        """Sequences per optimizer step (None while the micro-batch is ``auto`` and no global batch is set)."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if isinstance(self.micro_batch_size, int):
            return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size
        return None

    @property
    def model_ref(self) -> str:
        """The model reference that ``oomdoctor.model.load.load_spec`` understands (directory / config / id)."""
        return self.model.path if self.model.init == "pretrained" else self.model.config  # type: ignore[return-value]

    def to_plan(self, micro_batch: int | None = None) -> Plan:
        """The memory model's :class:`oomdoctor.plan.Plan` for this run (:func:`to_plan`)."""
        return to_plan(self, micro_batch)


def to_plan(cfg: TrainConfig, micro_batch: int | None = None) -> Plan:
    """The :class:`oomdoctor.plan.Plan` that ``cfg`` runs.

    ``micro_batch`` overrides the config's (needed while it is ``auto``: pass the tuned value)."""
    mb = micro_batch if micro_batch is not None else cfg.micro_batch_size
    if not isinstance(mb, int):
        raise BadInput(
            "micro_batch_size is 'auto': the plan needs a number", "run `oomdoctor tune` or pass to_plan(micro_batch=N)"
        )
    eff = cfg.effective_batch_size
    per_step = mb * cfg.world_size  # sequences one micro-batch round takes over every rank
    ga = max(1, -(-eff // per_step)) if eff is not None else cfg.gradient_accumulation_steps
    method = cfg.method
    if cfg.quant is not None and method == "lora":
        method = "qlora"
    on_head = "lm_head" in cfg.target_modules
    targets = tuple(t for t in cfg.target_modules if t != "lm_head") or ("lm_head",)
    return validate(
        Plan(
            method=method,  # type: ignore[arg-type]
            precision=cfg.precision,  # type: ignore[arg-type]
            optimizer=cfg.plan_optimizer,  # type: ignore[arg-type]
            optimizer_impl=cfg.plan_optimizer_impl,  # type: ignore[arg-type]
            sgd_momentum=cfg.sgd_momentum,
            attn=_ATTN_FROM_HF[cfg.model.attn_implementation],  # type: ignore[arg-type]
            gradient_checkpointing=cfg.gradient_checkpointing,
            loss=cfg.loss,  # type: ignore[arg-type]
            lora_r=cfg.r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            lora_targets=targets,
            lora_on_head=on_head,
            adapter_dtype=cfg.adapter_dtype,  # type: ignore[arg-type]
            quant=cfg.quant,  # type: ignore[arg-type]
            double_quant=bool(cfg.bnb_4bit_use_double_quant and cfg.quant in ("nf4", "fp4")),
            kbit_upcast=cfg.kbit_upcast,
            micro_batch=mb,
            seq_len=cfg.seq_len,
            grad_accum=ga,
            optimizer_in_backward=cfg.optimizer_in_backward,
            tiled_mlp=cfg.tiled_mlp,
            offload_optimizer=cfg.offload_optimizer,
            offload_activations=cfg.offload_activations,
            offload_params=cfg.offload_params,
            world_size=cfg.world_size,
            strategy=cfg.strategy,  # type: ignore[arg-type]
            shard_group=cfg.shard_group,
            reshard_after_forward=cfg.reshard_after_forward,
            bucket_size=cfg.bucket_size,
        )
    )


__all__ = ["DatasetConfig", "ModelConfig", "TrainConfig", "to_plan"]
