"""The ``train`` config: a typed, strictly validated YAML file (what ``tune`` emits and ``train`` runs).

Layout (documented in docs/train.md): training knobs are **flat** top-level keys with Hugging Face
``TrainingArguments`` / peft ``LoraConfig`` / transformers ``BitsAndBytesConfig`` names, and two nested sections,
``model:`` and ``dataset:``, because they describe objects::

    model:   {path: ./my-llama}                       # local dir with weights (or a hub id, downloaded by HF)
    model:   {config: configs/x/config.json, init: random, tokenizer: data/tiny/tokenizer}
    dataset: {path: data/tiny/train.jsonl, packing: true}
    method: lora
    precision: bf16-mixed            # or HF booleans  bf16: true / fp16: true  (mixed precision)
    per_device_train_batch_size: 4   # alias micro_batch_size; int or "auto"
    gradient_accumulation_steps: 8   # or global_batch_size: 32
    ...

``load_train_config(path)`` reports every problem at once (:class:`oomdoctor.errors.ConfigErrors`): unknown keys
with a did-you-mean, wrong types, bad values and inconsistent combinations, each naming its key.
No torch import here: the CLI imports this module at start-up.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from oomdoctor.errors import BadInput, ConfigErrors
from oomdoctor.plan import HF_OPTIM_NAMES, Plan, validate
from oomdoctor.units import format_bytes, parse_size

REPO_ROOT = Path(__file__).resolve().parent.parent.parent

#: HF ``TrainingArguments.optim`` names accepted, mapped to (plan optimizer, plan optimizer_impl or None).
OPTIM_ALIASES: dict[str, tuple[str, str | None]] = {
    **{hf: (ours, None) for ours, hf in HF_OPTIM_NAMES.items()},
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_torch_foreach": ("adamw", "foreach"),
    "adamw_8bit": ("adamw-8bit", None),
    "paged_adamw": ("paged-adamw", None),
    "lion": ("lion", None),
}
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
ATTN_IMPLS = ("eager", "sdpa", "flash_attention_2")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
DATA_FORMATS = ("auto", "jsonl", "json", "text", "parquet")
DATA_TYPES = ("auto", "text", "prompt_response")


# ------------------------------------------------------------------------------------------------ dataclasses


@dataclass
class ModelConfig:
    """Where the model comes from (the ``model:`` section)."""

    path: str | None = None
    """A local directory with ``config.json`` + weights (``from_pretrained`` loads it straight into the target dtype
    and device), or a Hugging Face id (downloaded by transformers on the training machine)."""
    config: str | None = None
    """With ``init: random``: a bundled model id (``oomdoctor models``), a ``config.json`` or a directory holding one.
    The model is built on the meta device and materialized once, in the target dtype (no fp32 copy first)."""
    init: str = "pretrained"
    """``pretrained`` (load the weights at ``path``) or ``random`` (fresh weights from ``config``: smoke runs)."""
    tokenizer: str | None = None
    """Tokenizer directory or ``tokenizer.json``; default: ``path``. Required with ``init: random``."""
    attn_implementation: str = "sdpa"
    """``eager`` (materializes seq x seq scores), ``sdpa`` or ``flash_attention_2`` (memory-efficient)."""


@dataclass
class DatasetConfig:
    """Training data (the ``dataset:`` section): local jsonl / json / text / parquet files."""

    path: str | list[str] | None = None
    """A file, a directory (every data file in it) or a list of files."""
    format: str = "auto"
    """``auto`` (from the extension), ``jsonl``, ``json``, ``text`` (one sample per line) or ``parquet``."""
    type: str = "auto"
    """``text`` (train on all tokens), ``prompt_response`` (the prompt is masked from the loss) or ``auto``
    (prompt_response when records carry ``prompt_field`` and ``response_field``)."""
    text_field: str = "text"
    """Record field holding the text (``type: text``)."""
    prompt_field: str = "prompt"
    """Record field holding the prompt (``type: prompt_response``)."""
    response_field: str = "response"
    """Record field holding the response (``type: prompt_response``)."""
    packing: bool = False
    """Concatenate samples into full ``seq_len`` blocks (no padding; constant memory per step). Otherwise each
    micro-batch is padded dynamically to its longest sample."""
    shuffle: bool = True
    """Shuffle samples each epoch (seeded by ``seed``; the order is part of the checkpoint)."""
    pad_to_multiple_of: int | None = None
    """Dynamic padding rounds lengths up to this multiple (8/64 help tensor cores)."""
    add_eos: bool = True
    """Append the tokenizer's EOS token to each sample."""
    max_samples: int | None = None
    """Use only the first N samples (quick runs)."""


