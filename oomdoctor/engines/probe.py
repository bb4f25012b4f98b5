"""Verification probe: run a plan for real — 2+ full training steps at the longest sequence — in a child process.

Why a child: an OOM inside a process leaves the CUDA caching allocator fragmented and tensors referenced from the
traceback, so a later, smaller trial in the same process can fail or pass for the wrong reason (field notes: Lightning
#8028/#20231, OOM right after the batch-size finder). A fresh interpreter per trial starts from a clean device, and a
probe that crashes or is killed cannot take the parent (``oomdoctor tune``) with it.

What a probe runs (the parent calls :func:`run_probe`; the child is ``python -m oomdoctor.engines.probe`` reading one JSON
request on stdin and printing one ``OOMDOCTOR_PROBE {json}`` line):

* the model exactly as ``oomdoctor train`` loads it (``oomdoctor.execute.load.load_model``: quantization, gradient
  checkpointing, LoRA) — from the weights when MODEL is a weights directory, else randomly initialised from the config
  (memory does not depend on the values);
* the optimizer and the step as ``train`` runs them (``oomdoctor.execute.optim``, ``oomdoctor.execute.step``; CPU
  offload and activation offload included);
* ``steps`` optimizer steps (default 2: optimizer state is created lazily at the first ``step()``, so only the
  second step shows the steady state), each of ``min(grad_accum, 2)`` micro-batches (with accumulation, the second
  micro-batch's backward runs with the full gradients already allocated), every micro-batch a full
  ``micro_batch x seq_len`` block of random tokens (the worst case: padding/packing never exceeds it);
* the cap: on CUDA ``torch.cuda.set_per_process_memory_fraction`` limits the caching allocator to the capacity being
  planned for, minus the CUDA context this process already holds, so an OOM means "does not fit that card" even on
  a bigger one; on CPU (tests, the benchmark) :class:`oomdoctor.execute.tracking.LiveBytes` enforces ``cap_bytes`` on live
  tensor bytes and raises ``torch.OutOfMemoryError`` like the CUDA allocator.

Measured: CUDA ``max_memory_allocated`` / ``max_memory_reserved`` and the device total (reserved + context, what
nvidia-smi shows; bitsandbytes paged optimizer state lives in unified memory outside the allocator and is not
included); on CPU the LiveBytes peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from oomdoctor.memory.runtime import set_allocator_env
from oomdoctor.plan import Plan, validate

MARKER = "OOMDOCTOR_PROBE "


@dataclass(frozen=True)
class ProbeResult:
    """What one probe observed."""

    outcome: str
    """``fits`` (every step ran), ``oom`` (out of memory) or ``error`` (could not run: crash, timeout, bad setup)."""
    micro_batch: int
    steps: int = 0
    """Optimizer steps completed."""
    peak_allocated_bytes: int | None = None
    """CUDA: ``max_memory_allocated``; CPU: LiveBytes peak."""
    peak_reserved_bytes: int | None = None
    """CUDA: ``max_memory_reserved`` (allocated + cached blocks); CPU: same as allocated."""
    peak_device_bytes: int | None = None
    """CUDA: reserved + this process's CUDA context; CPU: the LiveBytes peak."""
    context_bytes: int | None = None
    """CUDA context + kernels of the child (device memory used before any tensor)."""
    seconds: float = 0.0
    device: str = "cuda"
    message: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _plan_to_json(plan: Plan) -> dict:
    d = {f.name: getattr(plan, f.name) for f in fields(Plan)}
    d["lora_targets"] = list(plan.lora_targets)
    return d


def _plan_from_json(d: dict) -> Plan:
    d = dict(d)
    d["lora_targets"] = tuple(d.get("lora_targets", ("all-linear",)))
    return validate(Plan(**d))


# ---------------------------------------------------------------------------------------------- parent side


