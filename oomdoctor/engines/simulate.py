"""The simulated engine: replay the real Hugging Face training step on tensors that hold no data.

``simulate_plan(spec, plan)`` builds the model the plan trains (``oomdoctor.execute.build``: meta device, plan dtype,
bitsandbytes stand-ins, gradient checkpointing, peft LoRA, attention implementation), materializes it under
``FakeTensorMode`` on ``cpu`` (``to_empty``), and runs **two** full steps as ``transformers.Trainer`` does them —
forward with labels under autocast (accelerate converts the outputs to fp32), loss, backward, gradient clipping,
optimizer step, ``zero_grad(set_to_none=True)`` — while :class:`oomdoctor.execute.tracking.LiveBytes` counts live storage
bytes rounded as the CUDA caching allocator rounds. Two steps because optimizer state appears at the first step;
the second is the steady state.

The step itself is the executor's (``oomdoctor.execute.step.TrainStep``); this engine instruments it
(``oomdoctor.engines.replay``: tracking hooks, and the CUDA policy that makes a CPU replay allocate as CUDA does).

Speed: transformer blocks are identical, so the step is simulated with 2 and 3 blocks (``EXTRAPOLATE_FROM``) and
every number is extrapolated linearly to N blocks (per phase, at three aligned moments: the phase peak, its start and
its end, keeping the largest); models whose blocks differ (alternating attention kinds, MoE) are simulated in full.

Several GPUs (``world_size``, ``strategy``; every number is per rank, rank 0 = the largest shard):

* ``fsdp``: one rank of the real FSDP2 job in this process (shared/research/multi-gpu.md §4). A *fake* process
  group (``FakeStore``, torch's private ``torch.testing._internal.distributed.fake_pg``; collectives return at once
  and move no data) of ``world_size`` ranks, the meta-built model wrapped by the executor's own
  ``oomdoctor.execute.shard.apply_fsdp`` (HSDP mesh, ``reshard_after_forward``, mixed-precision policy) outside
  ``FakeTensorMode`` (building the mesh reads rank ids), then ``to_empty`` and the same two steps inside it.
  Measured within 16 bytes of real gloo runs and equal to torch's ``FSDPMemTracker``. The first/last blocks of a
  sharded model overlap their all-gathers differently, so extrapolation uses 3 and 4 blocks
  (``EXTRAPOLATE_FROM_SHARDED``, §4 "Extrapolation warning"). A process that already has a real process group
  (``train`` under torchrun) simulates in a spawned subprocess. Not seen: NCCL's own buffers (outside PyTorch's
  allocator).
* ``ddp``: DDP cannot run on fake tensors (its constructor checks parameter data across ranks), and it costs the
  single-GPU step plus one gradient-sized all-reduce bucket set, allocated at wrap time (measured, §1): that is
  what is reported.
* ``zero2``/``zero3`` (DeepSpeed) and ``offload_params`` are not simulated: :func:`estimate_simulated` returns the
  analytic estimate with a note saying so, :func:`simulate_plan` refuses.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomdoctor.engines.fake import fake_gaps, meta_model, retie
from oomdoctor.engines.kinds import layer_period
from oomdoctor.engines.replay import RunStats, run_steps
from oomdoctor.errors import BadInput
from oomdoctor.execute.shard import mesh_shape
from oomdoctor.execute.step import PHASES
from oomdoctor.memory.breakdown import TENSOR_COMPONENTS, MemoryBreakdown
from oomdoctor.memory.runtime import ALLOC_BLOCK
from oomdoctor.memory.sharding import LOAD
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.progress import report
from oomdoctor.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan

#: Block counts simulated for linear extrapolation. Memory is affine in the block count from two blocks on (blocks are
#: identical; the first/last block's own differences, e.g. a non-grad-requiring input, are in the intercept; with one
#: block the backward peak can sit elsewhere, e.g. QLoRA + GC): checked against full simulations in
#: tests/test_simulate.py.
EXTRAPOLATE_FROM = (2, 3)
#: Block counts for FSDP plans: with 2 blocks the root unit's all-gather overlaps differently (2->3 blocks adds more
#: than every later block; from (2, 3) the 7B N=8 peak came out +22 %, from (3, 4) exact: multi-gpu.md §4).
EXTRAPOLATE_FROM_SHARDED = (3, 4)


def extrapolate_from(plan: "Plan") -> tuple[int, int]:
    """The two block counts simulated for ``plan`` before extrapolating."""
    return EXTRAPOLATE_FROM_SHARDED if plan.strategy == "fsdp" else EXTRAPOLATE_FROM


def not_simulated(plan: "Plan") -> str | None:
    """Why the simulated engine cannot run ``plan`` (None: it can)."""
    if plan.strategy in DEEPSPEED:
        return f"DeepSpeed ZeRO ({plan.strategy}) is not simulated (a fake-tensor zero.Init was never validated)"
    if plan.offload_params:
        return "parameter offload is not simulated (CPU-offloaded shards and device buffers share one fake CPU device)"
    return None


@contextmanager
def fake_process_group(world_size: int):
    """A process group of ``world_size`` ranks in which this process is rank 0 and every collective is a no-op
    (torch's "fake" backend; private API, pinned by tests/test_simulate_fsdp.py). Destroyed on exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise BadInput(
            "the simulated engine needs its own (fake) process group, and this process already has one",
            "call oomdoctor.engines.simulate.simulate_plan, which runs in a subprocess then",
        )
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        raise BadInput(
            f"this torch has no fake process group ({exc}): sharded plans cannot be simulated", "use --engine analytic"
        ) from None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def random_sharded_model(
    spec: "ModelSpec", plan: "Plan", device: str, num_layers: int | None = None, bnb_decompose: bool = True
):
    """The FSDP2 model of ``plan`` with real random shards on ``device`` (``cpu`` here, ``cuda`` for the measured
    engine): meta build, ``apply_fsdp`` on the current process group, then each rank materializes and initializes
    its own shards (no full copy; on the CPU with ``offload_params``, where FSDP2's CPU offload wants them, as
    ``execute/load.load_sharded_model`` does). Returns the ``BuiltModel``."""
    import torch

    built = meta_model(spec, plan, num_layers, bnb_decompose, device_type=device)
    built.model.to_empty(device="cpu" if plan.offload_params else device)
    retie(built.model)
    with torch.no_grad():
        for p in built.model.parameters():
            getattr(p, "_local_tensor", p).normal_(0, 0.02)
    return built


