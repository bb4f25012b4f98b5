"""What a train config cannot show by itself, checked against its model and its data before anything heavy runs.

``train --dry-run`` and ``train`` (before the model is built) report these problems together in one
:class:`~oomdoctor.errors.ConfigErrors` (exit 2), each naming its key, after the YAML's own validation
(``train.config.parse``):

* ``model``: transformers must accept the config the run builds — a ``model_type`` it knows, values its config class
  takes (``oomdoctor.model.inventory.transformers_config``) — for a config file, a bundled id or a local weights
  directory (a hub id is the training machine's to download: checked when its config is readable here);
* ``seq_len``: within the model's positions (:attr:`ModelSpec.position_limit`: the rule diagnose and tune apply);
* ``max_steps``: at least 1, or unset (``-1``/null: ``num_train_epochs`` decides) — for a config built in code too;
* ``dataset``: with ``packing``, the dataset must fill one row of ``seq_len`` tokens. Its sequences are tokenized as
  the run encodes them (special tokens, EOS, chat template) until ``seq_len`` tokens are counted (never the whole
  dataset). Without packing each sample is its own row, padded per micro-batch, and samples shorter than ``seq_len``
  are normal: the data loader refuses only a dataset with no token to predict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomdoctor.errors import BadInput, ConfigErrors
from oomdoctor.train.config import TrainConfig
from oomdoctor.train.config.schema import KEYS_HINT


def _problem(key: str | None, exc: BadInput) -> str:
    """One line of the list: ``key: message (hint)``; without ``key`` the message names its key itself."""
    return (f"{key}: " if key else "") + exc.message + (f" ({exc.hint})" if exc.hint else "")


def _model_problems(cfg: TrainConfig, notes: list[str]) -> list[str]:
    """transformers' verdict on the model config, then the positions ``seq_len`` needs. A hub id whose config is not
    readable here (offline) is the training machine's to download: a note, not a problem."""
    from oomdoctor.model.inventory import transformers_config
    from oomdoctor.model.load import load_config, load_spec

    key = "model.path" if cfg.model.init == "pretrained" else "model.config"
    ref = cfg.model_ref
    local = cfg.model.init == "random" or Path(ref).expanduser().exists()
    try:
        if local:
            raw, _, _ = load_config(ref)
            if "model_type" not in raw:
                return [f"{key}: {ref}: the config has no model_type"]
            transformers_config(raw, ref)
        spec = load_spec(ref)
    except BadInput as exc:
        if local:
            return [_problem(key, exc)]
        notes.append(f"seq_len not checked against the model's positions: {exc.message}")
        return []
    try:
        spec.check_seq_len(cfg.seq_len, "seq_len")
    except BadInput as exc:
        return [_problem(None, exc)]
    return []


def _max_steps_problem(cfg: TrainConfig) -> str | None:
    if cfg.max_steps is not None and cfg.max_steps < 1 and cfg.max_steps != -1:
        return f"max_steps: must be >= 1, got {cfg.max_steps} (-1 or null: unset, num_train_epochs sets the length)"
    return None


def _dataset_problem(cfg: TrainConfig, tokenizer: Any) -> str | None:
    """With packing: fewer tokens than one row of ``seq_len``."""
    from oomdoctor.train.data import dataset_tokens

    if not cfg.dataset.packing:
        return None
    try:
        n = dataset_tokens(cfg.dataset, tokenizer, cfg.seq_len)
    except BadInput as exc:
        return _problem("dataset", exc)
    if n >= cfg.seq_len:
        return None
    return (
        f"dataset: {n:,} tokens in all (encoded as the run encodes them), fewer than one packed row of seq_len "
        f"{cfg.seq_len:,}: not one full sequence can be formed (add data, lower seq_len to {n:,} or less, or "
        "set dataset.packing: false to train each sample as its own padded row)"
    )


def model_source(cfg: TrainConfig):
    """The executor's :class:`~oomdoctor.execute.load.ModelSource` of the ``model:`` section."""
    from oomdoctor.execute.load import ModelSource

    m = cfg.model
    return ModelSource(path=m.path, config=m.config, init=m.init, tokenizer=m.tokenizer)


def _tokenizer(cfg: TrainConfig, notes: list[str]) -> tuple[Any, str | None]:
    """(the run's tokenizer or None, a problem): a tokenizer on this machine that does not load is a problem, one
    named by a hub id is not checked here (a note)."""
    from oomdoctor.execute.load import load_tokenizer

    src = cfg.model.tokenizer or cfg.model.path
    if src is None:
        return None, None
    if not Path(src).expanduser().exists():
        notes.append(f"dataset length not checked: the tokenizer {src} is read on the training machine")
        return None, None
    try:
        return load_tokenizer(model_source(cfg)), None
    except BadInput as exc:
        return None, _problem("model.tokenizer", exc)


def check(cfg: TrainConfig, *, source: str = "train config", tokenizer: Any = None) -> list[str]:
    """Every problem of the module docstring at once (ConfigErrors naming ``source``); returns notes (what could
    not be checked here). ``tokenizer``: the run's, already loaded (else loaded here when the check needs it)."""
    notes: list[str] = []
    problems = _model_problems(cfg, notes)
    steps = _max_steps_problem(cfg)
    if steps:
        problems.append(steps)
    if cfg.dataset.packing:
        if tokenizer is None:
            tokenizer, problem = _tokenizer(cfg, notes)
            if problem:
                problems.append(problem)
        data = _dataset_problem(cfg, tokenizer) if tokenizer is not None else None
        if data:
            problems.append(data)
    if problems:
        raise ConfigErrors(source, problems, KEYS_HINT)
    return notes


__all__ = ["check", "model_source"]
