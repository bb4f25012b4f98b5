"""``tune``: the plan that fits, its largest micro-batch, the accumulation that keeps the effective batch — verified.

Computing only (``oomdoctor.cli.tune`` prints). Steps:

1. budget (``oomdoctor.plan.budget.resolve_budget``, the rule every verb uses): ``--gpu-mem``, else the local GPU's
   *free* memory through NVML (other processes' usage already subtracted), else BadInput; minus ``--margin``;
2. search (``oomdoctor.tune.search``): enumerate plans, drop those that do not fit the budget at
   micro-batch 1, size every survivor's micro-batch (binary search over the memory model, then the largest
   divisor of the global batch), rank by fidelity then estimated throughput (or throughput first); on N GPUs each
   technique stack climbs the strategy ladder (``oomdoctor.tune.strategies``); ``--seq-len max`` first finds the
   longest sequence (``oomdoctor.tune.longest``);
3. verify the winner (``oomdoctor.tune.verify``): on a real GPU a child process runs 2+ full steps at the longest
   sequence (``oomdoctor.engines.probe``); without a GPU the simulated engine replays the step on fake tensors. A
   failure steps the micro-batch down (next divisor, calibrated by the overshoot), then falls back to the next plan;
4. the result (``oomdoctor.tune.result.TuneResult``) carries everything ``--json`` prints;
   ``oomdoctor.tune.emit`` writes it as the ``oomdoctor train`` YAML or another trainer's config.
"""

from __future__ import annotations

from typing import Any

from oomdoctor.engines import estimate
from oomdoctor.engines.block_pool import prefetch
from oomdoctor.errors import BadInput, DoesNotFit
from oomdoctor.gpu import GpuInfo, detect_gpu, host_ram_bytes
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.model.execution import tiled_mlp_refusal, tiling_applies
from oomdoctor.model.load import load_spec
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import DEFAULT_MICRO_LIMIT, BatchChoice, choose_micro_batch
from oomdoctor.plan.budget import resolve_budget
from oomdoctor.plan.techniques import DEFAULTS, TECHNIQUES
from oomdoctor.progress import report
from oomdoctor.tune.batch_search import SEQ_STEP, Estimator
from oomdoctor.tune.longest import NOT_PINNED_BY_MAX, calibrated_context, longest_context
from oomdoctor.tune.ranking import Candidate
from oomdoctor.tune.result import TuneResult
from oomdoctor.tune.search import enumerate_candidates, search
from oomdoctor.tune.strategies import TOPOLOGY_FIELDS, climb, per_rank_batch, strategy_table, topology
from oomdoctor.tune.throughput import estimate_throughput, profile_for
from oomdoctor.tune.verify import (
    VERIFY_MODES,
    Trial,
    gpu_prober,
    peak_predictor,
    simulate_prober,
    verification_mode,
    verify,
)
from oomdoctor.units import format_bytes