@dataclass
class TrainConfig:
    """One training run. Flat keys use Hugging Face names; see docs/train.md."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The ``model:`` section."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """The ``dataset:`` section."""
    method: str = "full"
    """``full`` (every weight trains), ``lora`` (peft adapters on a frozen base) or ``qlora`` (LoRA on a
    bitsandbytes 4-bit/8-bit base; ``load_in_4bit``/``load_in_8bit`` with ``method: lora`` means qlora)."""
    precision: str = "fp32"
    """``fp32``; ``fp16-mixed`` (autocast + GradScaler); ``bf16-mixed`` (autocast); ``bf16`` (pure bf16 weights,
    gradients and optimizer state). The HF booleans ``bf16: true`` / ``fp16: true`` mean the mixed variants."""
    micro_batch_size: int | str = 1
    """Sequences per forward/backward (``per_device_train_batch_size``); ``auto``: the largest that fits
    (oomdoctor tune at start)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    global_batch_size: int | None = None
    """Effective batch (sequences per optimizer step). Fixes ``gradient_accumulation_steps`` = global / micro;
    the OOM guard keeps it constant when it shrinks the micro-batch."""
    seq_len: int = 2048
    """Maximum tokens per sequence (``max_seq_length``): longer samples are truncated; packing fills blocks."""
    max_steps: int = 100
    """Optimizer steps to run (the dataset is repeated as needed)."""
    learning_rate: float = 2e-4
    """Peak learning rate."""
    lr_scheduler_type: str = "linear"
    """``transformers.get_scheduler`` name (linear, cosine, constant, constant_with_warmup, ...)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW/Lion/Adafactor), L2 for SGD."""
    adam_beta1: float = 0.9
    """AdamW/Lion beta1."""
    adam_beta2: float = 0.999
    """AdamW/Lion beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    sgd_momentum: float = 0.0
    """SGD momentum (> 0 keeps one buffer per trainable parameter)."""
    max_grad_norm: float | None = 1.0
    """Gradient clipping norm (null: no clipping)."""
    optim: str = "adamw_torch"
    """HF ``TrainingArguments.optim`` name: adamw_torch, adamw_torch_fused, adamw_bnb_8bit, paged_adamw_32bit,
    paged_adamw_8bit, adafactor, sgd, lion_32bit. bitsandbytes 8-bit/paged optimizers need CUDA."""
    optim_impl: str = "foreach"
    """torch optimizer kernel: ``foreach`` (group-sized temporaries), ``fused`` (none) or ``for-loop``."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (``use_reentrant=False``): biggest activation saver, ~1/3 more compute."""
    r: int = 16
    """LoRA rank (peft ``LoraConfig.r``)."""
    lora_alpha: int = 32
    """LoRA scale numerator (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """LoRA target module names (q_proj, v_proj, ...) or ``all-linear``."""
    load_in_4bit: bool = False
    """Load the frozen base in 4-bit (bitsandbytes; QLoRA)."""
    load_in_8bit: bool = False
    """Load the frozen base in 8-bit (bitsandbytes LLM.int8())."""
    bnb_4bit_quant_type: str = "nf4"
    """4-bit data type: ``nf4`` or ``fp4``."""
    bnb_4bit_use_double_quant: bool = False
    """Quantize the 4-bit absmax constants again (~0.37 bit/parameter saved)."""
    bnb_4bit_compute_dtype: str | None = None
    """dtype the 4-bit matmuls run in; default follows ``precision`` (bf16 / fp16 / fp32)."""
    offload_optimizer: bool = False
    """Keep optimizer state (and fp32 master weights) on the CPU and run the optimizer step there."""
    offload_activations: bool = False
    """Move tensors saved for backward to (pinned) CPU memory: ``torch.autograd.graph.save_on_cpu``."""
    output_dir: str = "runs/train"
    """Checkpoints (``checkpoint-<step>/``) and ``summary.json`` go here."""
    save_steps: int = 50
    """Save a checkpoint every N optimizer steps (and at the end). 0: only at the end."""
    save_total_limit: int | None = 2
    """Keep only the newest N checkpoints (null: keep all)."""
    logging_steps: int = 1
    """Print a progress line every N optimizer steps."""
    seed: int = 42
    """Seed for init, shuffling and dropout."""
    gpu_mem: int | None = None
    """Memory cap in bytes (YAML accepts ``24GB``/``24GiB``): the budget for ``--dry-run`` and, on CPU, the live
    tensor-byte cap that raises torch's OutOfMemoryError (the flag ``--gpu-mem`` overrides it)."""
    max_oom_retries: int = 8
    """OOM recoveries allowed over the whole run before giving up (exit 4)."""
    device: str = "auto"
    """``auto`` (cuda when available, else cpu), ``cuda`` or ``cpu``."""

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
        return {"fp32": "float32", "fp16-mixed": "float16", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}[
            self.precision
        ]

    @property
    def plan_optimizer(self) -> str:
        return OPTIM_ALIASES[self.optim][0]

    @property
    def plan_optimizer_impl(self) -> str:
        return OPTIM_ALIASES[self.optim][1] or self.optim_impl

    @property
    def effective_batch_size(self) -> int | None:
        """Sequences per optimizer step (None while the micro-batch is ``auto`` and no global batch is set)."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if isinstance(self.micro_batch_size, int):
            return self.micro_batch_size * self.gradient_accumulation_steps
        return None

    @property
    def model_ref(self) -> str:
        """The model reference that ``oomdoctor.model.load.load_spec`` understands (directory / config / id)."""
        return self.model.path if self.model.init == "pretrained" else self.model.config  # type: ignore[return-value]

    def to_plan(self, micro_batch: int | None = None) -> Plan:
        """The memory model's :class:`oomdoctor.plan.Plan` for this run.

        ``micro_batch`` overrides the config's (needed while it is ``auto``: pass the tuned value)."""
        mb = micro_batch if micro_batch is not None else self.micro_batch_size
        if not isinstance(mb, int):
            raise BadInput(
                "micro_batch_size is 'auto': the plan needs a number",
                "run `oomdoctor tune` or pass to_plan(micro_batch=N)",
            )
        eff = self.effective_batch_size
        ga = max(1, -(-eff // mb)) if eff is not None else self.gradient_accumulation_steps
        method = self.method
        if self.quant is not None and method == "lora":
            method = "qlora"
        attn = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash"}[self.model.attn_implementation]
        on_head = "lm_head" in self.target_modules
        targets = tuple(t for t in self.target_modules if t != "lm_head") or ("lm_head",)
        return validate(
            Plan(
                method=method,  # type: ignore[arg-type]
                precision=self.precision,  # type: ignore[arg-type]
                optimizer=self.plan_optimizer,  # type: ignore[arg-type]
                optimizer_impl=self.plan_optimizer_impl,  # type: ignore[arg-type]
                sgd_momentum=self.sgd_momentum,
                attn=attn,  # type: ignore[arg-type]
                gradient_checkpointing=self.gradient_checkpointing,
                lora_r=self.r,
                lora_alpha=self.lora_alpha,
                lora_dropout=self.lora_dropout,
                lora_targets=targets,
                lora_on_head=on_head,
                quant=self.quant,  # type: ignore[arg-type]
                double_quant=bool(self.bnb_4bit_use_double_quant and self.quant in ("nf4", "fp4")),
                micro_batch=mb,
                seq_len=self.seq_len,
                grad_accum=ga,
                offload_optimizer=self.offload_optimizer,
                offload_activations=self.offload_activations,
            )
        )


# ------------------------------------------------------------------------------------------------ key table

# kind: "bool" | "int>=0" | "int>=1" | "float" | "float>=0" | "prob" | "str" | ("choice", options) | "size"
#       | "int|auto" | "str|list" | "list[str]" | "int>=1|null" | "float|null" | "str|null" | "choice|null"
_TOP_KINDS: dict[str, Any] = {
    "method": ("choice", ("full", "lora", "qlora")),
    "precision": ("choice", PRECISIONS),
    "micro_batch_size": "int|auto",
    "gradient_accumulation_steps": "int>=1",
    "global_batch_size": "int>=1|null",
    "seq_len": "int>=1",
    "max_steps": "int>=1",
    "learning_rate": "float>=0",
    "lr_scheduler_type": ("choice", SCHEDULERS),
    "warmup_steps": "int>=0",
    "weight_decay": "float>=0",
    "adam_beta1": "prob",
    "adam_beta2": "prob",
    "adam_epsilon": "float>=0",
    "sgd_momentum": "prob",
    "max_grad_norm": "float>=0|null",
    "optim": ("choice", tuple(OPTIM_ALIASES)),
    "optim_impl": ("choice", ("foreach", "fused", "for-loop")),
    "gradient_checkpointing": "bool",
    "r": "int>=1",
    "lora_alpha": "int>=1",
    "lora_dropout": "prob",
    "target_modules": "list[str]",
    "load_in_4bit": "bool",
    "load_in_8bit": "bool",
    "bnb_4bit_quant_type": ("choice", ("nf4", "fp4")),
    "bnb_4bit_use_double_quant": "bool",
    "bnb_4bit_compute_dtype": ("choice|null", COMPUTE_DTYPES),
    "offload_optimizer": "bool",
    "offload_activations": "bool",
    "output_dir": "str",
    "save_steps": "int>=0",
    "save_total_limit": "int>=1|null",
    "logging_steps": "int>=1",
    "seed": "int>=0",
    "gpu_mem": "size|null",
    "max_oom_retries": "int>=0",
    "device": ("choice", ("auto", "cuda", "cpu")),
}
_MODEL_KINDS: dict[str, Any] = {
    "path": "str|null",
    "config": "str|null",
    "init": ("choice", ("pretrained", "random")),
    "tokenizer": "str|null",
    "attn_implementation": ("choice", ATTN_IMPLS),
}
_DATA_KINDS: dict[str, Any] = {
    "path": "str|list",
    "format": ("choice", DATA_FORMATS),
    "type": ("choice", DATA_TYPES),
    "text_field": "str",
    "prompt_field": "str",
    "response_field": "str",
    "packing": "bool",
    "shuffle": "bool",
    "pad_to_multiple_of": "int>=1|null",
    "add_eos": "bool",
    "max_samples": "int>=1|null",
}
#: Accepted synonyms (HF / torchtune / axolotl spellings) -> canonical key.
_TOP_ALIASES = {
    "per_device_train_batch_size": "micro_batch_size",
    "max_seq_length": "seq_len",
    "max_seq_len": "seq_len",
    "sequence_len": "seq_len",
    "lora_r": "r",
    "lora_target_modules": "target_modules",
    "optimizer": "optim",
}
#: HF TrainingArguments booleans resolved into ``precision``.
_PRECISION_BOOLS = ("bf16", "fp16")


def _check_kind(key: str, value: Any, kind: Any, problems: list[str]) -> Any:
    """Return the normalized value or append a problem naming ``key``."""
    def bad(expect: str) -> None:
        problems.append(f"{key}: expected {expect}, got {value!r} ({type(value).__name__})")

    nullable = isinstance(kind, str) and kind.endswith("|null")
    if isinstance(kind, tuple):
        nullable = kind[0] == "choice|null"
    if value is None:
        if nullable:
            return None
        bad("a value (null is not allowed here)")
        return None
    base = kind[:-5] if isinstance(kind, str) and nullable else kind
    if isinstance(base, tuple):
        options = base[1]
        if value in options:
            return value
        close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.5)
        dym = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, options))}{dym}")
        return None
    if base == "bool":
        if isinstance(value, bool):
            return value
        bad("true or false")
        return None
    if base in ("int>=0", "int>=1", "int|auto"):
        if base == "int|auto" and value == "auto":
            return "auto"
        lo = 0 if base == "int>=0" else 1
        if isinstance(value, bool) or not isinstance(value, int):
            bad("an integer" + (" or 'auto'" if base == "int|auto" else ""))
            return None
        if value < lo:
            problems.append(f"{key}: must be >= {lo}, got {value}")
            return None
        return value
    if base in ("float", "float>=0", "prob"):
        if isinstance(value, str):
            try:  # YAML reads 2e-4 as a string (no dot in the mantissa): accept it
                value = float(value)
            except ValueError:
                bad("a number")
                return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad("a number")
            return None
        value = float(value)
        if base == "float>=0" and value < 0:
            problems.append(f"{key}: must be >= 0, got {value}")
            return None
        if base == "prob" and not 0 <= value < 1:
            problems.append(f"{key}: must be in [0, 1), got {value}")
            return None
        return value
    if base == "str":
        if isinstance(value, str) and value:
            return value
        bad("a non-empty string")
        return None
    if base == "str|list":
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            return list(value)
        bad("a path or a list of paths")
        return None
    if base == "list[str]":
        if isinstance(value, str) and value:
            return [s.strip() for s in value.split(",") if s.strip()]
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            return list(value)
        bad("a list of module names (e.g. [q_proj, v_proj]) or all-linear")
        return None
    if base == "size":
        try:
            return parse_size(value, what=key)
        except BadInput as exc:
            problems.append(exc.message)
            return None
    raise AssertionError(kind)  # pragma: no cover - table error


