"""The training loop of ``oomdoctor train``: data -> model -> guarded micro-batches -> optimizer step -> checkpoint.

The recipe (torchtune's split of recipe and library): :func:`train` opens the run directory, sets the run up
(``oomdoctor.train.setup``), continues a checkpoint (``oomdoctor.train.resume``) and hands it to :class:`TrainLoop`,
whose methods are the steps, the checkpoints and the outputs. The library it calls: ``train.sizing`` (budget,
micro-batch, prediction, host RAM), ``train.run`` (what a set-up run holds), ``train.signals`` (Ctrl-C),
``train.oom`` (what an OOM the guard cannot recover does), ``train.outputs`` (final model, summary),
``train.checkpoint`` / ``train.rundir`` / ``train.restart`` (the files).

One optimizer step consumes ``effective_batch_size`` samples (the data position advances by that much), computes
the number of target tokens ``N`` of all of them, and runs them through :class:`oomdoctor.execute.oom.OOMGuard` in
micro-batches; each micro-batch's loss is ``sum(token losses) / N`` (transformers' ``num_items_in_batch``), so the
step's gradient does not depend on how the samples were split. Then: GradScaler unscale (fp16), clipping,
optimizer step, scheduler step.

Memory accounting: on CUDA ``torch.cuda.max_memory_allocated`` (``--gpu-mem`` also caps the process with
``torch.cuda.set_per_process_memory_fraction``); on CPU a :class:`oomdoctor.execute.tracking.LiveBytes` dispatch mode
counts live tensor bytes (weights, gradients, optimizer state, activations) and, with ``--gpu-mem``, raises torch's
``OutOfMemoryError`` past the cap — the OOM guard is then exercised for real.

Data parallel (under torchrun): ``strategy`` ddp replicates the model (``oomdoctor.execute.dist``); fsdp shards it
with FSDP2 (``oomdoctor.execute.shard``: built on the meta device, filled from rank 0's copy, sharded checkpoints
through ``torch.distributed.checkpoint``), and an OOM there restarts the job smaller (``oomdoctor.train.restart``);
zero2/zero3 run the same steps through a DeepSpeed engine (``oomdoctor.execute.zero``), with DeepSpeed's checkpoints
and the same restarts.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from oomdoctor.errors import Interrupted, WriteFailed
from oomdoctor.execute import dist
from oomdoctor.execute.step import StepHooks
from oomdoctor.imports import cheap_imports
from oomdoctor.memory.runtime import set_allocator_env
from oomdoctor.noise import quiet_third_party
from oomdoctor.train.config import TrainConfig
from oomdoctor.train.oom import gave_up, optimizer_oom, restart_smaller, resume_smaller
from oomdoctor.train.outputs import TrainResult, save_outputs, write_summary
from oomdoctor.train.resume import RunState, flatten, start_state
from oomdoctor.train.run import Event, Run, any_rank
from oomdoctor.train.setup import resolve_topology, setup
from oomdoctor.train.signals import StopRequest
from oomdoctor.units import format_bytes

#: Uncapped CPU runs measure the peak over this many optimizer steps, then stop metering (optimizer state appears
#: at the first step; the second is the steady state).
METER_STEPS = 2
#: Testing aid: seconds to sleep after each optimizer step (lets a test SIGKILL a run mid-way deterministically).
STEP_DELAY_ENV = "OOMDOCTOR_STEP_DELAY_S"


def train(
    cfg: TrainConfig,
    *,
    gpu_mem: int | None = None,
    max_steps: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    engine: str = "analytic",
    on_event: Event | None = None,
    command: str = "oomdoctor train CONFIG",
    source: str = "train config",
) -> TrainResult:
    """Run the training described by ``cfg``. Raises ConfigErrors (exit 2) for what the config cannot run
    (``train.preflight``, every problem of the config named ``source`` at once) before ``output_dir`` is touched,
    UnrecoverableOOM (exit 4) after saving a checkpoint when even micro-batch 1 runs out of memory, WriteFailed
    (exit 74) when a checkpoint cannot be written (the previous one intact), and
    :class:`oomdoctor.errors.Interrupted` (exit 130) after saving one on Ctrl-C. ``command`` is how the user started
    the run (named in resume hints)."""
    set_allocator_env()
    quiet_third_party()
    cheap_imports()
    from oomdoctor.execute.load import load_tokenizer, quiet_hf
    from oomdoctor.train import checkpoint as ckpt
    from oomdoctor.train import restart
    from oomdoctor.train.preflight import check, model_source
    from oomdoctor.train.rundir import check_space, open_run_dir

    info = dist.from_env()
    # under torchrun only rank 0 talks, owns the run directory (its lock, checks) and writes
    emit = (on_event or (lambda e: None)) if info.is_main else (lambda e: None)
    quiet_hf()
    # one spelling of the run directory for every reader and writer (lock, checkpoints, restart marker, outputs)
    cfg = replace(resolve_topology(cfg, info.world_size), output_dir=str(Path(cfg.output_dir).expanduser()))
    if max_steps is not None:
        cfg = replace(cfg, max_steps=max_steps, warmup_steps=min(cfg.warmup_steps, max_steps))
    tok = load_tokenizer(model_source(cfg))
    notes = check(cfg, source=source, tokenizer=tok)
    current = restart.job()
    out_dir = Path(cfg.output_dir)
    oom = restart.pending(out_dir, current)
    # torchrun restarted the job for an OOM of this launch: continue it (never refuse or wipe the directory again).
    # A restart without that marker continues nothing: it opens the directory as a first attempt would.
    resume = resume or (oom is not None and bool(ckpt.list_checkpoints(out_dir)))
    with contextlib.ExitStack() as scope:
        if info.is_main:
            out_dir = scope.enter_context(
                open_run_dir(
                    cfg.output_dir,
                    resume=resume or oom is not None,
                    overwrite=(overwrite or cfg.overwrite_output_dir) and not current.attempt,
                    emit=lambda m: emit({"type": "info", "message": m}),
                    restarted=bool(current.attempt),
                )
            ).path
            if not current.attempt:
                restart.clear(out_dir)  # a marker of an earlier launch (a reused torchrun run id) is not this one's
        run = setup(cfg, gpu_mem, engine, emit, tok, notes)
        run.command = command
        if info.is_main:
            check_space(out_dir, run.checkpoint_bytes())
        dist.barrier(run.dist)  # the other ranks read checkpoints only once rank 0 has checked the directory
        state, resumed_from = start_state(run, resume, emit)
        if oom is not None:
            resume_smaller(state, oom, resumed_from, emit)
        res = TrainLoop(run, state, resumed_from, out_dir, emit).train()
    dist.shutdown()  # not on errors: tearing a group down while a peer is gone can block
    return res


class _GuardHooks(StepHooks):
    """The step's hooks for the OOM guard (did backward start?) and the CPU meter (optimizer state)."""

    def __init__(self, touch, meter):
        self.touch, self.meter = touch, meter

    def backward_start(self) -> None:
        self.touch.in_backward = True

    def optimizer_stepped(self, optimizer, step_index: int) -> None:
        from oomdoctor.execute.optim import CPUOffloadOptimizer

        if self.meter is not None and step_index == 0 and not isinstance(optimizer, CPUOffloadOptimizer):
            self.meter.track_optimizer(optimizer)


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    loss: float
    """Token-weighted loss of the step's samples."""
    tokens: int
    """Tokens run (padding included)."""
    loss_tokens: int
    """Tokens that count in the loss."""
    applied: bool
    """False when the fp16 scaler skipped the update (inf/NaN gradients)."""