def tune(
    model: str | ModelSpec,
    *,
    gpu_mem: int | None = None,
    seq_len: int | str | None = None,
    global_batch: int | None = None,
    method: str | None = None,
    prefer: str = "quality",
    margin: str | float | int | None = None,
    pins: dict[str, Any] | None = None,
    verify_mode: str = "auto",
    estimator: Estimator | None = None,
    probe_steps: int = 2,
    max_trials: int = 6,
    gpu: GpuInfo | None | bool = True,
    micro_limit: int = DEFAULT_MICRO_LIMIT,
    gpus_per_node: int | None = None,
    host_mem: int | None = None,
    device: str = "cuda",
) -> TuneResult:
    """Find the plan for ``model`` (see the module docstring). ``pins["world_size"]`` (``--gpus``) plans for that
    many GPUs (``gpus_per_node`` per node, default one node): each technique stack climbs the strategy ladder
    (``oomdoctor.tune.strategies``) and ``global_batch`` is the batch over every GPU. ``seq_len="max"``: the longest
    sequence any plan fits (``oomdoctor.tune.longest.longest_context``), then the plan for it. ``margin``: what
    ``oomdoctor.plan.budget.parse_margin`` reads (None: the default margin). ``gpu=True`` queries NVML,
    ``None``/``False`` means "no GPU" (tests), a :class:`GpuInfo` is used as given. ``host_mem``: the training
    machine's CPU RAM in bytes, which offload plans must fit (``--host-mem``; None: this machine's).
    ``device="cpu"``: a plan for a CPU run — priced without CUDA's context, workspace and allocator slack,
    ``gpu_mem`` the RAM its live tensors may fill (no NVML, no GPU verification); the emitted config says
    ``device: cpu``. ``estimator``: None prices with the analytic engine on ``device``."""
    if verify_mode not in VERIFY_MODES:
        raise BadInput(f"--verify {verify_mode!r}: use one of {', '.join(VERIFY_MODES)}")
    if verify_mode == "gpu" and device == "cpu":
        raise BadInput(
            "--verify gpu probes a CUDA GPU; --device cpu plans a CPU run",
            "use --verify simulate (fake-tensor replay) or none",
        )
    if global_batch is not None and (
        isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1
    ):
        raise BadInput(f"--global-batch must be a positive integer, got {global_batch!r}")
    spec = load_spec(model) if isinstance(model, str) else model
    model_ref = model if isinstance(model, str) else spec.name
    on_cpu = device == "cpu"
    gpu_info: GpuInfo | None = None if on_cpu else detect_gpu() if gpu is True else (gpu or None)
    budget = resolve_budget(gpu_mem, margin, gpu_info, on_cpu=on_cpu)
    if budget is None and on_cpu:
        raise BadInput(
            "--device cpu: tune needs the RAM the run may fill with tensors",
            "pass it with --mem, e.g. `oomdoctor tune MODEL --device cpu --mem 8GB`",
        )
    if budget is None:
        raise BadInput(
            "no --gpu-mem given and no NVIDIA GPU found (NVML): tune needs to know how much memory to plan for",
            "pass the card's memory, e.g. `oomdoctor tune MODEL --gpu-mem 24GB`",
        )
    analytic = estimator is None
    if estimator is None:

        def estimator(s: ModelSpec, p: Plan) -> MemoryBreakdown:
            return estimate(s, p, "analytic", device)

    capacity = budget.capacity_bytes
    notes = list(budget.notes)
    host_ram = host_mem if host_mem is not None else host_ram_bytes()

    all_pins = dict(pins or {})
    if method is not None:
        all_pins["method"] = method
    topo = topology(all_pins.get("world_size"), gpus_per_node)
    topo_pins = {k: all_pins.pop(k) for k in TOPOLOGY_FIELDS if k in all_pins}
    rank_batch = per_rank_batch(global_batch, topo.world_size)
    profile = profile_for(gpu_info.name if gpu_info else None)
    seq_max = seq_len == "max"
    if isinstance(seq_len, int):
        spec.check_seq_len(seq_len, "--seq-len")
    if seq_max:
        report("tune", "bisecting the longest sequence every plan fits")
        best, seq_len = longest_context(spec, all_pins, budget, estimator, profile, prefer, host_ram, topo.world_size)
        all_pins.update(
            {t.name: getattr(best, t.name) for t in TECHNIQUES if t.name not in NOT_PINNED_BY_MAX + TOPOLOGY_FIELDS}
        )
        notes.append(
            f"--seq-len max: {seq_len:,} tokens at micro-batch {best.micro_batch} is the longest sequence "
            f"any plan fits ({best.label()}; searched in steps of {SEQ_STEP} tokens"
            + (f" up to the model's {spec.position_limit:,} positions)" if spec.position_limit else ")")
        )
    elif isinstance(seq_len, str):
        raise BadInput(f"--seq-len {seq_len!r}: give a number of tokens or max")
    if seq_len is None:
        seq_len = min(Plan().seq_len, spec.max_position_embeddings or Plan().seq_len)
        notes.append(f"no --seq-len: planning for {seq_len} tokens per sequence (the longest batch sets the peak)")
    if global_batch is None:
        notes.append(
            "no --global-batch: the effective batch is the largest micro-batch that fits (accumulation 1); "
            "pass --global-batch to keep it fixed"
        )

    plans = enumerate_candidates(
        all_pins,
        Plan(seq_len=seq_len),
        bf16_supported=profile.bf16,
        chunked_loss=spec.arch_kind == "decoder",
        tiled_mlp=topo.world_size == 1 and tiling_applies(spec, seq_len),
        model_type=spec.model_type,
    )
    report("tune", f"searching {len(plans)} plans with the analytic memory model")
    if analytic:
        prefetch(spec, plans)  # the blocks the plans' estimates measure, on every core
    if topo.world_size == 1 and not topo_pins:
        result = search(
            spec,
            plans,
            budget,
            global_batch=rank_batch,
            estimator=estimator,
            prefer=prefer,  # type: ignore[arg-type]
            profile=profile,
            micro_limit=micro_limit,
            host_ram=host_ram,
            tiles="tiled_mlp" not in all_pins and tiled_mlp_refusal(spec) is None,
        )
        ladders: dict[Plan, list[Candidate]] = {}
    else:
        result, ladders = climb(
            spec,
            plans,
            budget,
            topo,
            topo_pins,
            global_batch=rank_batch,
            estimator=estimator,
            prefer=prefer,
            profile=profile,
            micro_limit=micro_limit,
            host_ram=host_ram,
        )
    if result.best is None:
        low = result.smallest
        raise DoesNotFit(
            f"no plan fits {budget.describe()} at seq_len {seq_len}: the leanest, {low.plan.label()}, needs "
            f"{format_bytes(budget.needed(low.memory))} at micro-batch 1",
            "try a shorter --seq-len, a smaller --margin, a bigger GPU"
            + (", more GPUs or another --strategy" if topo.world_size > 1 else "")
            + ", or see "
            f"`oomdoctor diagnose {model_ref} --gpu-mem {format_bytes(capacity, binary=False).replace(' ', '')} "
            f"--seq-len {seq_len}"
            + (f" --gpus {topo.world_size}" if topo.world_size > 1 else "")
            + (f" --strategy {topo_pins['strategy']}" if "strategy" in topo_pins else "")
            + "`",
        )

    predicted_peak = peak_predictor(spec, budget, estimator)
    mode, note = verification_mode(verify_mode, result.best.plan, gpu_info, gpu_mem, topo.world_size)
    if note:
        notes.append(note)
    chosen = result.best
    plan = chosen.plan
    trials: list[Trial] = []
    verification = "none"
    if mode != "none":
        prober = (
            gpu_prober(model_ref, spec, capacity, predicted_peak, steps=probe_steps)
            if mode == "gpu"
            else simulate_prober(spec, budget, predicted_peak, device)
        )
        cand, vplan, trials = verify(
            result.fitting,
            prober,
            global_batch=rank_batch,
            limit=budget.limit_bytes,
            capacity=capacity,
            predicted_peak=predicted_peak,
            max_trials=max_trials,
            micro_limit=micro_limit,
        )
        verification = mode if plan.trainer == DEFAULTS["trainer"] else f"{mode}:{plan.trainer}"
        if vplan is not None and cand is not None:
            if cand is not chosen:
                notes.append(f"{chosen.plan.label()} failed verification; using the next plan, {cand.plan.label()}")
            chosen, plan = cand, vplan
        elif trials and trials[-1].outcome == "error":
            notes.append(
                f"verification by {mode} could not run ({trials[-1].message}); the plan is the memory "
                "model's prediction, unverified"
            )
            verification = f"{mode} (failed to run)"
        elif (
            seq_max
            and any(t.measured_peak_bytes for t in trials)
            and (shorter := calibrated_context(spec, plan, budget, estimator, trials, seq_len))
        ):
            # the memory model's longest context did not verify: calibrated by the verified overshoot, a shorter
            # context is planned and verified again (once: that plan's sequence length is a number)
            # the techniques of the longest-context plan stay pinned, as they were for the search at max
            again = tune(
                spec,
                gpu_mem=gpu_mem,
                seq_len=shorter,
                global_batch=global_batch,
                method=None,
                prefer=prefer,
                margin=margin,
                pins={**all_pins, **topo_pins},
                verify_mode=verify_mode,
                estimator=estimator,
                probe_steps=probe_steps,
                max_trials=max_trials,
                gpu=gpu_info if gpu_info else False,
                micro_limit=micro_limit,
                gpus_per_node=gpus_per_node,
                host_mem=host_mem,
                device=device,
            )
            again.notes.insert(
                0,
                f"--seq-len max: the memory model's longest sequence, {seq_len:,} tokens, failed "
                f"verification by {mode}; {shorter:,} tokens (calibrated by the verified peak) is "
                "the plan",
            )
            return again
        else:
            raise DoesNotFit(
                f"the predicted plans failed verification by {mode} ({len(trials)} trial(s)): "
                + "; ".join(f"{t.plan_label} micro-batch {t.micro_batch}: {t.outcome}" for t in trials),
                "raise --margin, shorten --seq-len, or check other processes on the GPU (nvidia-smi)",
            )
    if mode == "simulate":
        notes.append(
            "no GPU verification: the plan was checked with the simulated engine (the real Hugging Face "
            "training step replayed on fake tensors), not on a device"
        )
    if plan.micro_batch != chosen.plan.micro_batch:
        model_max = chosen.batch.max_micro_batch if chosen.batch else plan.micro_batch
        moved_up = plan.micro_batch > chosen.plan.micro_batch
        batch = BatchChoice(
            max(model_max, plan.micro_batch) if moved_up else plan.micro_batch,
            plan.micro_batch,
            plan.grad_accum,
            rank_batch,
            f"verification moved the micro-batch from {chosen.plan.micro_batch} to "
            f"{plan.micro_batch} (measured, not predicted)",
        )
        memory = estimator(spec, plan)
    else:
        batch = chosen.batch or choose_micro_batch(plan.micro_batch, rank_batch)
        memory = chosen.memory
    if batch.note:
        notes.append(batch.note)
    throughput = estimate_throughput(spec, plan, profile, memory)
    if profile is not None and gpu_info is None:
        notes.append(f"throughput ranks use the {profile.name} profile (no GPU detected)")
    strategies = strategy_table(chosen, ladders, budget, topo)
    return TuneResult(
        spec=spec,
        budget=budget,
        gpu=gpu_info,
        prefer=prefer,
        seq_len=seq_len,
        global_batch=global_batch,
        plan=plan,
        memory=memory,
        batch=batch,
        throughput=throughput,
        search=result,
        trials=trials,
        verification=verification,
        notes=notes,
        topology=topo,
        strategies=strategies,
        device=device,
    )


__all__ = ["tune"]
