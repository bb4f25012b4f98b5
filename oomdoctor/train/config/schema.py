"""Every key of a train YAML, described once: kind, default, help, memory note, accepted aliases.

The memory knobs come from the technique table (:data:`oomdoctor.plan.techniques.TECHNIQUES`: the same help,
default and memory note that diagnose/tune show); the keys only ``train`` has (schedule, checkpoints, the ``model:``
and ``dataset:`` sections) are described here. :class:`oomdoctor.train.config.sections.TrainConfig` takes its
defaults from this table, ``parse`` validates with it and ``render`` writes its comments from it.

kind: ``bool`` | ``int>=0`` | ``int>=1`` | ``float>=0`` | ``prob`` | ``str`` | ``("choice", options)`` | ``size``
| ``int|auto`` | ``str|list`` | ``list[str]``; a ``|null`` suffix (``choice|null`` for choices) allows null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomdoctor.plan.plan import DTYPE_NAMES
from oomdoctor.plan.techniques import (
    DEFAULTS,
    EFFECTIVE_BATCH,
    HF_ATTN_NAMES,
    HF_OPTIM_NAMES,
    OPTIM_VALUES,
    TECHNIQUES,
    Technique,
    technique,
)

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
#: ``report_to`` sinks (each through its own library, an optional extra).
REPORT_TO = ("tensorboard", "trackio", "wandb", "mlflow")
NO_MEMORY = "no memory effect"
#: The hint under every list of config problems: where each key is explained (a command every install has).
KEYS_HINT = "fix the keys above; `oomdoctor keys` lists every key with its meaning"


@dataclass(frozen=True)
class Key:
    """One key of a train YAML."""

    name: str
    """The key as written (Hugging Face name where one exists)."""
    kind: Any
    """Validation kind (module docstring)."""
    default: Any
    """Value when the key is absent."""
    help: str
    """What it does (docs/train.md)."""
    memory: str = NO_MEMORY
    """What it costs in memory: the comment ``render_yaml`` writes."""
    aliases: tuple[str, ...] = ()
    """Other accepted spellings."""
    group: str = "run"
    """Section of the emitted YAML."""
    technique: str | None = None
    """The plan knob it expresses (``oomdoctor.plan.techniques``), if any."""


_GROUPS = {
    "method": "memory: method and precision",
    "precision": "memory: method and precision",
    "micro_batch": "memory: batch shape",
    "grad_accum": "memory: batch shape",
    "seq_len": "memory: batch shape",
    "gradient_checkpointing": "memory: activations",
    "offload_activations": "memory: activations",
    "loss": "memory: activations",
    "tiled_mlp": "memory: activations",
    "optimizer": "memory: optimizer",
    "optimizer_impl": "memory: optimizer",
    "offload_optimizer": "memory: optimizer",
    "optimizer_in_backward": "memory: optimizer",
    "sgd_momentum": "memory: optimizer",
    "lora_r": "memory: LoRA",
    "lora_alpha": "memory: LoRA",
    "lora_dropout": "memory: LoRA",
    "lora_targets": "memory: LoRA",
    "adapter_dtype": "memory: LoRA",
    "double_quant": "memory: quantized base (bitsandbytes)",
    "kbit_upcast": "memory: quantized base (bitsandbytes)",
    "trainer": "memory: method and precision",
    **{
        k: "memory: scale-out (per rank)"
        for k in ("world_size", "strategy", "shard_group", "reshard_after_forward", "bucket_size", "offload_params")
    },
}


def _from_technique(t: Technique) -> Key:
    kind: Any = {
        "bool": "bool",
        "int>=1": "int>=1",
        "int>=1|null": "int>=1|null",
        "prob": "prob",
        "targets": "list[str]",
    }.get(t.kind)
    default = t.default
    if t.name == "optimizer":
        kind, default = ("choice", tuple(OPTIM_VALUES)), HF_OPTIM_NAMES[t.default]
    elif t.name == "micro_batch":
        kind = "int|auto"
    elif t.kind == "choice":
        kind = ("choice", tuple(c for c in t.choices if c is not None))
    if isinstance(default, tuple):
        default = list(default)
    aliases = t.aliases + ((t.name,) if t.key != t.name else ())
    return Key(t.key, kind, default, t.help, t.memory, aliases, _GROUPS[t.name], t.name)


#: Plan knobs that are plain top-level keys (``attn`` lives in ``model:``; ``quant``/``lora_on_head`` are expressed
#: through other keys; what train cannot execute yet is accepted at its default only; see :data:`PLAN_ONLY`).
_PLAIN = [t for t in TECHNIQUES if t.yaml_key != "" and t.train_executes and t.name != "attn"]
_Q = technique("quant")

TOP_KEYS: tuple[Key, ...] = tuple(_from_technique(t) for t in _PLAIN) + (
    Key(
        "global_batch_size",
        "int>=1|null",
        None,
        "effective batch (sequences per optimizer step); fixes gradient_accumulation_steps = global / micro",
        "no memory effect; kept constant when the OOM guard halves the micro-batch",
        (EFFECTIVE_BATCH,),
        "memory: batch shape",
    ),
    Key(
        "load_in_4bit",
        "bool",
        False,
        "load the frozen base in 4-bit (bitsandbytes; QLoRA)",
        "store the frozen base in 4 bits: ~0.5 B/param instead of 2-4",
        group="memory: quantized base (bitsandbytes)",
        technique="quant",
    ),
    Key(
        "load_in_8bit",
        "bool",
        False,
        "load the frozen base in 8-bit (bitsandbytes LLM.int8())",
        "store the frozen base in int8: ~1 B/param",
        group="memory: quantized base (bitsandbytes)",
        technique="quant",
    ),
    Key(
        "bnb_4bit_quant_type",
        ("choice", ("nf4", "fp4")),
        "nf4",
        "4-bit data type: nf4 or fp4",
        "nf4 (normal-float, QLoRA default) | fp4: same memory",
        group="memory: quantized base (bitsandbytes)",
        technique="quant",
    ),
    Key(
        "bnb_4bit_compute_dtype",
        ("choice|null", DTYPE_NAMES),
        None,
        "dtype the 4-bit matmuls run in; null follows precision (bf16 / fp16 / fp32)",
        "the dequantized tile is temporary",
        group="memory: quantized base (bitsandbytes)",
    ),
    Key(
        "max_steps",
        "int>=1|null",
        None,
        "optimizer steps to run; when set it overrides num_train_epochs, as in "
        "HF (-1 or null: unset; the dataset repeats as needed)",
        group="schedule",
    ),
    Key(
        "num_train_epochs",
        "float>=0",
        3.0,
        "passes over the training data when max_steps is unset (HF default 3; "
        "fractions allowed): steps = ceil(epochs x samples / effective batch)",
        group="schedule",
    ),
    Key("learning_rate", "float>=0", 2e-4, "peak learning rate", group="schedule"),
    Key("lr_scheduler_type", ("choice", SCHEDULERS), "linear", "transformers.get_scheduler name", group="schedule"),
    Key("warmup_steps", "int>=0", 0, "linear warm-up steps", group="schedule"),
    Key("weight_decay", "float>=0", 0.0, "decoupled weight decay (AdamW/Lion/Adafactor), L2 for SGD", group="schedule"),
    Key("adam_beta1", "prob", 0.9, "AdamW/Lion beta1", group="schedule"),
    Key("adam_beta2", "prob", 0.999, "AdamW/Lion beta2", group="schedule"),
    Key("adam_epsilon", "float>=0", 1e-8, "AdamW epsilon", group="schedule"),
    Key(
        "max_grad_norm",
        "float>=0|null",
        1.0,
        "gradient clipping norm (null: no clipping)",
        "foreach clipping adds small temporaries",
        group="schedule",
    ),
    Key("output_dir", "str", "runs/train", "checkpoints (checkpoint-<step>/) and summary.json go here"),
    Key(
        "save_steps",
        "int>=0",
        50,
        "checkpoint every N optimizer steps and at the end (0: only at the end)",
        "LoRA saves adapters only",
    ),
    Key("save_total_limit", "int>=1|null", 2, "keep only the newest N checkpoints (null: keep all)"),
    Key("logging_steps", "int>=1", 1, "progress line (and metrics.jsonl / report_to record) every N optimizer steps"),
    Key(
        "report_to",
        "list[str]",
        [],
        "where metrics go besides output_dir/metrics.jsonl: tensorboard (event files "
        "under output_dir/runs), trackio, wandb, mlflow (each through its own library: pip install it), or none",
    ),
    Key(
        "eval_steps",
        "int>=1|null",
        None,
        "evaluate every N optimizer steps (null: at the end only) when the "
        "dataset has an eval split (dataset.eval_split / dataset.eval_path)",
    ),
    Key(
        "per_device_eval_batch_size",
        "int>=1",
        8,
        "sequences per eval forward (HF default 8)",
        "eval holds no activations for backward, but its logits (batch x seq x vocab, fp32 upcast) can be the "
        "run's peak: priced by --dry-run",
    ),
    Key(
        "overwrite_output_dir",
        "bool",
        False,
        "output_dir already holds a run: replace it (same as --overwrite; "
        "without it, or --resume, such a run is refused)",
    ),
    Key(
        "merge_adapter",
        "bool",
        False,
        "LoRA/QLoRA: also save the base with the adapter merged in "
        "(output_dir/merged, loadable by AutoModelForCausalLM; QLoRA merges into a dequantized copy of the base)",
    ),
    Key("seed", "int>=0", 42, "seed for init, shuffling and dropout"),
    Key(
        "gpu_mem",
        "size|null",
        None,
        "memory cap in bytes (24GB / 24GiB accepted): the --dry-run budget and, on CPU, the live tensor-byte cap "
        "that raises torch's OutOfMemoryError (the flag --gpu-mem overrides it)",
    ),
    Key("max_oom_retries", "int>=0", 8, "OOM recoveries (micro-batch halvings) allowed over the run before exit 4"),
    Key("device", ("choice", ("auto", "cuda", "cpu")), "auto", "auto (cuda when available, else cpu) | cuda | cpu"),
)

#: Plan knobs a train YAML accepts under their plan names although train expresses them through other keys
#: (``attn`` -> ``model.attn_implementation``, ``quant`` -> ``load_in_4bit``/..., ``lora_on_head`` -> ``lm_head`` in
#: ``target_modules``) or cannot execute them yet (only their default is accepted).
PLAN_ONLY: tuple[str, ...] = ("attn", "attn_implementation", "quant", "lora_on_head") + tuple(
    t.name for t in TECHNIQUES if not t.train_executes
)
#: Validation kinds of the PLAN_ONLY keys.
PLAN_ONLY_KINDS: dict[str, Any] = {
    "attn": ("choice", tuple(HF_ATTN_NAMES) + ("flash_attention_2",)),
    "attn_implementation": ("choice", tuple(HF_ATTN_NAMES) + ("flash_attention_2",)),
    "quant": ("choice|null", tuple(c for c in _Q.choices if c is not None)),
    "lora_on_head": "bool",
    **{t.name: _from_technique(t).kind for t in TECHNIQUES if not t.train_executes},
}

MODEL_KEYS: tuple[Key, ...] = (
    Key(
        "path",
        "str|null",
        None,
        "a local directory with config.json + weights (from_pretrained loads it straight "
        "into the target dtype), or a Hugging Face id (downloaded by transformers)",
    ),
    Key(
        "config",
        "str|null",
        None,
        "with init: random: a bundled id (`oomdoctor models`), a config.json or a "
        "directory holding one; built on the meta device and materialized once in the target dtype",
    ),
    Key(
        "init",
        ("choice", ("pretrained", "random")),
        "pretrained",
        "pretrained (load the weights at path) | random (fresh weights from config: smoke runs)",
    ),
    Key(
        "tokenizer",
        "str|null",
        None,
        "tokenizer directory or tokenizer.json (default: path); required with init: random",
    ),
    Key(
        "attn_implementation",
        ("choice", tuple(HF_ATTN_NAMES.values())),
        HF_ATTN_NAMES[DEFAULTS["attn"]],
        technique("attn").help,
        technique("attn").memory,
        technique="attn",
    ),
)
DATASET_KEYS: tuple[Key, ...] = (
    Key(
        "path",
        "str|list",
        None,
        "jsonl / json / text / parquet file, a directory (every data file in it) or a list of files",
    ),
    Key(
        "format",
        ("choice", ("auto", "jsonl", "json", "text", "parquet")),
        "auto",
        "auto (from the extension) | jsonl | json | text (one sample per line) | parquet",
    ),
    Key(
        "type",
        ("choice", ("auto", "text", "prompt_completion", "messages", "prompt_response")),
        "auto",
        "auto (messages when records hold a `messages` list, prompt_completion when they hold prompt_field and "
        "completion_field, else text) | text (train on all tokens) | prompt_completion (prompt + completion: "
        "strings, or message lists rendered with the chat template) | messages (conversations rendered with the "
        "chat template); prompt_response is the older name of prompt_completion",
    ),
    Key("text_field", "str", "text", "record field with the text", aliases=("dataset_text_field",)),
    Key("prompt_field", "str", "prompt", "record field with the prompt"),
    Key(
        "completion_field",
        "str",
        "completion",
        "record field with the completion (left at completion, records with a `response` field are read too)",
        aliases=("response_field",),
    ),
    Key(
        "chat_template",
        "str|null",
        None,
        "jinja chat template for messages / conversational records: a template "
        "string, a file, or chatml (the bundled default); null: the tokenizer's own, else chatml",
    ),
    Key(
        "assistant_only_loss",
        "bool",
        False,
        "conversations: loss only on assistant replies (the template's "
        "{% generation %} spans; the bundled chatml template has them)",
    ),
    Key(
        "completion_only_loss",
        "bool|null",
        None,
        "prompt/completion records: mask the prompt from the loss (null: true for prompt_completion, as TRL)",
    ),
    Key(
        "packing",
        "bool",
        False,
        "pack several samples into each seq_len row (packing_strategy); they do not attend to each other with bfd",
        "true: rows close to seq_len (near worst-case memory, little padding); false: padded per micro-batch",
    ),
    Key(
        "packing_strategy",
        ("choice", ("bfd", "wrapped")),
        "bfd",
        "bfd: whole samples packed best-fit-decreasing (longer ones truncated), position_ids restart per sample and "
        "no attention_mask, so each attends only to itself | wrapped: the concatenated stream cut every seq_len "
        "tokens (samples split and attend across boundaries)",
    ),
    Key("shuffle", "bool", True, "shuffle samples each epoch (seeded by seed; the order is part of the checkpoint)"),
    Key("pad_to_multiple_of", "int>=1|null", None, "round padded lengths up to this multiple"),
    Key(
        "add_eos",
        "bool",
        True,
        "append the tokenizer's EOS token to text and prompt/completion samples when not "
        "already last (conversations end as the chat template writes them)",
    ),
    Key("max_samples", "int>=1|null", None, "use only the first N samples"),
    Key(
        "eval_split",
        "prob|null",
        None,
        "hold back this fraction of the samples (0.05 = 5 %) as the eval set (seeded; never trained on)",
    ),
    Key("eval_path", "str|list|null", None, "a separate eval file / directory / list (same format and fields)"),
)

TOP: dict[str, Key] = {k.name: k for k in TOP_KEYS}
MODEL: dict[str, Key] = {k.name: k for k in MODEL_KEYS}
DATASET: dict[str, Key] = {k.name: k for k in DATASET_KEYS}
#: Accepted synonyms -> canonical ``dataset:`` key.
DATASET_ALIASES: dict[str, str] = {a: k.name for k in DATASET_KEYS for a in k.aliases}
#: Accepted synonyms -> canonical top-level key.
TOP_ALIASES: dict[str, str] = {a: k.name for k in TOP_KEYS for a in k.aliases}
#: HF TrainingArguments booleans resolved into ``precision``.
PRECISION_BOOLS = ("bf16", "fp16")
#: Order of the emitted YAML's top-level groups.
GROUPS: tuple[str, ...] = (
    "memory: method and precision",
    "memory: batch shape",
    "memory: activations",
    "memory: optimizer",
    "memory: LoRA",
    "memory: quantized base (bitsandbytes)",
    "memory: scale-out (per rank)",
    "schedule",
    "run",
)


#: The kinds of :class:`Key`, as ``oomdoctor keys`` shows them.
_KIND_TEXT = {
    "bool": "true | false",
    "int>=0": "integer >= 0",
    "int>=1": "integer >= 1",
    "float>=0": "number >= 0",
    "float": "number",
    "prob": "number in [0, 1)",
    "str": "text",
    "size": "size (24GB, 24GiB)",
    "int|auto": "integer >= 1 | auto",
    "str|list": "path | list of paths",
    "list[str]": "list of names",
}


def kind_text(kind: Any) -> str:
    """What a key accepts, in words (``null`` added when it may be null)."""
    if isinstance(kind, tuple):
        return " | ".join(map(str, kind[1])) + (" | null" if kind[0].endswith("|null") else "")
    base, null = (kind[:-5], True) if kind.endswith("|null") else (kind, False)
    return _KIND_TEXT[base] + (" | null" if null else "")


@dataclass(frozen=True)
class KeyDoc:
    """One line of ``oomdoctor keys``."""

    name: str
    """The key as written: top-level, or ``model.path`` / ``dataset.packing``."""
    aliases: tuple[str, ...]
    """Other accepted spellings."""
    values: str
    """What it accepts (:func:`kind_text`)."""
    default: Any
    """Its value when absent."""
    help: str
    """What it does."""
    memory: str
    """Its memory effect (empty for keys without one)."""

    def to_dict(self) -> dict:
        return {
            "key": self.name,
            "aliases": list(self.aliases),
            "values": self.values,
            "default": self.default,
            "help": self.help,
            "memory": self.memory,
        }


def key_docs(pattern: str | None = None) -> list[KeyDoc]:
    """Every key, top-level keys by group (the emitted YAML's order), then ``model.*`` and ``dataset.*``; ``pattern``
    keeps those whose name, alias, help or memory note contains it (case-insensitive)."""
    rows = [(k.name, k) for g in GROUPS for k in TOP_KEYS if k.group == g]
    rows += [(f"model.{k.name}", k) for k in MODEL_KEYS] + [(f"dataset.{k.name}", k) for k in DATASET_KEYS]
    docs = [
        KeyDoc(name, k.aliases, kind_text(k.kind), k.default, k.help, "" if k.memory == NO_MEMORY else k.memory)
        for name, k in rows
    ]
    if not pattern:
        return docs
    p = pattern.lower()
    return [d for d in docs if any(p in t.lower() for t in (d.name, *d.aliases, d.help, d.memory))]


def default(name: str, section: dict[str, Key] = TOP) -> Any:
    """The default of a key (a fresh list for list defaults)."""
    v = section[name].default
    return list(v) if isinstance(v, list) else v


__all__ = [
    "DATASET",
    "DATASET_ALIASES",
    "DATASET_KEYS",
    "GROUPS",
    "KEYS_HINT",
    "KeyDoc",
    "REPORT_TO",
    "Key",
    "key_docs",
    "kind_text",
    "MODEL",
    "MODEL_KEYS",
    "PLAN_ONLY",
    "PLAN_ONLY_KINDS",
    "PRECISION_BOOLS",
    "TOP",
    "TOP_ALIASES",
    "TOP_KEYS",
    "default",
]
