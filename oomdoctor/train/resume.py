"""Resuming a run: what it has done (:class:`RunState`, ``trainer_state.json``), what identifies it (the fingerprint:
every setting but :data:`SAFE_TO_CHANGE`) and :func:`start_state`, which continues the newest readable checkpoint
of the same run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from oomdoctor.errors import BadInput
from oomdoctor.train.config import TrainConfig
from oomdoctor.train.run import Event, Run, any_rank

#: Config keys a resume may change: they alter how the run executes, not what it computes (the effective batch is
#: fingerprinted instead of micro-batch / accumulation; max_steps, as HF allows, only moves the end).
SAFE_TO_CHANGE = frozenset(
    {
        "max_steps",
        "num_train_epochs",
        "eval_steps",
        "per_device_eval_batch_size",
        "report_to",
        "merge_adapter",
        "overwrite_output_dir",
        "dataset.eval_path",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "offload_activations",
        "output_dir",
        "save_steps",
        "save_total_limit",
        "logging_steps",
        "gpu_mem",
        "max_oom_retries",
        "device",
        "model.attn_implementation",
        "optim_impl",
        "reshard_after_forward",
        "shard_group",
    }
)

#: config.json keys that decide the shapes of the weights a checkpoint holds.
SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "num_local_experts",
)


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict as one level of dotted keys (``{"dataset": {"path": p}}`` -> ``{"dataset.path": p}``)."""
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint(cfg: TrainConfig) -> dict:
    """Every setting that must match for a resume to continue the same run (JSON values), i.e. all config keys but
    :data:`SAFE_TO_CHANGE`, plus the effective batch."""
    flat = {k: v for k, v in flatten(asdict(cfg)).items() if k not in SAFE_TO_CHANGE}
    flat["effective_batch_size"] = cfg.effective_batch_size
    flat["model.shape"] = _model_shape(cfg)
    return json.loads(json.dumps(flat, default=str))


def _model_shape(cfg: TrainConfig) -> str:
    """The shape-deciding keys of the model's config.json (an edited config at the same path is a different run);
    ``?`` when there is no local config to read (a hub id)."""
    ref = Path(cfg.model_ref or "")
    f = ref / "config.json" if ref.is_dir() else ref
    try:
        c = json.loads(f.read_text())
    except (OSError, ValueError):
        return "?"
    return " ".join(f"{k}={c[k]}" for k in SHAPE_KEYS if k in c)


def fingerprint_changes(saved: dict, now: dict) -> list[str]:
    """``key: old -> new`` for every fingerprinted setting that differs. A key the saved fingerprint lacks (a setting
    oomdoctor added after the checkpoint was written, e.g. ``adapter_dtype``) was at its default then."""
    defaults = json.loads(json.dumps(flatten(asdict(TrainConfig())), default=str))
    saved = {**{k: defaults[k] for k in now if k not in saved and k in defaults}, **saved}
    keys = sorted(set(saved) | set(now))
    return [
        f"{k}: {saved.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}" for k in keys if saved.get(k) != now.get(k)
    ]


@dataclass
class RunState:
    """What a run has done so far: the part of a checkpoint that is not tensors (``trainer_state.json``)."""

    fingerprint: dict
    """Config keys that must match for a resume to continue the same run (:func:`fingerprint`)."""
    configured_micro_batch: int
    """The micro-batch the run started with (a changed config value wins over what the OOM guard learned)."""
    micro_batch: int
    """The micro-batch now (smaller after an OOM recovery)."""
    step: int = 0
    """Optimizer steps completed."""
    samples_seen: int = 0
    """Samples consumed (the data position)."""
    oom_recoveries: int = 0
    """OOMs recovered by splitting a micro-batch."""
    losses: list[float] = field(default_factory=list)
    """Loss of every optimizer step."""
    recoveries: list[dict] = field(default_factory=list)
    """Each recovery (``oomdoctor.execute.oom.Recovery.to_dict``)."""

    def to_json(self) -> dict:
        return asdict(self)

    def resumed(self, saved: dict) -> RunState:
        """This state continued from a checkpoint's ``trainer_state.json`` (``saved``)."""
        micro = self.micro_batch
        if saved.get("configured_micro_batch") == self.configured_micro_batch:
            micro = int(saved.get("micro_batch", micro))  # keep what the OOM guard learned
        return replace(
            self,
            step=int(saved["step"]),
            micro_batch=micro,
            samples_seen=int(saved.get("samples_seen", 0)),
            oom_recoveries=int(saved.get("oom_recoveries", 0)),
            losses=[float(x) for x in saved.get("losses", [])],
            recoveries=list(saved.get("recoveries", [])),
        )


