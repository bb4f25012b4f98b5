"""What a finished run leaves in ``output_dir``: the final model and tokenizer (:func:`save_outputs`), loadable by
``from_pretrained``, and the summary (:class:`TrainResult`, ``summary.json`` through :func:`write_summary`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oomdoctor.files import write_file_atomic
from oomdoctor.train.run import Event, Run
from oomdoctor.train.rundir import FINAL_TMP_PREFIX, MERGED_DIR


@dataclass
class TrainResult:
    """What a run did (the ``--json`` summary; also written to ``<output_dir>/summary.json``)."""

    optimizer_steps: int
    """Optimizer steps completed (total, including those before a resume)."""
    effective_batch_size: int
    """Samples per optimizer step (unchanged by OOM recoveries)."""
    micro_batch_size: int
    """Micro-batch at the end (smaller than configured after an OOM recovery)."""
    gradient_accumulation_steps: int
    """Micro-batches per step at the end (ceil(effective / micro))."""
    oom_recoveries: int
    """OOMs recovered by splitting a micro-batch."""
    measured_peak_bytes: int
    """Peak live tensor bytes of this process's run (CUDA: max_memory_allocated; CPU: LiveBytes)."""
    memory: dict | None
    """Predicted breakdown (``oomdoctor.memory.estimate``; same keys as diagnose), None if it could not be priced."""
    final_loss: float | None
    """Loss of the last optimizer step (token-weighted mean)."""
    checkpoint: str | None
    """Path of the last checkpoint written."""
    first_loss: float | None = None
    """Loss of the run's first optimizer step (before a resume included)."""
    losses: list[float] = field(default_factory=list)
    """Loss of every optimizer step."""
    tokens: int = 0
    """Tokens processed (incl. padding) in this process."""
    loss_tokens: int = 0
    """Of ``tokens``: those that count in the loss (not padding, not masked prompt tokens)."""
    output_dir: str = ""
    """Where the final model (``save_pretrained``), tokenizer, checkpoints and this summary are."""
    epoch: float = 0.0
    """Passes over the training data done (HF's ``epoch``)."""
    world_size: int = 1
    """Processes of the data-parallel job (torchrun ``--nproc-per-node`` x nodes)."""
    strategy: str = "single"
    """``single``, ``ddp``, ``fsdp``, ``zero2`` or ``zero3`` (the plan's, after normalization)."""
    restarts: int = 0
    """Restarts torchrun made (``--max-restarts``): under fsdp, each one an OOM that resumed with half the
    micro-batch (``recoveries`` entries with ``restart: true``)."""
    eval_loss: float | None = None
    """Token-weighted loss on the eval set at the end (None without ``dataset.eval_split`` / ``eval_path``)."""
    tokens_per_second: float = 0.0
    """``tokens`` over ``wall_seconds``."""
    wall_seconds: float = 0.0
    """Seconds from the first step of this process to the saved outputs."""
    device: str = "cpu"
    """torch device the run trained on."""
    cap_bytes: int | None = None
    """Capacity enforced on the process (``--gpu-mem`` / ``gpu_mem``), None when uncapped."""
    resumed_from: str | None = None
    """Checkpoint this process continued from (None: from the start)."""
    recoveries: list[dict] = field(default_factory=list)
    """Every OOM recovery of the run (``oomdoctor.execute.oom.Recovery.to_dict``; restarts add ``restart: true``)."""
    num_params: int = 0
    """Parameters of the model."""
    num_trainable_params: int = 0
    """Of ``num_params``: those the optimizer updates."""
    plan: str = ""
    """The plan's label (``Plan.label``)."""
    notes: list[str] = field(default_factory=list)
    """What the run had to say besides its figures."""

    def to_dict(self) -> dict:
        return asdict(self)


def save_outputs(run: Run, out_dir: Path, emit: Event) -> None:
    """The final model in ``output_dir`` through ``save_pretrained`` (full: weights + config; LoRA: the adapter)
    and the tokenizer, loadable by ``from_pretrained``; written next to the checkpoints by rank 0 (sharded: the
    ranks first gather the whole state dict, on the CPU). ``merge_adapter``: the merged model too, in
    ``output_dir/merged``. Written aside first (``.tmp-final-<pid>``), moved in once complete: a failed write
    (disk full) leaves no partial model and raises WriteFailed naming the last checkpoint."""
    from torch.utils._python_dispatch import _disable_current_modes

    from oomdoctor.train.checkpoint import writing

    with _disable_current_modes():
        full = _full_state(run)
        if not run.dist.is_main:
            return
        tmp = out_dir / f"{FINAL_TMP_PREFIX}{os.getpid()}"
        with writing(tmp, "final model", out_dir, out_dir):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            _write_model(run, tmp, full)
            for entry in sorted(tmp.iterdir()):
                dest = out_dir / entry.name
                if dest.is_dir():  # a resumed, finished run writes its outputs again
                    shutil.rmtree(dest)
                os.replace(entry, dest)
            tmp.rmdir()
        if run.cfg.merge_adapter and run.loaded.is_peft:
            emit({"type": "info", "message": f"merged model (base + adapter): {out_dir / MERGED_DIR}"})


def _full_state(run: Run) -> dict | None:
    """The whole state dict of a sharded (FSDP2) or ZeRO model, gathered by every rank; None: the model holds it."""
    if run.sharded:
        from oomdoctor.train.checkpoint import full_model_state

        return full_model_state(run.loaded.model)
    if run.zero:
        from oomdoctor.execute.zero import full_state_dict

        return full_state_dict(run.step.model, 3 if run.plan.strategy == "zero3" else 2)
    return None


def _write_model(run: Run, where: Path, full: dict | None) -> None:
    """Model (or adapter), tokenizer and, with ``merge_adapter``, the merged model into ``where``."""
    run.loaded.model.save_pretrained(where, safe_serialization=True, state_dict=full)
    run.tokenizer.save_pretrained(where)
    if run.cfg.merge_adapter and run.loaded.is_peft:
        from oomdoctor.execute.build import save_merged

        save_merged(run.loaded.model, where / MERGED_DIR)
        run.tokenizer.save_pretrained(where / MERGED_DIR)


def write_summary(run: Run, out_dir: Path, res: TrainResult) -> None:
    """``summary.json`` (rank 0), atomically; then the OOM-restart marker goes (the summary and the checkpoints
    record the restarts)."""
    from oomdoctor.train.restart import clear

    if not run.dist.is_main:
        return
    write_file_atomic(
        out_dir / "summary.json",
        json.dumps(res.to_dict(), indent=1, default=str),
        what="summary",
        overwrite=True,
        hint=f"the model and the last checkpoint are in place: free space, then "
        f"`{run.command} --resume` writes the summary",
    )
    clear(out_dir)


__all__ = ["TrainResult", "save_outputs", "write_summary"]
