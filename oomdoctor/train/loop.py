"""The training loop of ``oomdoctor train``: data -> model -> guarded micro-batches -> optimizer step -> checkpoint.

One optimizer step consumes ``effective_batch_size`` samples (the data position advances by that much), computes
the number of target tokens ``N`` of all of them, and runs them through :class:`oomdoctor.train.oom.OOMGuard` in
micro-batches; each micro-batch's loss is ``sum(token losses) / N`` (transformers' ``num_items_in_batch``), so the
step's gradient does not depend on how the samples were split. Then: GradScaler unscale (fp16), clipping,
optimizer step, scheduler step.

Memory accounting: on CUDA ``torch.cuda.max_memory_allocated`` (``--gpu-mem`` also caps the process with
``torch.cuda.set_per_process_memory_fraction``); on CPU a :class:`oomdoctor.execute.tracking.LiveBytes` dispatch mode counts
live tensor bytes (weights, gradients, optimizer state, activations) and, with ``--gpu-mem``, raises torch's
``OutOfMemoryError`` past the cap — the OOM guard is then exercised for real.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from oomdoctor.errors import BadInput, UnrecoverableOOM
from oomdoctor.gpu import detect_gpu
from oomdoctor.noise import quiet_third_party
from oomdoctor.plan.batch import DEFAULT_MICRO_LIMIT, choose_micro_batch, max_fitting
from oomdoctor.plan.budget import Budget, resolve_budget
from oomdoctor.train.config import TrainConfig
from oomdoctor.units import format_bytes

#: Testing aid: seconds to sleep after each optimizer step (lets a test SIGKILL a run mid-way deterministically).
STEP_DELAY_ENV = "OOMDOCTOR_STEP_DELAY_S"


def set_allocator_env() -> None:
    """``expandable_segments`` avoids fragmentation OOMs (torchtune #1185); setdefault: a user's value wins. Must run
    before CUDA is initialized (the allocator reads it once)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


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
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    """Tokens processed (incl. padding) in this process."""
    tokens_per_second: float = 0.0
    wall_seconds: float = 0.0
    device: str = "cpu"
    cap_bytes: int | None = None
    resumed_from: str | None = None
    recoveries: list[dict] = field(default_factory=list)
    num_params: int = 0
    num_trainable_params: int = 0
    plan: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


Event = Callable[[dict], None]


def predict_memory(cfg: TrainConfig, micro_batch: int, engine: str = "analytic"):
    """(spec, plan, MemoryBreakdown or None, note) for the config at ``micro_batch``."""
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec

    spec = load_spec(cfg.model_ref)
    plan = cfg.to_plan(micro_batch=micro_batch)
    try:
        return spec, plan, estimate(spec, plan, engine), None
    except (ImportError, ModuleNotFoundError) as exc:
        return spec, plan, None, f"memory engine {engine!r} unavailable: {exc}"


def run_budget(cfg: TrainConfig, gpu_mem: int | None, *, on_cpu: bool) -> Budget | None:
    """The budget of a run and of its dry run (``oomdoctor.plan.budget``, the rule every verb uses): ``--gpu-mem``,
    else the config's ``gpu_mem``, else the GPU's free memory (NVML; not for a CPU run), else None. On the CPU the
    capacity caps live tensor bytes, so the rule counts ``peak_allocated``."""
    if gpu_mem is not None:
        return resolve_budget(gpu_mem, None, None, on_cpu=on_cpu)
    if cfg.gpu_mem is not None:
        return resolve_budget(cfg.gpu_mem, None, None, gpu_mem_source="config gpu_mem", on_cpu=on_cpu)
    return None if on_cpu else resolve_budget(None, None, detect_gpu())


def auto_micro_batch(cfg: TrainConfig, budget: Budget | None, engine: str = "analytic") -> int:
    """``micro_batch_size: auto``: the largest micro-batch whose predicted memory fits ``budget`` (``Budget.fits``,
    priced as the dry run prices the config: ``cfg.to_plan(micro_batch=b)``, accumulation included), by
    :func:`oomdoctor.plan.batch.max_fitting`; with a ``global_batch_size`` the largest divisor of it, so the effective
    batch stays exact."""
    from oomdoctor.errors import DoesNotFit
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec

    if budget is None:
        raise BadInput("micro_batch_size: auto needs a memory budget",
                       "pass --gpu-mem SIZE (or gpu_mem: in the config), or run on a GPU")
    spec = load_spec(cfg.model_ref)
    gbs = cfg.global_batch_size
    cache: dict[int, int] = {}

    def needed(b: int) -> int:
        if b not in cache:
            cache[b] = budget.needed(estimate(spec, cfg.to_plan(micro_batch=b), engine))
        return cache[b]

    upper = min(DEFAULT_MICRO_LIMIT, gbs) if gbs else DEFAULT_MICRO_LIMIT
    best = max_fitting(lambda b: needed(b) <= budget.limit_bytes, upper)
    if best < 1:
        cap = format_bytes(budget.capacity_bytes, binary=False).replace(" ", "")
        raise DoesNotFit(
            f"micro_batch_size: auto: not even micro-batch 1 fits {budget.describe()} (predicted "
            f"{format_bytes(needed(1))})",
            f"run `oomdoctor train CONFIG --dry-run --gpu-mem {cap}` for the changes that fit",
        )
    return choose_micro_batch(best, gbs).micro_batch


def _fingerprint(cfg: TrainConfig) -> dict:
    """Keys that must match for a resume to continue the same run."""
    return {
        "model": cfg.model_ref, "method": cfg.method, "precision": cfg.precision, "optim": cfg.optim,
        "seq_len": cfg.seq_len, "seed": cfg.seed, "effective_batch_size": cfg.effective_batch_size,
        "r": cfg.r if cfg.method != "full" else None, "quant": cfg.quant, "offload_optimizer": cfg.offload_optimizer,
        "dataset": str(cfg.dataset.path), "packing": cfg.dataset.packing,
    }


def train(cfg: TrainConfig, *, gpu_mem: int | None = None, max_steps: int | None = None, resume: bool = False,
          engine: str = "analytic", on_event: Event | None = None) -> TrainResult:
    """Run the training described by ``cfg``. Raises UnrecoverableOOM (exit 4) after saving a checkpoint when even
    micro-batch 1 runs out of memory."""
    set_allocator_env()
    quiet_third_party()
    import torch

    from oomdoctor.train import checkpoint as ckpt
    from oomdoctor.train.data import SampleOrder, collate, count_targets, tokenize
    from oomdoctor.train.model import autocast_dtype, build_model, load_tokenizer, quiet_hf, resolve_device
    from oomdoctor.train.oom import GradTouch, OOMAtMicroBatchOne, OOMGuard, free_memory, is_oom
    from oomdoctor.train.optim import CPUOffloadOptimizer, activation_offload, make_optimizer, make_scheduler

    emit = on_event or (lambda e: None)
    quiet_hf()
    if max_steps is not None:
        cfg = replace(cfg, max_steps=max_steps, warmup_steps=min(cfg.warmup_steps, max_steps))
    device = resolve_device(cfg)
    budget = run_budget(cfg, gpu_mem, on_cpu=device.type == "cpu")
    # the run cap enforces a capacity the user named (--gpu-mem / gpu_mem); NVML free memory needs no cap
    cap = budget.capacity_bytes if budget is not None and budget.source != "nvml free" else None
    notes: list[str] = []
    if device.type == "cpu" and cfg.precision == "fp16-mixed":
        notes.append("fp16 autocast on CPU: GradScaler runs but CPU fp16 matmuls are slow")

    # ---------------------------------------------------------------- data
    tok = load_tokenizer(cfg)
    data = tokenize(cfg.dataset, tok, cfg.seq_len)
    if data.truncated:
        notes.append(f"{data.truncated} samples truncated to seq_len {cfg.seq_len}")
    micro = cfg.micro_batch_size
    if micro == "auto":
        micro = auto_micro_batch(cfg, budget, engine)
        emit({"type": "info", "message": f"micro_batch_size auto -> {micro}"})
    eff = cfg.global_batch_size or micro * cfg.gradient_accumulation_steps
    if cfg.global_batch_size is None and cfg.micro_batch_size == "auto":
        eff = micro * cfg.gradient_accumulation_steps

    # ---------------------------------------------------------------- prediction (same keys as diagnose)
    memory_dict, plan_label = None, ""
    try:
        _, plan, mem, note = predict_memory(cfg, int(micro), engine)
        plan_label = plan.label()
        if mem is not None:
            memory_dict = mem.to_dict()
        if note:
            notes.append(note)
    except Exception as exc:  # noqa: BLE001 - the prediction must never stop a training run
        notes.append(f"memory prediction failed: {type(exc).__name__}: {exc}")

    # ---------------------------------------------------------------- model, optimizer, schedule
    torch.manual_seed(cfg.seed)
    built = build_model(cfg, device, len(tok))
    model = built.model
    trainable = built.trainable
    if cfg.offload_optimizer:
        optimizer = CPUOffloadOptimizer(cfg, trainable)
    else:
        optimizer = make_optimizer(cfg, trainable, device)
    scheduler = make_scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16-mixed" else None
    amp_dtype = autocast_dtype(cfg)

    state: dict[str, Any] = {"samples_seen": 0, "micro_batch": int(micro), "configured_micro_batch": int(micro),
                             "oom_recoveries": 0, "losses": [], "fingerprint": _fingerprint(cfg), "recoveries": []}
    step = 0
    resumed_from = None
    saved: dict = {}
    out_dir = Path(cfg.output_dir)
    if resume:
        last = ckpt.latest_checkpoint(out_dir)
        if last is None:
            raise BadInput(f"--resume: no checkpoint in {out_dir}", "run without --resume to start fresh")
        saved = ckpt.load_checkpoint(last, model=model, is_peft=built.is_peft, optimizer=optimizer,
                                     scheduler=scheduler, scaler=scaler)
        if saved.get("fingerprint") != state["fingerprint"]:
            diff = [k for k in state["fingerprint"] if saved.get("fingerprint", {}).get(k) != state["fingerprint"][k]]
            raise BadInput(f"--resume: {last} was written by a different run (differs in: {', '.join(diff)})",
                           "resume with the same config, or choose another output_dir")
        step = int(saved["step"])
        state.update({k: saved[k] for k in ("samples_seen", "oom_recoveries", "losses", "recoveries") if k in saved})
        if saved.get("configured_micro_batch") == int(micro):
            state["micro_batch"] = int(saved.get("micro_batch", micro))  # keep what the OOM guard learned
        else:  # the user changed micro_batch_size (e.g. to fix an OOM): the new value wins
            emit({"type": "info", "message": f"micro_batch_size changed since the checkpoint: using {micro}"})
        resumed_from = str(last)
        emit({"type": "info", "message": f"resumed from {last} at step {step}"})
    else:
        old = ckpt.list_checkpoints(out_dir)
        if old:
            for _, p in old:
                shutil.rmtree(p, ignore_errors=True)
            emit({"type": "info", "message": f"fresh run: removed {len(old)} old checkpoint(s) in {out_dir} "
                                             "(use --resume to continue a run)"})

    # ---------------------------------------------------------------- memory meter / cap
    meter = None
    if device.type == "cuda":
        if cap is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        torch.cuda.reset_peak_memory_stats(device)
        guard_ctx: Any = contextlib.nullcontext()
    else:
        from oomdoctor.execute.tracking import LiveBytes

        meter = LiveBytes(cap_bytes=cap)
        meter.track_module(model, optimizer if not isinstance(optimizer, CPUOffloadOptimizer) else None,
                           grad_hooks=True)
        guard_ctx = meter

    touch = GradTouch()
    hooks = []
    for p in trainable:
        def _hook(_p, touch=touch):
            touch.touched = True
        hooks.append(p.register_post_accumulate_grad_hook(_hook))

    def zero_grads() -> None:
        optimizer.zero_grad(set_to_none=True)

    order = SampleOrder(len(data), cfg.seed, cfg.dataset.shuffle)
    guard = OOMGuard(micro_batch=int(state["micro_batch"]), max_retries=max(0, cfg.max_oom_retries -
                                                                              int(state["oom_recoveries"])))

    def on_recovery(rec) -> None:
        state["oom_recoveries"] = int(state["oom_recoveries"]) + 1
        state["recoveries"].append(rec.to_dict())
        emit({"type": "oom", **rec.to_dict(), "grad_accum": math.ceil(eff / rec.new_micro_batch)})

    guard.on_recovery = on_recovery
    delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
    last_ckpt: str | None = resumed_from
    tokens_total = 0
    t0 = time.perf_counter()
    last_loss: float | None = None

    def save(at_step: int) -> str:
        st = {**state, "micro_batch": guard.micro_batch}
        path = ckpt.save_checkpoint(out_dir, at_step, model=model, is_peft=built.is_peft, optimizer=optimizer,
                                    scheduler=scheduler, scaler=scaler, state=st,
                                    save_total_limit=cfg.save_total_limit)
        emit({"type": "checkpoint", "step": at_step, "path": str(path)})
        return str(path)

    def peak_bytes() -> int:
        if device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(device))
        return int(meter.peak) if meter is not None else 0

    def diagnosis(phase: str, reason: str, message: str) -> str:
        lines = [f"out of memory at step {step + 1} in {phase} with micro-batch 1 x seq_len {cfg.seq_len} "
                 f"({reason})"]
        if cap is not None:
            held = format_bytes(meter.current) if meter else "?"
            lines.append(f"budget {format_bytes(cap)}; held outside the failed micro-batch (weights, gradients, "
                         f"optimizer state): {held}: too little is left for one sample's activations")
        if memory_dict:
            comps = {k[:-6]: v for k, v in memory_dict.items()
                     if k.endswith("_bytes") and not k.startswith("peak") and v}
            top = sorted(comps.items(), key=lambda kv: -kv[1])[:4]
            lines.append("predicted (micro-batch %d): " % int(micro)
                         + ", ".join(f"{k} {format_bytes(v)}" for k, v in top))
        lines.append(f"OOM message: {message.splitlines()[0][:200]}")
        return "\n".join(lines)

    threads_before = torch.get_num_threads()
    if device.type == "cpu" and built.num_params < 5_000_000 and "OMP_NUM_THREADS" not in os.environ:
        # tiny models: thread fan-out costs more than the ops (measured 0.5 s vs 8 s for 4 steps on a loaded
        # 2-core box); real models keep torch's default. Restored when the run ends.
        torch.set_num_threads(1)
    emit({"type": "start", "max_steps": cfg.max_steps, "step": step, "micro_batch": guard.micro_batch,
          "effective_batch": eff, "device": str(device), "cap": cap, "samples": len(data),
          "trainable": built.num_trainable, "params": built.num_params, "plan": plan_label})
    try:
        with guard_ctx:
            while step < cfg.max_steps:
                idx = order.take(int(state["samples_seen"]), eff)
                samples = [data.samples[i] for i in idx]
                n_targets = max(1, count_targets(samples))
                step_tokens = [0]

                def run_chunk(chunk: list) -> float:
                    batch = collate(chunk, data.pad_id, cfg.dataset.pad_to_multiple_of)
                    batch = {k: v.to(device) for k, v in batch.items()}
                    step_tokens[0] += int(batch["input_ids"].numel())
                    amp = (torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None
                           else contextlib.nullcontext())
                    with amp, activation_offload(cfg.offload_activations, device):
                        loss = model(**batch, num_items_in_batch=n_targets).loss
                    touch.in_backward = True
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    return float(loss.detach())

                try:
                    step_loss, _ = guard.run_step(step + 1, samples, run_chunk, zero_grads, touch)
                except OOMAtMicroBatchOne as exc:
                    zero_grads()
                    free_memory()
                    where = save(step)  # state as of the start of this step: weights untouched, data not consumed
                    raise UnrecoverableOOM(
                        diagnosis(exc.phase, exc.reason, exc.message) + f"\ncheckpoint saved: {where}",
                        "fix the plan (`oomdoctor train CONFIG --dry-run --gpu-mem SIZE` lists changes that fit), "
                        "then `oomdoctor train CONFIG --resume`",
                    ) from None
                if step == 0 or (resumed_from and step == int(saved["step"])):
                    # field notes 1.4: with GC + PEFT a missing input-grad hook trains nothing, silently
                    from torch.utils._python_dispatch import _disable_current_modes

                    with torch.no_grad(), _disable_current_modes():  # a check, not part of the budget
                        live = any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in trainable)
                    if not live:
                        msg = "no gradient reached the trainable parameters in the first step: nothing trains"
                        notes.append(msg)
                        emit({"type": "info", "message": "warning: " + msg})
                try:
                    if scaler is not None:
                        scaler.unscale_(optimizer)
                    if cfg.max_grad_norm:
                        torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
                    if scaler is not None:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                except (torch.OutOfMemoryError, RuntimeError) as exc:
                    if not is_oom(exc):
                        raise
                    raise UnrecoverableOOM(
                        f"out of memory in the optimizer step {step + 1} (the optimizer state is allocated at the "
                        f"first step; a smaller micro-batch does not shrink it). The in-memory state may be "
                        f"partially updated, so no checkpoint was written; last checkpoint: {last_ckpt or 'none'}",
                        "use a leaner optimizer (optim: adamw_bnb_8bit / adafactor), offload_optimizer: true or "
                        "LoRA; check with `oomdoctor train CONFIG --dry-run --gpu-mem SIZE`",
                    ) from None
                scheduler.step()
                zero_grads()
                if meter is not None and step == 0:
                    meter.track_optimizer(optimizer)
                step += 1
                state["samples_seen"] = int(state["samples_seen"]) + eff
                state["micro_batch"] = guard.micro_batch
                state["losses"].append(step_loss)
                last_loss = step_loss
                tokens_total += step_tokens[0]
                el = time.perf_counter() - t0
                if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                    emit({"type": "step", "step": step, "max_steps": cfg.max_steps, "loss": step_loss,
                          "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_total / el if el else 0.0,
                          "peak_bytes": peak_bytes(), "micro_batch": guard.micro_batch,
                          "grad_accum": math.ceil(eff / guard.micro_batch)})
                if step == cfg.max_steps or (cfg.save_steps and step % cfg.save_steps == 0):
                    last_ckpt = save(step)
                if delay:
                    time.sleep(delay)
    finally:
        for h in hooks:
            h.remove()
        torch.set_num_threads(threads_before)

    wall = time.perf_counter() - t0
    res = TrainResult(
        optimizer_steps=step,
        effective_batch_size=eff,
        micro_batch_size=guard.micro_batch,
        gradient_accumulation_steps=math.ceil(eff / guard.micro_batch),
        oom_recoveries=int(state["oom_recoveries"]),
        measured_peak_bytes=peak_bytes(),
        memory=memory_dict,
        final_loss=last_loss if last_loss is not None else (state["losses"][-1] if state["losses"] else None),
        checkpoint=last_ckpt,
        first_loss=state["losses"][0] if state["losses"] else None,
        losses=[float(x) for x in state["losses"]],
        tokens=tokens_total,
        tokens_per_second=tokens_total / wall if wall else 0.0,
        wall_seconds=wall,
        device=str(device),
        cap_bytes=cap,
        resumed_from=resumed_from,
        recoveries=list(state["recoveries"]),
        num_params=built.num_params,
        num_trainable_params=built.num_trainable,
        plan=plan_label,
        notes=notes,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    import json

    (out_dir / "summary.json").write_text(json.dumps(res.to_dict(), indent=1, default=str))
    return res


__all__ = ["train", "TrainResult", "predict_memory", "run_budget", "auto_micro_batch", "set_allocator_env",
           "STEP_DELAY_ENV"]
