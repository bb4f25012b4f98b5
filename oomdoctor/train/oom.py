"""What ``train`` does when the OOM guard (:class:`oomdoctor.execute.oom.OOMGuard`) gives up.

- One process (or DDP): the loop saves a checkpoint as of the start of the failing step and exits 4 with
  :func:`gave_up`'s diagnosis (where, the budget, what the prediction holds) and what to run next.
- A sharded rank (FSDP2 / ZeRO on several ranks) cannot save after an OOM: :func:`restart_smaller` writes the OOM
  marker and exits for torchrun to restart every rank with half the micro-batch (``oomdoctor.train.restart``);
  the restarted ranks continue through :func:`resume_smaller`.
- An OOM in the optimizer step is not recoverable by splitting (:func:`optimizer_oom`).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from oomdoctor.errors import UnrecoverableOOM
from oomdoctor.train.restart import OOMRestart
from oomdoctor.train.resume import RunState
from oomdoctor.train.run import Event, Run
from oomdoctor.units import format_bytes

if TYPE_CHECKING:  # torch, imported by the loop only once a run starts
    from oomdoctor.execute.oom import OOMAtMicroBatchOne


def diagnosis(run: Run, state: RunState, phase: str, reason: str, message: str, micro: int = 1) -> str:
    """What an unrecoverable OOM says: where, the budget, what the prediction holds."""
    lines = [
        f"out of memory at step {state.step + 1} in {phase} with micro-batch {micro} x seq_len "
        f"{run.cfg.seq_len} ({reason})"
    ]
    if run.cap is not None:
        held = format_bytes(run.meter.current) if run.meter else "?"
        lines.append(
            f"budget {format_bytes(run.cap)}; held outside the failed micro-batch (weights, gradients, "
            f"optimizer state): {held}: too little is left for one sample's activations"
        )
    if run.memory:
        comps = {k[:-6]: v for k, v in run.memory.items() if k.endswith("_bytes") and not k.startswith("peak") and v}
        top = sorted(comps.items(), key=lambda kv: -kv[1])[:4]
        lines.append(
            f"predicted (micro-batch {run.plan.micro_batch}): " + ", ".join(f"{k} {format_bytes(v)}" for k, v in top)
        )
    lines.append(f"OOM message: {message.splitlines()[0][:200]}")
    return "\n".join(lines)


def gave_up(run: Run, state: RunState, exc: OOMAtMicroBatchOne, micro: int, where: str) -> UnrecoverableOOM:
    """Exit 4 after the guard gave up at ``micro`` and the checkpoint ``where`` was saved."""
    reason, micro = _zero_alone(run, exc.reason, micro)
    return UnrecoverableOOM(
        diagnosis(run, state, exc.phase, reason, exc.message, micro) + f"\ncheckpoint saved: {where}",
        f"fix the plan (`{run.command} --dry-run --gpu-mem SIZE` lists changes that fit), "
        f"then `{run.command} --resume`",
    )


def _zero_alone(run: Run, reason: str, micro: int) -> tuple[str, int]:
    """(reason, micro-batch) of an unrecoverable OOM; one ZeRO process does not split (DeepSpeed's partial gradients
    cannot be undone in-process) and says so."""
    if run.zero and not run.restarts_on_oom and micro > 1:
        return (
            f"one DeepSpeed ZeRO process does not split a micro-batch after an OOM; set micro_batch_size {micro // 2}",
            micro,
        )
    return reason, 1


def optimizer_oom(run: Run, state: RunState, last_ckpt: str | None) -> UnrecoverableOOM:
    """Exit 4 for an OOM in the optimizer step (no checkpoint: the in-memory state may be partially updated)."""
    return UnrecoverableOOM(
        f"out of memory in the optimizer step {state.step + 1} (the optimizer state is allocated at the "
        f"first step; a smaller micro-batch does not shrink it). The in-memory state may be "
        f"partially updated, so no checkpoint was written; last checkpoint: {last_ckpt or 'none'}",
        "use a leaner optimizer (optim: adamw_bnb_8bit / adafactor), offload_optimizer: true or "
        f"LoRA; check with `{run.command} --dry-run --gpu-mem SIZE`",
    )


def restart_smaller(run: Run, state: RunState, micro: int, exc: OOMAtMicroBatchOne, last_ckpt: str | None) -> None:
    """A sharded rank ran out of memory: no collective can agree on a split (the peers are inside FSDP's
    all-gathers), so write the OOM marker and exit for torchrun to restart every rank with half the micro-batch
    (``oomdoctor.train.restart``); exit 4 instead when the micro-batch is 1, the OOM budget or the restarts are
    spent."""
    from oomdoctor.errors import EXIT_OOM_RESTART
    from oomdoctor.train import restart

    current = restart.job()
    spent = state.oom_recoveries >= run.cfg.max_oom_retries or not current.restarts_left
    if micro <= 1 or spent:
        why = (
            "micro-batch 1"
            if micro <= 1
            else (
                f"torchrun has no restart left (--max-restarts {current.max_restarts})"
                if not current.restarts_left
                else f"max_oom_retries {run.cfg.max_oom_retries} reached"
            )
        )
        raise UnrecoverableOOM(
            diagnosis(run, state, exc.phase, why, exc.message, micro)
            + f"\nlast checkpoint: {last_ckpt or 'none'} (a sharded rank cannot save after an OOM)",
            f"fix the plan (`{run.command} --dry-run --gpu-mem SIZE` lists changes that fit), then "
            f"`{run.command} --resume`" + ("" if micro <= 1 else ", or allow more with --max-restarts"),
        )
    rec = OOMRestart(
        step=state.step + 1,
        failed_micro_batch=micro,
        new_micro_batch=max(1, micro // 2),
        phase=exc.phase,
        message=exc.message.splitlines()[0][:300],
        rank=run.dist.rank,
        run_id=current.run_id,
        attempt=current.attempt,
    )
    restart.write_marker(run.cfg.output_dir, rec)
    print(
        f"rank {run.dist.rank}: out of memory at step {rec.step} ({rec.phase}) with micro-batch {micro}; "
        f"restarting every rank with micro-batch {rec.new_micro_batch}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_OOM_RESTART)  # no teardown: a collective there would block on the peers


def resume_smaller(state: RunState, oom: OOMRestart, resumed_from: str | None, emit: Event) -> None:
    """After an OOM restart: every rank continues with the marker's micro-batch (the accumulation grows, the
    effective batch stays) and records the recovery."""
    state.micro_batch = min(state.micro_batch, oom.new_micro_batch)
    state.oom_recoveries += 1
    state.recoveries.append(oom.to_dict())
    emit(
        {
            "type": "info",
            "message": f"restarted after rank {oom.rank} ran out of memory at step {oom.step} "
            f"({oom.phase}) with micro-batch {oom.failed_micro_batch}: every rank "
            f"continues from {resumed_from or 'the start'} with micro-batch "
            f"{state.micro_batch}, same effective batch",
        }
    )


__all__ = ["diagnosis", "gave_up", "optimizer_oom", "restart_smaller", "resume_smaller"]
