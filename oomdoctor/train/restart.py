"""The OOM guard across the ranks of a sharded (FSDP2) run: exit, let torchrun restart every rank, resume smaller.

Why not split in-process as single-process and DDP runs do: FSDP has collectives in every forward and backward, so
the peers of a rank that runs out of memory are already blocked in the next all-gather; catching the OOM and
"agreeing" on a smaller micro-batch hangs until the process-group timeout (measured, multi-gpu.md §6). What works:

1. the failing rank writes :data:`MARKER` (``oom-restart.json`` in the run directory: step, failed micro-batch,
   new micro-batch, phase, message, rank) atomically and exits with :data:`oomdoctor.errors.EXIT_OOM_RESTART` at
   once (``os._exit``: no collective, no teardown that could block);
2. torchrun's agent (``--max-restarts``) stops the other ranks and starts every rank again
   (``TORCHELASTIC_RESTART_COUNT`` + 1);
3. every rank reads the marker of the previous attempt (:func:`pending`), resumes from the last sharded checkpoint
   (or from the start when none was written yet) with micro-batch / 2 and accumulation x 2: the same effective
   batch, the same data order (a function of the data position), so no optimizer step is lost; the steps since the
   last checkpoint are recomputed (``save_steps`` is the knob: every step = least replay).

Exit 4 instead when the micro-batch is already 1 or torchrun has no restart left (``TORCHELASTIC_MAX_RESTARTS``).
Any other failure of a rank is recorded in a file of the launch (:func:`record_failure`) so that a restart torchrun
makes anyway exits at once with the same code instead of running the job again (torchrun restarts on every failure).
Markers name the launch by ``TORCHELASTIC_RUN_ID``: ``oomdoctor train`` gives each single-node launch a fresh one;
multi-node launches should pass a unique ``--rdzv-id``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

#: The marker a rank writes in the run directory before exiting for a restart.
MARKER = "oom-restart.json"
#: Testing aid: ``STEP:RANK`` raises torch's OutOfMemoryError in that rank's first micro-batch of optimizer step
#: STEP (1-based), on the job's first attempt only (the OOM of multi-gpu.md §6's ``oom_dist.py``).
INJECT_OOM_ENV = "OOMDOCTOR_INJECT_OOM"


@dataclass(frozen=True)
class Job:
    """This process's torchrun job (all empty when not under torchrun)."""

    run_id: str = ""
    """``TORCHELASTIC_RUN_ID``: the same for every rank and every restart of one launch."""
    attempt: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: 0 on the first attempt."""
    max_restarts: int = 0
    """``TORCHELASTIC_MAX_RESTARTS`` (``--max-restarts``)."""

    @property
    def restarts_left(self) -> bool:
        return self.attempt < self.max_restarts


def job() -> Job:
    def num(name: str) -> int:
        try:
            return int(os.environ.get(name, "0"))
        except ValueError:
            return 0

    return Job(
        os.environ.get("TORCHELASTIC_RUN_ID", ""), num("TORCHELASTIC_RESTART_COUNT"), num("TORCHELASTIC_MAX_RESTARTS")
    )


@dataclass(frozen=True)
class OOMRestart:
    """One OOM that restarted the job (the marker's content; also kept in the run's recoveries)."""

    step: int
    """Optimizer step (1-based) that ran out of memory."""
    failed_micro_batch: int
    new_micro_batch: int
    """The micro-batch every rank resumes with (half the failed one)."""
    phase: str
    """``forward`` or ``backward``."""
    message: str
    rank: int
    """The rank that ran out of memory."""
    run_id: str
    attempt: int
    """The attempt (restart count) that failed."""

    def to_dict(self) -> dict:
        return {**asdict(self), "replayed": True, "restart": True}


def write_marker(out_dir: str | Path, rec: OOMRestart) -> None:
    """Write the marker atomically (temp file, fsync, rename): a peer restarted at once reads all of it or none."""
    d = Path(out_dir)
    tmp = d / f".{MARKER}.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(asdict(rec), indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, d / MARKER)


def pending(out_dir: str | Path, current: Job) -> OOMRestart | None:
    """The OOM that caused this attempt: a marker of this launch written by the previous attempt, else None."""
    try:
        raw = json.loads((Path(out_dir) / MARKER).read_text())
        rec = OOMRestart(**raw)
    except (OSError, ValueError, TypeError):
        return None
    if not current.run_id or rec.run_id != current.run_id or rec.attempt != current.attempt - 1:
        return None
    return rec


def peer_ran_out(out_dir: str | Path, current: Job) -> bool:
    """Whether a rank of this attempt wrote an OOM marker (this rank's failure is then a consequence of it)."""
    try:
        raw = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(current.run_id) and raw.get("run_id") == current.run_id and raw.get("attempt") == current.attempt


def clear(out_dir: str | Path) -> None:
    """Remove the marker (the run finished: its recoveries are in summary.json and the checkpoints)."""
    (Path(out_dir) / MARKER).unlink(missing_ok=True)


def injected_oom(step: int, rank: int, current: Job) -> bool:
    """Whether :data:`INJECT_OOM_ENV` asks for an OOM in this rank's step ``step`` (first attempt only)."""
    spec = os.environ.get(INJECT_OOM_ENV, "")
    if not spec or current.attempt:
        return False
    s, _, r = spec.partition(":")
    return s.strip() == str(step) and (r.strip() or "0") == str(rank)


def _failure_file() -> Path | None:
    """A file in the directory torchrun's agent keeps for this launch on this node (the parent of its
    ``attempt_N/<rank>/error.json``: the same for every attempt, removed with the launch), None outside torchrun."""
    err = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not err or len(Path(err).parents) < 3:
        return None
    return Path(err).parents[2] / "oomdoctor-failed"


def record_failure(code: int, current: Job) -> None:
    """Remember that this launch failed with ``code`` (the first rank to fail wins) so restarts end at once."""
    path = _failure_file()
    if not current.run_id or path is None:
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w") as fh:
        fh.write(str(code))


def earlier_failure(current: Job, any_attempt: bool = False) -> int | None:
    """The exit code an earlier attempt of this launch failed with (not an OOM restart), else None;
    ``any_attempt``: this attempt's failures too (a peer that failed first)."""
    path = _failure_file()
    if not current.run_id or path is None or not (current.attempt or any_attempt):
        return None
    try:
        return int(path.read_text().strip() or 1)
    except (OSError, ValueError):
        return None


__all__ = [
    "MARKER",
    "INJECT_OOM_ENV",
    "Job",
    "job",
    "OOMRestart",
    "write_marker",
    "pending",
    "peer_ran_out",
    "clear",
    "injected_oom",
    "record_failure",
    "earlier_failure",
]