@dataclass
class SimulationResult:
    """What one simulated plan produced."""

    breakdown: MemoryBreakdown
    """The typed breakdown (engine ``simulate``); tensor components are those at the peak moment."""
    timeline: list
    """(event index, phase, {category: bytes}) samples of the simulated run, for plots (``oomdoctor.diagnose.plot``).
    With extrapolation this is the timeline of the largest simulated model (``timeline_layers`` blocks)."""
    phase_peaks: dict[str, int]
    """Peak allocated bytes per phase (forward, backward, optimizer-step), extrapolated to the full model."""
    phase_categories: dict[str, dict[str, int]]
    """Per-category bytes at each phase's peak, extrapolated to the full model."""
    seconds: float
    """Wall time of the simulation."""
    layers_simulated: tuple[int, ...]
    """Block counts actually simulated (e.g. (2, 4) when extrapolating, (N,) for a full simulation)."""
    timeline_layers: int
    """Blocks of the model the timeline comes from."""
    extrapolated: bool
    paged_bytes: int = 0
    """bitsandbytes paged optimizer state (unified memory) of the full model."""
    step_peaks: tuple[int, ...] = ()
    """Peak of each simulated step (of the largest simulated model)."""

    def to_dict(self) -> dict:
        return {
            "memory": self.breakdown.to_dict(),
            "phase_peaks": self.phase_peaks,
            "phase_categories": self.phase_categories,
            "seconds": round(self.seconds, 3),
            "layers_simulated": list(self.layers_simulated),
            "extrapolated": self.extrapolated,
        }


# ============================================================================ simulate