class TrainLoop:
    """The steps of a set-up run, its checkpoints and its outputs: :meth:`train` runs them all, :meth:`step` one
    optimizer step, :meth:`save` one checkpoint."""

    def __init__(self, run: Run, state: RunState, resumed_from: str | None, out_dir: Path, emit: Event):
        from oomdoctor.execute.oom import GradTouch, OOMGuard

        self.run, self.state, self.out_dir, self.emit = run, state, out_dir, emit
        self.resumed_from = resumed_from
        self.last_ckpt: str | None = resumed_from
        self.first_step = state.step
        self.touch = GradTouch()
        self.guard = OOMGuard(micro_batch=state.micro_batch, max_retries=self._retries(), on_recovery=self._on_recovery)
        self.tokens = self.loss_tokens = self.skipped = 0
        self.last_loss: float | None = None
        self.eval_loss: float | None = None
        self.t0 = 0.0
        self.reporter: Any = None

    def _retries(self) -> int:
        """OOM recoveries left for the guard; none with the optimizer in backward (a split micro-batch would step
        every parameter twice), nor on sharded ranks or ZeRO (an OOM restarts the job: ``train.oom``)."""
        run = self.run
        if run.plan.optimizer_in_backward or run.restarts_on_oom or run.zero:
            return 0
        return max(0, run.cfg.max_oom_retries - self.state.oom_recoveries)

    def _on_recovery(self, rec) -> None:
        self.state.oom_recoveries += 1
        self.state.recoveries.append(rec.to_dict())
        self.emit({"type": "oom", **rec.to_dict(), "grad_accum": math.ceil(self.run.rank_batch / rec.new_micro_batch)})

    # -- the run ------------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """The steps of the run, then the final outputs and the summary. Interrupted after a checkpoint on Ctrl-C."""
        import torch

        run = self.run
        run.step.hooks = _GuardHooks(self.touch, run.meter)  # type: ignore[assignment]
        hooks = [p.register_post_accumulate_grad_hook(self._landed) for p in run.loaded.trainable]
        self.t0 = time.perf_counter()
        threads_before = torch.get_num_threads()
        if run.device.type == "cpu" and run.loaded.num_params < 5_000_000 and "OMP_NUM_THREADS" not in os.environ:
            # tiny models: thread fan-out costs more than the ops (measured 0.5 s vs 8 s for 4 steps on a loaded
            # 2-core box); real models keep torch's default. Restored when the run ends.
            torch.set_num_threads(1)
        self.reporter = self._reporter()
        self._emit_start()
        try:
            interrupted = self._steps()
        finally:
            for h in hooks:
                h.remove()
            torch.set_num_threads(threads_before)
            self.reporter.close()
        if interrupted:
            raise Interrupted(
                f"interrupted at step {self.state.step}/{run.total_steps}; checkpoint saved: {self.last_ckpt}",
                f"continue with `{run.command} --resume`",
            )
        return self._finish()

    def _landed(self, _param) -> None:
        """Post-accumulate-grad hook: a gradient of the running attempt landed (an OOM now needs a replay)."""
        self.touch.touched = True

    def _reporter(self) -> Any:
        """Metrics sinks (``report_to``) on rank 0; a null reporter on the others."""
        from oomdoctor.train.report import NullReporter, Reporter

        run = self.run
        if not run.dist.is_main:
            return NullReporter()
        return Reporter(
            self.out_dir,
            run.cfg.report_to,
            run_name=self.out_dir.name,
            config=flatten(asdict(run.cfg)),
            resumed_at=self.state.step,
        )

    def _emit_start(self) -> None:
        run = self.run
        self.emit(
            {
                "type": "start",
                "max_steps": run.total_steps,
                "step": self.state.step,
                "micro_batch": self.guard.micro_batch,
                "effective_batch": run.effective_batch,
                "device": str(run.device),
                "cap": run.cap,
                "samples": len(run.data),
                "trainable": run.loaded.num_trainable,
                "params": run.loaded.num_params,
                "plan": run.plan.label(),
            }
        )

    def _steps(self) -> bool:
        """Optimizer steps to the end, or to the step the ranks agree to stop after on Ctrl-C (a checkpoint saved:
        True). The uncapped CPU meter stops after :data:`METER_STEPS` steps."""
        run, state = self.run, self.state
        delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
        with contextlib.ExitStack() as meter_scope, StopRequest(self.emit, run.dist) as stop:
            if run.meter is not None:
                meter_scope.enter_context(run.meter)
            while state.step < run.total_steps:
                self._advance()
                if run.cap is None and state.step - self.first_step >= METER_STEPS:
                    meter_scope.close()  # uncapped: the peak is measured over the first steps only (no overhead)
                if stop.agreed():
                    if self.last_ckpt is None or not self.last_ckpt.endswith(f"checkpoint-{state.step}"):
                        self.last_ckpt = self.save()
                    return True
                if delay:
                    time.sleep(delay)
        return False

    def _advance(self) -> None:
        """One optimizer step and what follows it: the log, the eval and the checkpoint when due (a step the fp16
        scaler skipped is reported and not counted)."""
        run, state, cfg = self.run, self.state, self.run.cfg
        # ZeRO moves the gradients into its partitions: no .grad to check
        check = state.step == self.first_step and not run.plan.optimizer_in_backward and not run.zero
        out = self.step(check_grads=check)
        state.samples_seen += run.effective_batch
        state.micro_batch = self.guard.micro_batch
        self.tokens += out.tokens
        self.loss_tokens += out.loss_tokens
        if not out.applied:
            self.skipped += 1
            self.emit(
                {
                    "type": "info",
                    "message": f"fp16: inf/NaN gradients, update skipped (loss scale now "
                    f"{run.step.scaler.get_scale():g}); not counted as a step",
                }
            )
            return
        state.step += 1
        state.losses.append(out.loss)
        self.last_loss = out.loss
        self._log()
        last = state.step == run.total_steps
        if run.eval_samples and (last or (cfg.eval_steps and state.step % cfg.eval_steps == 0)):
            self.eval_loss = self._evaluate()
        if last or (cfg.save_steps and state.step % cfg.save_steps == 0):
            self.last_ckpt = self.save()

    # -- one optimizer step -------------------------------------------------------------------------------------
    def step(self, check_grads: bool) -> StepOutcome:
        """One optimizer step over ``effective_batch`` samples through the OOM guard (one host sync: the loss)."""
        import torch

        from oomdoctor.train.data import count_targets

        run, info = self.run, self.run.dist
        idx = run.order.take(self.state.samples_seen, run.effective_batch)
        # data parallel: the step's samples are dealt to the ranks; every rank divides by the global target count
        samples = [run.data.samples[i] for i in idx[info.rank :: info.world_size]]
        n_targets = count_targets(samples)
        if info.enabled:
            n_targets = int(dist.all_reduce_sum(torch.tensor(n_targets, dtype=torch.long), info))
        n_targets = max(1, n_targets)
        # FSDP2 and DeepSpeed average the reduce-scattered gradients over the ranks (gloo cannot sum with a custom
        # factor): each rank's loss is scaled up by the world size to keep the sum over ranks / global target count
        n_items = n_targets / info.world_size if run.averages_grads else n_targets
        loss, tokens = self._forward_backward(samples, n_items)
        if not run.averages_grads:  # FSDP / DeepSpeed reduce-scattered the gradients in backward
            dist.all_reduce_grads(run.loaded.trainable, info)
        if info.enabled:
            loss = dist.all_reduce_sum(loss.detach().clone(), info)
        if run.averages_grads:
            loss = loss / info.world_size
        if check_grads:
            self._warn_if_nothing_trains()
        return StepOutcome(float(loss), tokens, n_targets, self._optimizer_step())

    def _forward_backward(self, samples: list, n_items: float) -> tuple[Any, int]:
        """(loss, tokens run) of the step's samples, micro-batch by micro-batch through the guard; an OOM it cannot
        recover ends the run (``train.oom``)."""
        import torch

        from oomdoctor.execute.oom import OOMAtMicroBatchOne
        from oomdoctor.train.data import collate, flattens
        from oomdoctor.train.restart import injected_oom, job

        run, cfg, data = self.run, self.run.cfg, self.run.data
        tokens = 0
        inject = injected_oom(self.state.step + 1, run.dist.rank, job())

        def run_chunk(chunk: list):
            nonlocal tokens
            if inject:
                raise torch.OutOfMemoryError("out of memory (injected by OOMDOCTOR_INJECT_OOM)")
            batch = collate(
                chunk,
                data.pad_id,
                cfg.dataset.pad_to_multiple_of,
                data.reset_positions,
                flattens(cfg.model.attn_implementation),
            )
            batch = {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}
            tokens += int(batch["input_ids"].numel())
            try:
                # DDP: gradients are summed over the ranks once, after the step's backward (DeepSpeed: in each one)
                with contextlib.nullcontext() if run.zero else dist.no_sync(run.step.model):
                    return run.step.forward_backward(batch, num_items_in_batch=n_items)  # a tensor: no sync here
            except BaseException:
                self._after_failed_chunk()
                raise

        try:
            loss, _ = self.guard.run_step(self.state.step + 1, samples, run_chunk, self._zero_grads, self.touch)
        except OOMAtMicroBatchOne as exc:
            self._gave_up(exc)
        return loss, tokens

    def _after_failed_chunk(self) -> None:
        """One FSDP rank alone: the guard retries in-process, on a reset model. FSDP sets the sharded gradients
        itself (no post-accumulate hook fires): any backward may have left some, so the guard replays the step."""
        if self.run.sharded and not self.run.restarts_on_oom:
            from oomdoctor.execute.shard import reset_after_error

            reset_after_error(self.run.step.model)
            self.touch.touched = self.touch.touched or self.touch.in_backward

    def _zero_grads(self) -> None:
        self.run.step.optimizer.zero_grad(set_to_none=True)

    def _gave_up(self, exc) -> NoReturn:
        """The guard gave up: a sharded rank restarts the job smaller; otherwise save a checkpoint as of the start
        of this step (weights untouched, data not consumed) and exit 4."""
        from oomdoctor.execute.oom import free_memory

        if self.run.restarts_on_oom:
            restart_smaller(self.run, self.state, self.guard.micro_batch, exc, self.last_ckpt)
        self._zero_grads()
        free_memory()
        where = self.save()
        raise gave_up(self.run, self.state, exc, self.guard.micro_batch, where) from None

    def _optimizer_step(self) -> bool:
        """The optimizer (and, when it applied, the scheduler) step; an OOM there exits 4 without a checkpoint."""
        import torch

        from oomdoctor.execute.oom import is_oom

        try:
            applied = self.run.step.optimizer_step()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_oom(exc):
                raise
            raise optimizer_oom(self.run, self.state, self.last_ckpt) from None
        if applied:  # fp16: a step the scaler skipped (inf/NaN gradients) does not advance the schedule
            self.run.scheduler.step()
        return applied

    def _warn_if_nothing_trains(self) -> None:
        """Field notes 1.4: with GC + PEFT a missing input-grad hook trains nothing, silently."""
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        def local(g):  # a sharded gradient: this rank's shard (the ranks then agree)
            return g.to_local() if hasattr(g, "to_local") else g

        run = self.run
        with torch.no_grad(), _disable_current_modes():  # a check, not part of the budget
            live = any(p.grad is not None and bool(local(p.grad).abs().sum() > 0) for p in run.loaded.trainable)
        if run.sharded:
            live = any_rank(live, run.dist)
        if not live:
            msg = "no gradient reached the trainable parameters in the first step: nothing trains"
            run.notes.append(msg)
            self.emit({"type": "info", "message": "warning: " + msg})

    # -- checkpoints, logs, eval ----------------------------------------------------------------------------------
    def save(self) -> str:
        """A checkpoint of the step just completed (rank 0 writes it; the other ranks wait for it; sharded: every
        rank writes its shards). A disk that fills stops the run with WriteFailed (the previous checkpoint intact),
        whose hint says how much room one checkpoint needs and how to continue."""
        from oomdoctor.train import checkpoint as ckpt

        run, state = self.run, self.state
        state.micro_batch = self.guard.micro_batch
        try:
            path = self._write_checkpoint()
        except WriteFailed as exc:
            raise WriteFailed(
                exc.message,
                f"one checkpoint needs about {format_bytes(run.checkpoint_bytes())} free "
                f"there: free space or move output_dir, then continue with "
                f"`{run.command} --resume`",
            ) from None
        if path is None:  # a rank of a replicated run: rank 0 wrote it
            return str(ckpt.checkpoint_dir(run.cfg.output_dir, state.step))
        self.emit({"type": "checkpoint", "step": state.step, "path": str(path)})
        if not run.averages_grads:
            dist.barrier(run.dist)
        return str(path)

    def _write_checkpoint(self) -> Path | None:
        """Write ``checkpoint-<step>``: collectively when the ranks hold shards, else on rank 0 (None on the others,
        after waiting for it)."""
        from oomdoctor.train import checkpoint as ckpt
        from oomdoctor.train.restart import job

        run, state = self.run, self.state
        if run.averages_grads:
            return ckpt.save_sharded_checkpoint(
                run.cfg.output_dir,
                state.step,
                model=run.loaded.model,
                is_peft=run.loaded.is_peft,
                optimizer=run.step.optimizer,
                scheduler=run.scheduler,
                state=state.to_json(),
                rank=run.dist.rank,
                tag=job().run_id or "job",
                save_total_limit=run.cfg.save_total_limit,
                engine=run.engine,
            )
        if not run.dist.is_main:
            dist.barrier(run.dist)
            return None
        return ckpt.save_checkpoint(
            run.cfg.output_dir,
            state.step,
            model=run.loaded.model,
            is_peft=run.loaded.is_peft,
            optimizer=run.step.optimizer,
            scheduler=run.scheduler,
            scaler=run.step.scaler,
            state=state.to_json(),
            save_total_limit=run.cfg.save_total_limit,
        )

    def _grad_accum(self) -> int:
        """Micro-batches per step now (ceil(rank batch / micro-batch))."""
        return math.ceil(self.run.rank_batch / self.guard.micro_batch)

    def _log(self) -> None:
        """Every ``logging_steps`` and at the end: the step's figures to the sinks and the progress display."""
        run, state = self.run, self.state
        if state.step % run.cfg.logging_steps and state.step != run.total_steps:
            return
        el = time.perf_counter() - self.t0
        lr = run.scheduler.get_last_lr()[0]
        tps = self.tokens / el if el else 0.0
        peak = run.peak_bytes()
        epoch = run.epoch(state.samples_seen)
        self.reporter.log(
            state.step,
            {
                "epoch": epoch,
                "loss": state.losses[-1],
                "learning_rate": lr,
                "tokens_per_second": round(tps, 1),
                "peak_bytes": peak,
                "micro_batch": self.guard.micro_batch,
                "grad_accum": self._grad_accum(),
            },
        )
        self.emit(
            {
                "type": "step",
                "step": state.step,
                "max_steps": run.total_steps,
                "loss": state.losses[-1],
                "lr": lr,
                "tokens_per_s": tps,
                "peak_bytes": peak,
                "micro_batch": self.guard.micro_batch,
                "grad_accum": self._grad_accum(),
                "epoch": epoch,
            }
        )

    def _evaluate(self) -> float:
        """The eval loss now (no gradients; its memory is checked by the same cap as training)."""
        from oomdoctor.train.data import flattens
        from oomdoctor.train.evaluate import evaluate

        run, state = self.run, self.state
        loss = evaluate(
            run.step,
            run.eval_samples,
            pad_id=run.data.pad_id,
            batch_size=run.cfg.per_device_eval_batch_size,
            device=run.device,
            pad_to_multiple_of=run.cfg.dataset.pad_to_multiple_of,
            reset_positions=run.data.reset_positions,
            flatten=flattens(run.cfg.model.attn_implementation),
        )
        self.reporter.log(state.step, {"epoch": run.epoch(state.samples_seen), "eval_loss": loss})
        self.emit({"type": "eval", "step": state.step, "eval_loss": loss, "samples": len(run.eval_samples)})
        return loss

    # -- the end --------------------------------------------------------------------------------------------------
    def _finish(self) -> TrainResult:
        """The final model and tokenizer, then the summary (``summary.json``)."""
        run = self.run
        save_outputs(run, self.out_dir, self.emit)
        dist.barrier(run.dist)
        wall = time.perf_counter() - self.t0
        if self.skipped:
            run.notes.append(f"{self.skipped} fp16 update(s) skipped for inf/NaN gradients (not counted as steps)")
        res = self._result(wall)
        write_summary(run, self.out_dir, res)
        return res

    def _result(self, wall: float) -> TrainResult:
        run, state = self.run, self.state
        return TrainResult(
            optimizer_steps=state.step,
            effective_batch_size=run.effective_batch,
            micro_batch_size=self.guard.micro_batch,
            gradient_accumulation_steps=self._grad_accum(),
            oom_recoveries=state.oom_recoveries,
            measured_peak_bytes=run.peak_bytes(),
            memory=run.memory,
            final_loss=self.last_loss if self.last_loss is not None else (state.losses[-1] if state.losses else None),
            checkpoint=self.last_ckpt,
            first_loss=state.losses[0] if state.losses else None,
            losses=[float(x) for x in state.losses],
            tokens=self.tokens,
            loss_tokens=self.loss_tokens,
            tokens_per_second=self.tokens / wall if wall else 0.0,
            wall_seconds=wall,
            device=str(run.device),
            cap_bytes=run.cap,
            resumed_from=self.resumed_from,
            recoveries=list(state.recoveries),
            num_params=run.loaded.num_params,
            num_trainable_params=run.loaded.num_trainable,
            plan=run.plan.label(),
            output_dir=str(self.out_dir),
            epoch=run.epoch(state.samples_seen),
            world_size=run.dist.world_size,
            strategy=run.plan.strategy,
            restarts=run.dist.restarts,
            eval_loss=self.eval_loss,
            notes=run.notes,
        )


__all__ = ["train", "TrainLoop", "StepOutcome", "METER_STEPS", "STEP_DELAY_ENV"]
