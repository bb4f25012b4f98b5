"""The ``train`` config: a typed, strictly validated YAML file (what ``tune`` emits and ``train`` runs).

Layout (documented in docs/train.md): training knobs are **flat** top-level keys with Hugging Face
``TrainingArguments`` / peft ``LoraConfig`` / transformers ``BitsAndBytesConfig`` names, and two nested sections,
``model:`` and ``dataset:``, because they describe objects::

    model:   {path: ./my-llama}                       # local dir with weights (or a hub id, downloaded by HF)
    model:   {config: configs/x/config.json, init: random, tokenizer: bundled:tiny/tokenizer}
    dataset: {path: bundled:tiny/train.jsonl, packing: true}
    method: lora
    precision: bf16-mixed            # or HF booleans  bf16: true / fp16: true  (mixed precision)
    per_device_train_batch_size: 4   # alias micro_batch_size / micro_batch; int or "auto"
    gradient_accumulation_steps: 8   # or global_batch_size: 32
    ...

The ``settings`` that diagnose/tune print are valid top-level keys too (the plan's names are accepted aliases).

Modules: :mod:`~oomdoctor.train.config.schema` (every key, once: kinds, defaults, help, memory notes, aliases; the
memory knobs from the plan's technique table), :mod:`~oomdoctor.train.config.sections` (the dataclasses and
:func:`to_plan`), :mod:`~oomdoctor.train.config.parse` (validation, every problem at once) and
:mod:`~oomdoctor.train.config.render` (:func:`config_from_plan`, :func:`render_yaml`). No torch import here: the CLI
imports this package at start-up.
"""

from oomdoctor.plan.techniques import OPTIM_VALUES
from oomdoctor.train.config.parse import load_train_config, parse_train_config
from oomdoctor.train.config.render import config_from_plan, render_yaml
from oomdoctor.train.config.sections import DatasetConfig, ModelConfig, TrainConfig, to_plan

#: HF ``optim`` names (and the plan's) -> (plan optimizer, implementation they fix or None). Kept for importers.
OPTIM_ALIASES = OPTIM_VALUES

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "DatasetConfig",
    "load_train_config",
    "parse_train_config",
    "config_from_plan",
    "render_yaml",
    "to_plan",
    "OPTIM_ALIASES",
]