def simulate_run(
    spec: "ModelSpec",
    plan: "Plan",
    num_layers: int | None = None,
    *,
    timeline: bool = False,
    steps: int = 2,
    target: str = "cuda",
    round_to: int = ALLOC_BLOCK,
    bnb_decompose: bool = True,
) -> RunStats:
    """One fake-tensor simulation of ``plan`` with ``num_layers`` blocks (None = the spec's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.engines.routing import balanced_routing
    from oomdoctor.execute.build import make_batch
    from oomdoctor.execute.tracking import LiveBytes

    why = not_simulated(plan)
    if why:
        raise BadInput(f"the simulated engine cannot run this plan: {why}", "use --engine analytic")
    with fake_process_group(plan.world_size) if plan.strategy == "fsdp" else nullcontext():
        built = meta_model(spec, plan, num_layers, bnb_decompose)
        model = built.model
        # no fallback kernels: an op without a fake implementation must never run for real on full-size zeros
        fake = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
        with fake, fake_gaps(), balanced_routing(spec, plan):
            model.to_empty(device="cpu")
            retie(model)
            batch = make_batch(spec, plan, "cpu")
            lb = LiveBytes(round_to=round_to, record_timeline=timeline, param_copy_category="master_weights")

            def stepped(i: int, blocks: int = built.num_layers) -> None:
                report("simulate", f"replayed step {i + 1} of {steps} with {blocks} blocks")

            stats = run_steps(
                model, plan, batch, lb, steps=steps, target=target, head=built.head_module, on_step=stepped
            )
        stats.layers = built.num_layers
        del model, built
    return stats


def real_cpu_run(
    spec: "ModelSpec",
    plan: "Plan",
    *,
    model=None,
    head=None,
    num_layers: int | None = None,
    steps: int = 2,
    target: str = "cuda",
    round_to: int = ALLOC_BLOCK,
    bnb_decompose: bool = True,
    seed: int = 0,
    timeline: bool = False,
) -> RunStats:
    """The same two steps on REAL tensors on the CPU (random init of the real shape, or ``model``), counted by the
    same tracker: the reference the fake-tensor replay is checked against. ``strategy: fsdp`` plans run on the
    process group this process is in (e.g. gloo under torchrun): meta build, ``apply_fsdp``, then each rank
    materializes and initializes its own shards (no full copy per rank)."""
    import torch

    from oomdoctor.execute.build import build_model, make_batch
    from oomdoctor.execute.tracking import LiveBytes

    torch.manual_seed(seed)
    if model is None and plan.strategy == "fsdp":
        built = random_sharded_model(spec, plan, "cpu", num_layers, bnb_decompose)
        model, head, layers = built.model, built.head_module, built.num_layers
    elif model is None:
        built = build_model(spec, plan, device="cpu", num_layers=num_layers, seed=seed, bnb_decompose=bnb_decompose)
        model, head, layers = built.model, built.head_module, built.num_layers
    else:
        layers = num_layers or spec.num_layers
    batch = make_batch(spec, plan, "cpu", fake_ok=False)
    lb = LiveBytes(round_to=round_to, record_timeline=timeline, param_copy_category="master_weights")
    stats = run_steps(model, plan, batch, lb, steps=steps, target=target, head=head)
    stats.layers = layers
    return stats


def _first_replay() -> str:
    """What a replay's progress line adds when this process has not loaded transformers' models yet (seconds)."""
    import sys

    return "" if "transformers.modeling_utils" in sys.modules else " (loading torch and transformers first)"


def _report_run(spec, blocks: int, then: str, step: int | None, steps: int | None) -> None:
    """Progress: one replay of ``blocks`` blocks starts (replay ``step`` of ``steps``)."""
    report(
        "simulate",
        f"replaying the training step of {spec.name} with {blocks} blocks{then}{_first_replay()}",
        step,
        steps,
    )


def _extrapolate(a: int, b: int, la: int, lb_: int, n: int) -> int:
    """Linear extrapolation of a per-block-linear quantity measured at ``la`` and ``lb_`` blocks to ``n`` blocks."""
    if lb_ == la:
        return b
    return a + (b - a) * (n - la) // (lb_ - la)


def _extrapolate_categories(c2: dict, c4: dict, la: int, lb_: int, n: int, total: int) -> dict:
    """Per-category extrapolation that still sums to ``total`` (the extrapolated sum, exact when memory is affine in
    the block count): categories that would go negative are clamped and the difference is taken from/added to the
    transient categories."""
    cats = {c: max(_extrapolate(c2[c], c4[c], la, lb_, n), 0) for c in c4}
    diff = total - sum(cats.values())
    order = ("temporaries", "activations", "logits", "master_weights", "gradients", "optimizer_states", "parameters")
    if diff > 0:
        cats["temporaries"] += diff
    for c in order:
        if diff >= 0:
            break
        take = min(cats[c], -diff)
        cats[c] -= take
        diff += take
    return cats


def simulate_plan(
    spec: "ModelSpec",
    plan: "Plan",
    *,
    layers: str = "auto",
    timeline: bool = False,
    round_to: int = ALLOC_BLOCK,
    timeline_layers: str = "full",
    device: str = "cuda",
    run=None,
) -> SimulationResult:
    """Simulate ``plan`` on ``spec``, its device overheads those of ``device`` (:func:`device_overheads`). ``layers="auto"`` simulates 2 and 3 blocks (whole periods for periodic blocks)
    and extrapolates (else the full model); ``"full"`` always simulates every block. ``timeline=True`` also records
    the memory curve for plots: of the full model (``timeline_layers="full"``, one more replay of every block) or of
    the 3-block model (``"sample"``, fast, not the real peak). ``run(spec, plan, num_layers, *, timeline, round_to)
    -> RunStats`` replays one model (default :func:`simulate_run`, the executor's step; the trainers' replay passes
    ``oomdoctor.engines.trainers.trainer_run``)."""
    from oomdoctor.plan import validate

    plan = validate(plan)
    why = not_simulated(plan)
    if why:
        raise BadInput(f"the simulated engine cannot run this plan: {why}", "use --engine analytic")
    if plan.strategy == "fsdp" and _has_process_group():
        return _in_subprocess(
            simulate_plan,
            spec,
            plan,
            layers=layers,
            timeline=timeline,
            round_to=round_to,
            timeline_layers=timeline_layers,
            device=device,
            run=run,
        )
    t0 = time.perf_counter()
    n = spec.num_layers
    report("simulate", f"preparing the replay of {spec.name}{_first_replay()}")
    period = layer_period(spec, plan) if layers == "auto" else None
    extrap = period is not None and n % period == 0 and n > (extrapolate_from(plan)[1] + 1) * period
    try:
        return _simulate_plan(
            spec, plan, n, extrap, timeline, round_to, t0, period or 1, timeline_layers, device, run or simulate_run
        )
    except BadInput:
        raise
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""
        raise BadInput(
            f"{spec.name}: the simulated step could not run this model/plan ({type(exc).__name__}: {msg})",
            "use --engine analytic for this model, or report it with the model's config.json",
        ) from exc


def _has_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _in_subprocess(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh spawned interpreter (no process group there); BadInput comes back whole."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        ok, value = pool.submit(_call_reporting, fn, args, kwargs).result()
    if not ok:
        raise BadInput(*value)
    return value


def _call_reporting(fn, args, kwargs):
    try:
        return True, fn(*args, **kwargs)
    except BadInput as exc:
        return False, (exc.message, exc.hint)


def _simulate_plan(
    spec,
    plan,
    n: int,
    extrap: bool,
    timeline: bool,
    round_to: int,
    t0: float,
    period: int = 1,
    timeline_layers: str = "full",
    device: str = "cuda",
    run=simulate_run,
) -> SimulationResult:
    base = extrapolate_from(plan)
    if extrap:
        la, lb_ = base[0] * period, base[1] * period
        _report_run(spec, la, f", then {lb_}, extrapolated to {n}", 1, 2)
        r2 = run(spec, plan, la, timeline=False, round_to=round_to)
        _report_run(spec, lb_, f", extrapolated to {n}", 2, 2)
        r4 = run(spec, plan, lb_, timeline=False, round_to=round_to)
        runs = (r2, r4)
        ex = lambda a, b: max(_extrapolate(a, b, r2.layers, r4.layers, n), 0)  # noqa: E731 - a one-line local helper
        phase_peaks, phase_cats = {}, {}
        for ph in r4.phase_peaks:
            best, best_total = None, -1
            for c2, c4 in zip(r2.candidates[ph], r4.candidates[ph]):
                total = ex(sum(c2.values()), sum(c4.values()))
                if total > best_total:
                    best, best_total = _extrapolate_categories(c2, c4, r2.layers, r4.layers, n, total), total
            phase_cats[ph] = best
            phase_peaks[ph] = best_total
        external = {k: ex(r2.external.get(k, 0), r4.external.get(k, 0)) for k in set(r2.external) | set(r4.external)}
        adapter = ex(r2.adapter_bytes, r4.adapter_bytes)
        trainable = ex(r2.trainable_bytes, r4.trainable_bytes)
        stored = ex(r2.param_bytes, r4.param_bytes)
        ref = r4
    else:
        _report_run(spec, n, "", None, None)
        r = run(spec, plan, None, timeline=timeline, round_to=round_to)
        runs = (r,)
        phase_peaks, phase_cats, external, adapter, ref = (
            r.phase_peaks,
            r.phase_categories,
            r.external,
            r.adapter_bytes,
            r,
        )
        trainable, stored = r.trainable_bytes, r.param_bytes
    tl_run = ref
    if timeline and extrap and timeline_layers == "full":
        # a plot needs the real curve: one more replay of every block (slower: ~N/5 times the extrapolated cost)
        _report_run(spec, n, " for the memory timeline", None, None)
        tl_run = run(spec, plan, None, timeline=True, round_to=round_to)
    elif timeline and extrap:
        tl_run = run(spec, plan, base[1] * period, timeline=True, round_to=round_to)
    notes = []
    timeline_samples = tl_run.timeline
    if plan.strategy == "ddp":
        phase_peaks, phase_cats = _with_ddp_bucket(phase_peaks, phase_cats, trainable)
        bucket = tl_run.trainable_bytes  # of the model the timeline comes from
        timeline_samples = [(ev, ph, dict(c, gradients=c["gradients"] + bucket)) for ev, ph, c in tl_run.timeline]
        notes.append(
            f"ddp: the single-GPU step simulated + one gradient-sized all-reduce bucket set "
            f"({format_bytes(trainable)}, allocated when DDP wraps the model); DDP itself cannot run on "
            "fake tensors"
        )
    elif plan.strategy == "fsdp":
        mesh = "x".join(map(str, mesh_shape(plan)))
        notes.append(
            f"fsdp: rank 0 of {plan.world_size} simulated with a fake process group (mesh {mesh}); "
            "bytes per rank; NCCL's own buffers are the runtime model's constant, not simulated"
        )
        if plan.quant is not None:
            notes.append(
                "fsdp + bitsandbytes: the packed quantized weights are sharded like any parameter (FSDP-QLoRA "
                "with bnb_4bit_quant_storage), quantization constants replicated; not checked against a "
                "real bitsandbytes FSDP run"
            )
    peak_phase = max(PHASES, key=lambda ph: phase_peaks.get(ph, -1))
    cats = phase_cats[peak_phase]
    peak = phase_peaks[peak_phase]
    # categories sum to the peak by construction in each run; linear extrapolation keeps the sum
    drift = peak - sum(cats.values())
    if drift:
        cats = dict(cats, temporaries=cats["temporaries"] + drift)
    seconds = time.perf_counter() - t0
    if extrap:
        notes.append(f"simulated {runs[0].layers} and {runs[1].layers} blocks, extrapolated linearly to {n}")
    if plan.attn == "flash":
        notes.append("flash attention simulated with SDPA's flash kernel (same O(seq) saved state)")
    if plan.quant == "int8":
        notes.append("LLM.int8() outlier columns not modelled (data dependent; usually a handful)")
    comm, load = 0, None
    if plan.strategy == "ddp":
        comm, load = trainable, stored
    elif plan.strategy == "fsdp":
        # gathered units (and bf16 all-gather inputs) = the weights at the peak beyond the stored shards
        comm, load = max(cats["parameters"] + cats["master_weights"] - stored, 0), stored
    bd = breakdown_from(
        cats, peak, peak_phase, phase_peaks, adapter, external, spec, plan, notes, comm=comm, load=load, device=device
    )
    return SimulationResult(
        breakdown=bd,
        timeline=timeline_samples,
        phase_peaks=phase_peaks,
        phase_categories=phase_cats,
        seconds=seconds,
        layers_simulated=tuple(r.layers for r in runs),
        timeline_layers=tl_run.layers,
        extrapolated=extrap,
        paged_bytes=external.get("paged_optimizer", 0),
        step_peaks=tuple(ref.step_peaks),
    )


def _with_ddp_bucket(phase_peaks: dict, phase_cats: dict, bucket: int) -> tuple[dict, dict]:
    """DDP = the single-GPU step + its gradient buckets (``bucket`` bytes, alive from wrap time through every phase;
    counted as gradients): multi-gpu.md §1, measured +4Ψ (fp32 grads) at every world size, with or without
    ``gradient_as_bucket_view`` when gradients are set to None."""
    peaks = {ph: v + bucket for ph, v in phase_peaks.items()}
    cats = {ph: dict(c, gradients=c["gradients"] + bucket) for ph, c in phase_cats.items()}
    return peaks, cats


def breakdown_from(
    cats: dict,
    peak: int,
    peak_phase: str,
    phase_peaks: dict,
    adapter: int,
    external: dict,
    spec,
    plan,
    notes: list[str],
    *,
    comm: int = 0,
    load: int | None = None,
    device: str = "cuda",
) -> MemoryBreakdown:
    """Fill a MemoryBreakdown from tensor categories at the peak plus the device-level model of ``device`` (runtime
    constants).
    ``comm``: of the tensor bytes at the peak, the communication buffers (``MemoryBreakdown.comm_buffers``);
    ``load``: the ``load`` phase of multi-rank plans (the weights a rank holds once built; below every step
    phase)."""
    paged = external.get("paged_optimizer", 0)
    offloaded = external.get("cpu_offloaded", 0)
    transient = cats["activations"] + cats["logits"] + cats["temporaries"] + cats["master_weights"]
    dev = device_overheads(spec, plan, transient, device)
    reserved = peak + dev["allocator_slack"] + dev["cublas_workspace"]
    phases = {ph: int(phase_peaks.get(ph, 0)) for ph in PHASES}
    if load is not None:
        phases[LOAD] = int(load)
    return MemoryBreakdown(
        **{c: cats[c] for c in TENSOR_COMPONENTS},
        adapters=min(adapter, cats["parameters"]),
        allocator_slack=dev["allocator_slack"],
        cuda_context=dev["cuda_context"],
        cublas_workspace=dev["cublas_workspace"],
        paged_optimizer=paged,
        cpu_offloaded=offloaded,
        comm_buffers=comm,
        nccl_buffers=dev["nccl_buffers"],
        peak_allocated=peak,
        peak_reserved=reserved,
        peak_device=reserved + dev["cuda_context"] + dev["nccl_buffers"] + paged,
        peak_phase=peak_phase,
        phases=phases,
        engine="simulate",
        notes=tuple(notes),
    )


def device_overheads(spec, plan, transient_bytes: int, device: str = "cuda") -> dict:
    """CUDA context, cuBLAS workspace, NCCL buffers (several ranks) and allocator slack around a simulated tensor
    peak on ``device``: none of them on the CPU.

    Taken from the analytic engine's runtime model (``oomdoctor.memory.runtime``: named constants calibrated on a
    GPU), so both engines agree on everything outside the tensor bytes: slack = per-block rounding of the
    persistent tensors + segment tails + a fragmentation share of the transient bytes at the peak; cuBLAS workspace
    is allocator memory counted in ``peak_reserved``; the context only in ``peak_device``."""
    from oomdoctor.memory import optimizer as optm
    from oomdoctor.memory import runtime as rt
    from oomdoctor.memory.analytic import _persistent_tensors
    from oomdoctor.memory.context import make_ctx

    c = make_ctx(spec, plan, device)
    return {
        "allocator_slack": int(
            rt.allocator_slack_bytes(c, _persistent_tensors(c, optm.optimizer_memory(c)), transient_bytes)
        ),
        "cuda_context": int(rt.cuda_context_bytes(c)),
        "cublas_workspace": int(rt.cublas_workspace_bytes(c)),
        "nccl_buffers": int(rt.nccl_buffer_bytes(c)),
    }


def estimate_simulated(spec: "ModelSpec", plan: "Plan", device: str = "cuda") -> MemoryBreakdown:
    """Entry point of ``oomdoctor.engines.estimate(spec, plan, "simulate", device)`` for ``trainer: oomdoctor``
    (another trainer's step: ``oomdoctor.engines.trainers.estimate_trainer``). Plans the simulation cannot run
    (:func:`not_simulated`: DeepSpeed ZeRO, parameter offload) get the analytic estimate, with a note. The replay's
    tensors follow CUDA's autocast and kernels on either device; ``device`` sets what surrounds them."""
    from oomdoctor.plan import validate

    plan = validate(plan)
    why = not_simulated(plan)
    if why:
        return analytic_with_note(spec, plan, why, device)
    return simulate_plan(spec, plan, device=device).breakdown


def analytic_with_note(spec: "ModelSpec", plan: "Plan", why: str, device: str = "cuda") -> MemoryBreakdown:
    """The analytic estimate of a plan the simulated engine cannot run, with a note saying why."""
    import dataclasses

    from oomdoctor.engines import estimate

    bd = estimate(spec, plan, "analytic", device)
    return dataclasses.replace(bd, notes=bd.notes + (f"{why}: analytic estimate",))


__all__ = [
    "analytic_with_note",
    "simulate_plan",
    "estimate_simulated",
    "SimulationResult",
    "simulate_run",
    "real_cpu_run",
    "random_sharded_model",
    "fake_process_group",
    "extrapolate_from",
    "not_simulated",
]