def _unknown(key: str, known: list[str], section: str) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    where = f" in {section}" if section else ""
    dym = f"; did you mean {close[0]!r}?" if close else ""
    return f"{key}: unknown key{where}{dym}"


def _section(raw: Any, kinds: dict[str, Any], prefix: str, problems: list[str], aliases: dict[str, str] | None = None,
             extra_known: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    aliases = aliases or {}
    known = list(kinds) + list(aliases) + list(extra_known)
    seen_from: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(f"{prefix}{key!r}: keys must be strings")
            continue
        if key in extra_known:
            continue
        canon = aliases.get(key, key)
        if canon not in kinds:
            problems.append(_unknown(f"{prefix}{key}", [f"{prefix}{k}" for k in known], ""))
            continue
        if canon in seen_from:
            if raw[seen_from[canon]] != value:
                problems.append(
                    f"{prefix}{key}: conflicts with {prefix}{seen_from[canon]} (same setting, different values)"
                )
            continue
        seen_from[canon] = key
        n_before = len(problems)
        v = _check_kind(prefix + key, value, kinds[canon], problems)
        if len(problems) == n_before:
            out[canon] = v
    return out


def _resolve_path(p: str, base_dirs: list[Path]) -> str | None:
    """First existing candidate of ``p`` relative to the current directory, the config's directory, the repo."""
    path = Path(os.path.expanduser(p))
    if path.is_absolute():
        return str(path) if path.exists() else None
    for base in base_dirs:
        cand = base / path
        if cand.exists():
            return str(cand.resolve())
    return None


def _looks_like_hub_id(p: str) -> bool:
    """``org/name`` (HF repo id syntax: letters, digits, ``-``, ``_``, ``.``), not a relative file path."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", p)) and not p.endswith(
        (".json", ".yaml", ".yml", ".jsonl", ".safetensors", ".bin"))


def parse_train_config(raw: Any, source: str = "config", base_dir: Path | None = None,
                       check_paths: bool = True) -> TrainConfig:
    """Validate a parsed YAML mapping into a :class:`TrainConfig` (every problem reported at once)."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigErrors(source, [f"the top level must be a mapping of keys, got {type(raw).__name__}"])
    bases = [Path.cwd()] + ([base_dir] if base_dir else []) + [REPO_ROOT]
    top = _section(raw, _TOP_KINDS, "", problems, _TOP_ALIASES, extra_known=("model", "dataset") + _PRECISION_BOOLS)

    # precision: ``precision`` or the HF booleans bf16/fp16 (mixed precision in HF).
    bools = {}
    for b in _PRECISION_BOOLS:
        if b in raw:
            v = raw[b]
            if not isinstance(v, bool):
                problems.append(f"{b}: expected true or false, got {v!r}")
            else:
                bools[b] = v
    if bools.get("bf16") and bools.get("fp16"):
        problems.append("bf16 and fp16 are both true: choose one precision")
    implied = "bf16-mixed" if bools.get("bf16") else "fp16-mixed" if bools.get("fp16") else None
    if implied:
        explicit = top.get("precision")
        if explicit is not None and explicit != implied and not (explicit == "bf16" and implied == "bf16-mixed"):
            problems.append(f"precision: {explicit!r} conflicts with {'bf16' if bools.get('bf16') else 'fp16'}: true")
        elif explicit is None:
            top["precision"] = implied

    # sections
    model_raw = raw.get("model")
    model: dict[str, Any] = {}
    if model_raw is None:
        problems.append("model: missing; give model.path (weights) or model.config + init: random")
    elif isinstance(model_raw, str):
        model = {"path": model_raw}
    elif not isinstance(model_raw, dict):
        problems.append(f"model: expected a mapping (path/config/init/tokenizer), got {type(model_raw).__name__}")
    else:
        model = _section(model_raw, _MODEL_KINDS, "model.", problems)
    data_raw = raw.get("dataset")
    data: dict[str, Any] = {}
    if data_raw is None:
        problems.append("dataset: missing; give dataset.path (jsonl/json/text/parquet file or directory)")
    elif isinstance(data_raw, str):
        data = {"path": data_raw}
    elif not isinstance(data_raw, dict):
        problems.append(f"dataset: expected a mapping (path/format/packing/...), got {type(data_raw).__name__}")
    else:
        data = _section(data_raw, _DATA_KINDS, "dataset.", problems)

    # model consistency + paths
    init = model.get("init")
    if isinstance(model_raw, (dict, str)):
        if init is None:
            init = "random" if model.get("config") and not model.get("path") else "pretrained"
            model["init"] = init
        if init == "pretrained":
            if not model.get("path"):
                problems.append("model.path: missing (init: pretrained loads weights from it); "
                                "or set model.config + init: random")
            if model.get("config") and model.get("path"):
                problems.append("model.config: only used with init: random (model.path already gives the config)")
        else:
            if not model.get("config") and not model.get("path"):
                problems.append("model.config: missing (init: random builds the model from a config)")
            if not model.get("config") and model.get("path"):
                model["config"] = model.pop("path")
            if not model.get("tokenizer"):
                problems.append("model.tokenizer: required with init: random (no weights directory to take it from)")
        if check_paths:
            for k in ("path", "tokenizer"):
                p = model.get(k)
                if p:
                    res = _resolve_path(p, bases)
                    if res is not None:
                        model[k] = res
                    elif not (k == "path" and _looks_like_hub_id(p)):
                        problems.append(f"model.{k}: {p!r} does not exist")
            c = model.get("config")
            if c:
                res = _resolve_path(c, bases)
                if res is not None:
                    model["config"] = res
                else:
                    from oomdoctor.model.load import registry_entry

                    if registry_entry(c) is None:
                        problems.append(f"model.config: {c!r} is neither a file/directory nor a bundled model id "
                                        "(`oomdoctor models`)")
    if data and check_paths:
        p = data.get("path")
        if p is None:
            problems.append("dataset.path: missing")
        else:
            paths = [p] if isinstance(p, str) else p
            resolved = []
            for one in paths:
                res = _resolve_path(one, bases)
                if res is None:
                    problems.append(f"dataset.path: {one!r} does not exist")
                resolved.append(res or one)
            data["path"] = resolved[0] if isinstance(p, str) else resolved
    elif data and data.get("path") is None:
        problems.append("dataset.path: missing")

    # combinations
    method = top.get("method", "full")
    l4, l8 = top.get("load_in_4bit", False), top.get("load_in_8bit", False)
    if l4 and l8:
        problems.append("load_in_4bit and load_in_8bit are both true: choose one")
    if method == "full" and (l4 or l8):
        problems.append("method: full cannot train a bitsandbytes-quantized base (load_in_4bit/8bit); "
                        "use method: qlora (LoRA adapters on the quantized base)")
    if method == "lora" and (l4 or l8):
        top["method"] = "qlora"
    if method == "qlora" and not (l4 or l8):
        top["load_in_4bit"] = True
    if top.get("bnb_4bit_use_double_quant") and l8:
        problems.append("bnb_4bit_use_double_quant: applies to 4-bit only, not load_in_8bit")
    if top.get("precision") == "fp16-mixed" and top.get("bnb_4bit_compute_dtype") == "bfloat16":
        problems.append("bnb_4bit_compute_dtype: bfloat16 conflicts with precision fp16-mixed")
    mb = top.get("micro_batch_size", 1)
    gbs = top.get("global_batch_size")
    ga_given = "gradient_accumulation_steps" in top
    if gbs is not None and isinstance(mb, int):
        if ga_given:
            if mb * top["gradient_accumulation_steps"] != gbs:
                problems.append(
                    f"global_batch_size: {gbs} != micro_batch_size {mb} x gradient_accumulation_steps "
                    f"{top['gradient_accumulation_steps']}; drop one of them"
                )
        elif gbs % mb:
            problems.append(f"global_batch_size: {gbs} is not a multiple of micro_batch_size {mb}")
        elif gbs < mb:
            problems.append(f"global_batch_size: {gbs} is smaller than micro_batch_size {mb}")
        else:
            top["gradient_accumulation_steps"] = gbs // mb
    if top.get("warmup_steps", 0) > top.get("max_steps", 100):
        problems.append(f"warmup_steps: {top['warmup_steps']} exceeds max_steps {top.get('max_steps', 100)}")
    optim = top.get("optim")
    if optim and OPTIM_ALIASES[optim][1] and "optim_impl" in top and top["optim_impl"] != OPTIM_ALIASES[optim][1]:
        problems.append(f"optim_impl: {top['optim_impl']!r} conflicts with optim {optim!r}")
    if top.get("offload_optimizer") and optim and OPTIM_ALIASES[optim][0].startswith("paged"):
        problems.append("offload_optimizer: paged optimizers already page state to the CPU; use one or the other")

    if problems:
        raise ConfigErrors(source, problems, "fix the keys above; docs/train.md lists every key")
    mcfg = ModelConfig(**model)
    dcfg = DatasetConfig(**data)
    cfg = TrainConfig(model=mcfg, dataset=dcfg, **top)
    # last gate: the memory model's own plan validation (names plan-level problems)
    if isinstance(cfg.micro_batch_size, int):
        try:
            cfg.to_plan()
        except BadInput as exc:
            raise ConfigErrors(source, [exc.message], exc.hint) from None
    return cfg


def load_train_config(path: str | os.PathLike) -> TrainConfig:
    """Read and validate a train YAML; raises :class:`ConfigErrors` listing every problem (exit 2)."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise BadInput(f"cannot read {p}: {exc.strerror or exc}",
                       "pass a train config such as configs/train/tiny-cpu.yaml") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise BadInput(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if raw is None:
        raise ConfigErrors(str(p), ["the file is empty"], "start from configs/train/tiny-cpu.yaml")
    return parse_train_config(raw, source=str(p), base_dir=p.resolve().parent)


# ------------------------------------------------------------------------------------------------ from plan / YAML


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
        attn_implementation={"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}[plan.attn],
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
        r=plan.lora_r,
        lora_alpha=plan.lora_alpha,
        lora_dropout=plan.lora_dropout,
        target_modules=list(plan.lora_targets)
        + (["lm_head"] if plan.lora_on_head and "lm_head" not in plan.lora_targets else []),
        load_in_4bit=quant in ("nf4", "fp4"),
        load_in_8bit=quant == "int8",
        bnb_4bit_quant_type=quant if quant in ("nf4", "fp4") else "nf4",
        bnb_4bit_use_double_quant=plan.double_quant,
        offload_optimizer=plan.offload_optimizer,
        offload_activations=plan.offload_activations,
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


# Comment for every key in the emitted YAML: what it does and what it costs in memory (torchtune style).
_COMMENTS: dict[str, str] = {
    "method": "full | lora | qlora. full: weights+grads+optimizer for every parameter (~16 B/param with AdamW fp32); "
              "lora: only adapters train (grads/optimizer tiny), base frozen; qlora: base stored 4-bit (~0.5 B/param)",
    "precision": "fp32 (4 B/param weights) | bf16-mixed / fp16-mixed (fp32 weights + low-precision copies, "
                 "activations halved) | bf16 (pure: 2 B/param weights, grads, optimizer state)",
    "micro_batch_size": "sequences per forward/backward (= per_device_train_batch_size). Activations and logits "
                        "scale linearly with it; 'auto' = largest that fits",
    "gradient_accumulation_steps": "micro-batches per optimizer step: no extra memory, multiplies the effective batch",
    "global_batch_size": "effective batch = micro_batch_size x gradient_accumulation_steps; kept constant when the "
                         "OOM guard halves the micro-batch",
    "seq_len": "max tokens per sequence: activations grow linearly (quadratically with eager attention), logits "
               "by seq_len x vocab x ~10 bytes",
    "max_steps": "optimizer steps (no memory effect)",
    "learning_rate": "peak learning rate (no memory effect)",
    "lr_scheduler_type": "transformers.get_scheduler name (no memory effect)",
    "warmup_steps": "linear warm-up steps (no memory effect)",
    "weight_decay": "decoupled weight decay (no memory effect)",
    "adam_beta1": "AdamW/Lion beta1",
    "adam_beta2": "AdamW/Lion beta2",
    "adam_epsilon": "AdamW epsilon",
    "sgd_momentum": "SGD momentum: > 0 adds one buffer per trainable parameter",
    "max_grad_norm": "gradient clipping (null: off); foreach clipping adds small temporaries",
    "optim": "adamw_torch: 8 B/trainable param of state | adamw_bnb_8bit: 2 B | paged_adamw_*: state in unified "
             "memory, paged to CPU under pressure (CUDA only) | adafactor: factored (~0) | sgd: 0 (4 B with "
             "momentum) | lion_32bit: 4 B",
    "optim_impl": "foreach: temporaries the size of a parameter group at step | fused: none | for-loop: one param",
    "gradient_checkpointing": "true: keep only each layer's input, recompute the rest in backward: activations "
                              "drop ~L-fold for ~33% more compute",
    "r": "LoRA rank: r x (in+out) trainable params per adapted linear (grads + optimizer state on those only)",
    "lora_alpha": "LoRA scale = lora_alpha / r (no memory effect)",
    "lora_dropout": "dropout on adapter inputs: > 0 keeps one mask/copy of each adapted input for backward",
    "target_modules": "modules that get adapters (all-linear = every linear but lm_head): more = more adapter "
                      "params and activations",
    "load_in_4bit": "store the frozen base in 4 bits (bitsandbytes): ~0.5 B/param instead of 2-4",
    "load_in_8bit": "store the frozen base in int8 (LLM.int8()): ~1 B/param",
    "bnb_4bit_quant_type": "nf4 (normal-float, QLoRA default) | fp4: same memory",
    "bnb_4bit_use_double_quant": "quantize the quantization constants: saves ~0.37 bit/param (~0.3 GB on 7B)",
    "bnb_4bit_compute_dtype": "dtype of 4-bit matmuls (null: follows precision); the dequantized tile is "
                              "temporary",
    "offload_optimizer": "optimizer state + fp32 master weights on the CPU, step runs there: frees 8-12 B per "
                         "trainable param on the GPU, costs PCIe copies every step",
    "offload_activations": "tensors saved for backward go to pinned CPU memory (save_on_cpu): activations leave "
                           "the GPU, costs PCIe copies",
    "output_dir": "checkpoints (checkpoint-<step>/) and summary.json",
    "save_steps": "checkpoint every N steps (0: only at the end); LoRA saves adapters only",
    "save_total_limit": "keep only the newest N checkpoints",
    "logging_steps": "progress line every N steps",
    "seed": "seed for init, shuffling, dropout",
    "gpu_mem": "memory budget for --dry-run (and the live-byte cap on CPU); the flag --gpu-mem overrides",
    "max_oom_retries": "OOM recoveries (micro-batch halvings) allowed before exit 4",
    "device": "auto | cuda | cpu",
}
_MODEL_COMMENTS = {
    "path": "local directory with config.json + weights (or a hub id, downloaded by transformers)",
    "config": "with init: random: bundled id, config.json or directory (built on meta, materialized once)",
    "init": "pretrained | random (random = smoke runs)",
    "tokenizer": "tokenizer dir / tokenizer.json (default: path)",
    "attn_implementation": "eager (seq x seq scores in memory) | sdpa | flash_attention_2 (no seq x seq)",
}
_DATA_COMMENTS = {
    "path": "jsonl / json / text / parquet file, a directory, or a list",
    "format": "auto | jsonl | json | text | parquet",
    "type": "auto | text | prompt_response (prompt masked from the loss)",
    "text_field": "record field with the text",
    "prompt_field": "record field with the prompt",
    "response_field": "record field with the response",
    "packing": "true: fill every sequence to seq_len (constant, worst-case memory); false: pad per micro-batch",
    "shuffle": "shuffle each epoch (seeded)",
    "pad_to_multiple_of": "round padded lengths up",
    "add_eos": "append EOS to each sample",
    "max_samples": "use only the first N samples",
}


def render_yaml(cfg: TrainConfig, header: str | None = None) -> str:
    """The config as YAML with every key commented with its effect (memory first). Round-trips through
    :func:`load_train_config`."""
    lines: list[str] = []
    if header:
        lines += [f"# {h}" if h else "#" for h in header.splitlines()]
    lines.append("# oomdoctor train config: run `oomdoctor train THIS.yaml` (--dry-run to check it fits first).")
    lines.append("# Keys follow Hugging Face TrainingArguments / peft LoraConfig / BitsAndBytesConfig names.")

    def section(name: str, obj: Any, comments: dict[str, str]) -> None:
        lines.append(f"{name}:")
        for f in fields(obj):
            v = getattr(obj, f.name)
            if v is None and f.name in ("path", "config", "tokenizer", "pad_to_multiple_of", "max_samples"):
                continue
            lines.append(f"  {f.name}: {_y(v)}  # {comments.get(f.name, '')}".rstrip(" #"))

    section("model", cfg.model, _MODEL_COMMENTS)
    section("dataset", cfg.dataset, _DATA_COMMENTS)
    groups = [
        ("memory: method and precision", ["method", "precision"]),
        ("memory: batch shape", ["micro_batch_size", "gradient_accumulation_steps", "global_batch_size", "seq_len"]),
        ("memory: activations", ["gradient_checkpointing", "offload_activations"]),
        ("memory: optimizer", ["optim", "optim_impl", "offload_optimizer", "sgd_momentum"]),
        ("memory: LoRA", ["r", "lora_alpha", "lora_dropout", "target_modules"]),
        ("memory: quantized base (bitsandbytes)", ["load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type",
                                                   "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"]),
        ("schedule (no memory effect)", ["max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
                                         "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                                         "max_grad_norm"]),
        ("run", ["output_dir", "save_steps", "save_total_limit", "logging_steps", "seed", "gpu_mem",
                 "max_oom_retries", "device"]),
    ]
    listed = {k for _, ks in groups for k in ks}
    missing = [f.name for f in fields(TrainConfig) if f.name not in listed and f.name not in ("model", "dataset")]
    assert not missing, missing
    for title, keys in groups:
        lines.append("")
        lines.append(f"# --- {title}")
        for k in keys:
            v = getattr(cfg, k)
            comment = _COMMENTS[k]
            if k == "gpu_mem" and v is not None:
                lines.append(f"{k}: {v}  # {format_bytes(v)}; {comment}")
                continue
            lines.append(f"{k}: {_y(v)}  # {comment}")
    return "\n".join(lines) + "\n"


__all__ = [
    "TrainConfig",
    "ModelConfig",
    "DatasetConfig",
    "load_train_config",
    "parse_train_config",
    "config_from_plan",
    "render_yaml",
    "OPTIM_ALIASES",
]