def run_probe(
    model_ref: str,
    plan: Plan,
    *,
    device: str = "cuda",
    steps: int = 2,
    cap_bytes: int | None = None,
    timeout_s: float = 900.0,
    python: str | None = None,
    seed: int = 0,
) -> ProbeResult:
    """Run one probe in a fresh ``python -m oomdoctor.engines.probe`` child and return what it saw.

    Never raises for what happens in the child: a crash, a kill (host OOM killer: negative return code) or a
    timeout becomes ``outcome="error"`` with the reason."""
    req = {
        "model": model_ref,
        "plan": _plan_to_json(plan),
        "device": device,
        "steps": steps,
        "cap_bytes": cap_bytes,
        "seed": seed,
    }
    env = dict(os.environ)
    set_allocator_env(env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [python or sys.executable, "-m", "oomdoctor.engines.probe"],
            input=json.dumps(req),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(
            "error",
            plan.micro_batch,
            seconds=time.perf_counter() - t0,
            device=device,
            message=f"probe timed out after {timeout_s:.0f}s",
        )
    dt = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            d = json.loads(line[len(MARKER) :])
            d["seconds"] = dt
            return ProbeResult(**d)
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
    why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    return ProbeResult(
        "error",
        plan.micro_batch,
        seconds=dt,
        device=device,
        message=f"probe process failed ({why}): " + " | ".join(tail)[-400:],
    )


# ---------------------------------------------------------------------------------------------- child side


def _source(model_ref: str):
    """What ``oomdoctor train`` would load for MODEL: the weights when it is a weights directory, else random
    weights of the config's shape (memory does not depend on values)."""
    from pathlib import Path

    from oomdoctor.execute.load import ModelSource
    from oomdoctor.files import holds_weights

    if holds_weights(model_ref):
        return ModelSource(path=str(Path(model_ref).expanduser()))
    return ModelSource(config=model_ref, init="random")


def build_for_probe(model_ref: str, plan: Plan, device: str = "cuda"):
    """The model exactly as ``oomdoctor train`` loads it for ``plan`` (``oomdoctor.execute.load.LoadedModel``)."""
    import torch

    from oomdoctor.execute.load import load_model, quiet_hf

    quiet_hf()
    return load_model(_source(model_ref), plan, torch.device(device))


def run_steps(
    loaded, plan: Plan, *, device: str = "cpu", steps: int = 2, cap_bytes: int | None = None
) -> tuple[str, int, int | None, str | None]:
    """Run ``steps`` full optimizer steps of ``plan`` on an already loaded model (the executor's
    :class:`~oomdoctor.execute.step.TrainStep`) with a fresh optimizer (its state is created at the first step, as
    in training). On CPU with ``cap_bytes`` the live tensor bytes are capped by
    :class:`oomdoctor.execute.tracking.LiveBytes`. Returns (outcome, steps done, LiveBytes peak or None, message)."""
    import contextlib

    import torch

    from oomdoctor.execute.oom import is_oom
    from oomdoctor.execute.optim import make_plan_optimizer
    from oomdoctor.execute.step import TrainStep

    dev = torch.device(device)
    model = loaded.model
    done, lb, step = 0, None, None
    micro_per_step = min(plan.grad_accum, 2)
    try:
        opt = make_plan_optimizer(loaded.trainable, plan, target="gpu" if dev.type == "cuda" else "cpu")
        step = TrainStep(model, opt, plan, device_type=dev.type)
        cap_ctx: Any = contextlib.nullcontext()
        if dev.type == "cpu" and cap_bytes is not None:
            from oomdoctor.execute.tracking import LiveBytes

            lb = LiveBytes(cap_bytes=cap_bytes, device_name="simulated device")
            lb.track_module(model, opt)
            cap_ctx = lb
        vocab = model.get_input_embeddings().weight.shape[0]
        with cap_ctx:
            for _ in range(steps):
                for _m in range(micro_per_step):
                    ids = torch.randint(0, vocab, (plan.micro_batch, plan.seq_len), device=dev)
                    step.forward_backward({"input_ids": ids, "labels": ids}, loss_divisor=micro_per_step)
                    del ids
                step.optimizer_step()
                done += 1
        outcome, msg = "fits", None
    except Exception as exc:  # noqa: BLE001 - classify: OOM vs anything else
        if is_oom(exc):
            outcome, msg = "oom", str(exc).splitlines()[0][:300]
        else:
            outcome, msg = "error", f"{type(exc).__name__}: {exc}"[:500]
    finally:
        for p in loaded.trainable:
            p.grad = None
        del step
    return outcome, done, (int(lb.peak) if lb is not None else None), msg


def probe_in_process(
    model_ref: str, plan: Plan, *, device: str = "cuda", steps: int = 2, cap_bytes: int | None = None, seed: int = 0
) -> ProbeResult:
    """The child's work (also callable directly in tests on CPU): build, cap, run ``steps`` full steps, measure."""
    import torch

    t0 = time.perf_counter()
    dev = torch.device(device)
    ctx_bytes = None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return ProbeResult("error", plan.micro_batch, device=device, message="no CUDA device in the probe process")
        from oomdoctor.gpu import detect_gpu

        before = detect_gpu()  # NVML, before this process has a CUDA context
        torch.zeros(1, device=dev)  # create the context + allocator
        free1, total = torch.cuda.mem_get_info(dev)
        # context + kernels = free before - free after - the one block the allocator reserved for zeros(1)
        ctx_bytes = max(before.free_bytes - free1 - torch.cuda.memory_reserved(dev), 0) if before else 0
        if cap_bytes is not None:
            allowed = max(cap_bytes - ctx_bytes, 0)
            torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(seed)
    from oomdoctor.execute.oom import is_oom

    try:
        loaded = build_for_probe(model_ref, plan, device)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the probe's outcome, never a crash
        outcome = "oom" if is_oom(exc) else "error"
        return ProbeResult(
            outcome,
            plan.micro_batch,
            0,
            device=device,
            seconds=time.perf_counter() - t0,
            context_bytes=ctx_bytes,
            message=f"building the model: {type(exc).__name__}: {exc}"[:500],
        )
    outcome, done, lb_peak, msg = run_steps(
        loaded, plan, device=device, steps=steps, cap_bytes=cap_bytes if dev.type == "cpu" else None
    )
    if dev.type == "cuda":
        alloc = int(torch.cuda.max_memory_allocated(dev))
        reserved = int(torch.cuda.max_memory_reserved(dev))
        device_peak = reserved + (ctx_bytes or 0)
    else:
        alloc = reserved = device_peak = lb_peak
    return ProbeResult(
        outcome, plan.micro_batch, done, alloc, reserved, device_peak, ctx_bytes, time.perf_counter() - t0, device, msg
    )


def _main() -> None:
    req = json.loads(sys.stdin.read())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        plan = _plan_from_json(req["plan"])
        res = probe_in_process(
            req["model"],
            plan,
            device=req.get("device", "cuda"),
            steps=int(req.get("steps", 2)),
            cap_bytes=req.get("cap_bytes"),
            seed=int(req.get("seed", 0)),
        )
    except Exception as exc:  # noqa: BLE001 - report setup failures as a result line, not a traceback
        res = ProbeResult(
            "error",
            int(req.get("plan", {}).get("micro_batch", 0)),
            device=req.get("device", "?"),
            message=f"{type(exc).__name__}: {exc}"[:500],
        )
    sys.stdout.write(MARKER + json.dumps(res.to_dict()) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _main()