def start_state(run: Run, resume: bool, emit: Event) -> tuple[RunState, str | None]:
    """A fresh state, or the state of the newest readable checkpoint (weights, optimizer, scheduler, scaler and RNG
    restored; an unreadable checkpoint is reported and the one before it used). Settings are compared before any
    tensor is loaded: a change outside :data:`SAFE_TO_CHANGE` is refused, listing every difference.
    Returns (state, checkpoint resumed from)."""
    from oomdoctor.train import checkpoint as ckpt

    cfg, micro = run.cfg, run.plan.micro_batch
    state = RunState(fingerprint=fingerprint(cfg), configured_micro_batch=micro, micro_batch=micro)
    if not resume:
        return state, None
    out_dir = Path(cfg.output_dir)
    candidates = list(reversed(ckpt.list_checkpoints(out_dir)))
    if not candidates:
        raise BadInput(f"--resume: no checkpoint in {out_dir}", "run without --resume to start fresh")
    for _, path in candidates:
        saved = _read_same_run(run, state, path, emit)
        if saved is None:
            continue
        resumed = state.resumed(saved)
        if saved.get("configured_micro_batch") != micro:  # the user changed micro_batch_size (e.g. to fix an OOM)
            emit({"type": "info", "message": f"micro_batch_size changed since the checkpoint: using {micro}"})
        emit({"type": "info", "message": f"resumed from {path} at step {resumed.step}"})
        return resumed, str(path)
    raise BadInput(
        f"--resume: no readable checkpoint in {out_dir} (every one is damaged)",
        "start over with --overwrite, or restore a checkpoint from a backup",
    )


def _read_same_run(run: Run, state: RunState, path: Path, emit: Event) -> dict | None:
    """The checkpoint at ``path`` loaded into the run (its ``trainer_state.json`` returned), or None when it is
    unreadable (reported; on any rank of a sharded run: every rank falls back together). BadInput when it was
    written by a different run."""
    from oomdoctor.train import checkpoint as ckpt

    try:
        saved_state = ckpt.read_state(path)
    except ckpt.CorruptCheckpoint as exc:
        emit({"type": "info", "message": f"{path} is unreadable ({exc}); trying the one before"})
        return None
    changes = fingerprint_changes(saved_state.get("fingerprint", {}), state.fingerprint)
    if changes:
        raise BadInput(
            f"--resume: {path} was written by a different run; changed settings:\n  " + "\n  ".join(changes),
            "resume with the original settings (safe to change: " + ", ".join(sorted(SAFE_TO_CHANGE)) + "), "
            "or start over with --overwrite or another output_dir",
        )
    saved, failed = None, None
    try:
        if run.averages_grads:
            saved = ckpt.load_sharded_checkpoint(
                path,
                model=run.loaded.model,
                is_peft=run.loaded.is_peft,
                optimizer=run.step.optimizer,
                scheduler=run.scheduler,
                rank=run.dist.rank,
                engine=run.engine,
            )
        else:
            saved = ckpt.load_checkpoint(
                path,
                model=run.loaded.model,
                is_peft=run.loaded.is_peft,
                optimizer=run.step.optimizer,
                scheduler=run.scheduler,
                scaler=run.step.scaler,
            )
    except ckpt.CorruptCheckpoint as exc:
        failed = exc
    if run.averages_grads and any_rank(failed is not None, run.dist):  # fall back together
        failed = failed or ckpt.CorruptCheckpoint("another rank could not read its part")
    if failed is not None:
        emit({"type": "info", "message": f"{path} is unreadable ({failed}); trying the one before"})
        return None
    return saved


__all__ = ["SAFE_TO_CHANGE", "SHAPE_KEYS", "RunState", "fingerprint", "fingerprint_changes", "flatten", "start_state"]
