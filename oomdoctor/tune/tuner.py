"""``tune``: the plan that fits, its largest micro-batch, the accumulation that keeps the effective batch — verified.

Computing only (``oomdoctor.cli.tune`` prints). Steps:

1. budget (``oomdoctor.plan.budget.resolve_budget``, the rule every verb uses): ``--gpu-mem``, else the local GPU's
   *free* memory through NVML (other processes' usage already subtracted), else BadInput; minus ``--margin``;
2. search (``oomdoctor.tune.search``): enumerate plans, drop those that do not fit the budget at
   micro-batch 1, size every survivor's micro-batch (binary search over the memory model, then the largest
   divisor of the global batch), rank by fidelity then estimated throughput (or throughput first);
3. verify the winner: on a real GPU a child process runs 2+ full steps at the longest sequence
   (``oomdoctor.engines.probe``); without a GPU the simulated engine replays the step on fake tensors. A failure steps
   the micro-batch down (next divisor, calibrated by the overshoot), then falls back to the next plan;
4. the result carries everything ``--json`` prints; :func:`write_config` emits the ``oomdoctor train`` YAML
   through the train renderer (atomically, never overwriting an existing file unless asked).
"""

from __future__ import annotations

import os
import shlex
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput, DoesNotFit
from oomdoctor.files import free_path, write_text_atomic
from oomdoctor.gpu import GpuInfo, detect_gpu, host_ram_bytes
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.plan import Plan
from oomdoctor.model.load import load_spec
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan.batch import DEFAULT_MICRO_LIMIT, BatchChoice, choose_micro_batch, divisors
from oomdoctor.plan.budget import Budget, resolve_budget
from oomdoctor.resources import TINY_DATASET, TINY_TOKENIZER, bundled_path, is_bundled
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.plan.targets import refusals
from oomdoctor.plan.techniques import DEFAULTS, TECHNIQUES
from oomdoctor.progress import report
from oomdoctor.tune.batch_search import (MAX_SEQ_LEN, SEQ_STEP, Estimator, longest_seq_len,
                                        verify_and_refine)
from oomdoctor.tune.ranking import Candidate, fidelity_key
from oomdoctor.memory.sharding import node_host_bytes
from oomdoctor.memory.context import tiled_mlp_refusal, tiling_applies
from oomdoctor.tune.search import SearchResult, enumerate_candidates, host_bytes, price, rank, search
from oomdoctor.tune.strategies import TOPOLOGY_FIELDS, StrategyTrial, Topology, ladder, topology, trials
from oomdoctor.tune.throughput import HardwareProfile, Throughput, estimate_throughput, profile_for
from oomdoctor.units import format_bytes

#: Recommended caching-allocator setting: expandable segments map more memory into one growing segment instead of
#: fixed-size blocks, so freed blocks of different sizes can be reused (fragmentation is the "reserved but
#: unallocated" part of an OOM message). torch >= 2.1; CUDA only (ignored on ROCm/CPU). See torchtune #1185.
ALLOC_CONF = "expandable_segments:True"

#: Default file ``tune`` writes (a numbered sibling is used when it exists; see :func:`default_output_path`).
DEFAULT_OUTPUT = "oomdoctor-plan.yaml"

#: The bundled sample dataset the emitted config points at unless ``--dataset`` is given (a ``bundled:`` name:
#: resolves after a wheel install, from any directory).
SAMPLE_DATASET = TINY_DATASET
#: Tokenizer used with ``init: random`` configs (config-only models) unless ``--tokenizer`` is given.
SAMPLE_TOKENIZER = TINY_TOKENIZER

VERIFY_MODES: tuple[str, ...] = ("auto", "gpu", "simulate", "none")


@dataclass(frozen=True)
class Trial:
    """One verification of a (plan, micro-batch): a real GPU probe or a simulated step."""

    micro_batch: int
    grad_accum: int
    outcome: str
    """``fits``, ``oom`` (out of memory / over the budget) or ``error`` (the probe itself failed)."""
    verified_by: str
    """``gpu`` (child process on the real device) or ``simulate`` (fake-tensor replay)."""
    plan_label: str
    predicted_peak_bytes: int
    """The search's (analytic) ``peak_device`` for this micro-batch."""
    measured_peak_bytes: int | None = None
    """GPU: peak device memory used by the probe (reserved + context); simulate: what the budget counts of its
    breakdown (``resident_device``)."""
    measured_peak_allocated_bytes: int | None = None
    """GPU: ``torch.cuda.max_memory_allocated``; simulate: its ``peak_allocated``."""
    steps: int = 0
    """Full training steps run (forward, backward, optimizer step)."""
    seconds: float = 0.0
    message: str | None = None

    def to_dict(self) -> dict:
        return {
            "micro_batch": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "outcome": self.outcome,
            "verified_by": self.verified_by,
            "plan": self.plan_label,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_peak_allocated_bytes": self.measured_peak_allocated_bytes,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "message": self.message,
        }


#: A prober runs one (plan, micro-batch) and returns a Trial; ``predicted`` is the analytic peak.
Prober = Callable[[Plan, int], Trial]


@dataclass
class TuneResult:
    """Everything ``oomdoctor tune`` reports (``--json`` prints :meth:`to_dict`)."""

    spec: ModelSpec
    budget: Budget
    """Capacity, where it came from, margin, and the fits rule every plan was checked with."""
    gpu: GpuInfo | None
    prefer: str
    seq_len: int
    global_batch: int | None
    plan: Plan
    """The chosen plan with ``micro_batch`` and ``grad_accum`` set."""
    memory: MemoryBreakdown
    """Memory model breakdown of the chosen plan (same keys as ``diagnose``)."""
    batch: BatchChoice
    throughput: Throughput | None
    search: SearchResult
    trials: list[Trial] = field(default_factory=list)
    verification: str = "none"
    """``gpu``, ``simulate`` or ``none`` — what checked the prediction."""
    notes: list[str] = field(default_factory=list)
    alloc_conf: str = ALLOC_CONF
    config_path: str | None = None
    """Where the YAML was written (set by :func:`write_config`)."""
    topology: Topology = Topology(1, 1)
    """The GPUs planned for (``--gpus``, ``--gpus-per-node``)."""
    strategies: list[StrategyTrial] = field(default_factory=list)
    """The strategies tried for the chosen plan's stack, cheapest first, up to the chosen one (N > 1)."""
    device: str = "cuda"
    """The device the plan is priced for and emitted for: ``cuda`` or ``cpu`` (``--device``)."""

    @property
    def host_per_node_bytes(self) -> int:
        """Host RAM one node needs for what the plan offloads (0: nothing offloaded)."""
        return node_host_bytes(self.memory.host_per_node, self.plan, self.topology.gpus_per_node)

    @property
    def capacity_bytes(self) -> int:
        return self.budget.capacity_bytes

    @property
    def capacity_source(self) -> str:
        return self.budget.source

    @property
    def budget_bytes(self) -> int:
        """``capacity - margin``: the most a plan may keep resident."""
        return self.budget.limit_bytes

    @property
    def command(self) -> str:
        """The exact command that runs the emitted config (a GPU run with the recommended allocator setting)."""
        path = self.config_path or DEFAULT_OUTPUT
        env = f"PYTORCH_CUDA_ALLOC_CONF={self.alloc_conf} " if self.device == "cuda" else ""
        return f"{env}oomdoctor train {shlex.quote(path)}{self.launch_flags}"

    @property
    def launch_flags(self) -> str:
        """torchrun's process counts for ``oomdoctor train`` (empty on one GPU)."""
        t = self.topology
        if t.world_size == 1:
            return ""
        return f" --nproc-per-node {t.gpus_per_node}" + (f" --nnodes {t.nodes}" if t.nodes > 1 else "")

    def summary_lines(self) -> tuple[str, ...]:
        """The card, the plan and its batch, the predicted and verified peaks: the header of every file tune
        writes."""
        plan, measured = self.plan, self.measured_peak_bytes
        return (
            f"Tuned for {self.spec.name} on {format_bytes(self.capacity_bytes)} ({self.capacity_source}"
            f"{', a CPU run' if self.device == 'cpu' else ''}), margin "
            f"{format_bytes(self.budget.margin_bytes)}, seq_len {self.seq_len}.",
            f"Plan: {plan.label()}; micro-batch {plan.micro_batch} x {plan.grad_accum} accumulation = effective "
            f"batch {plan.effective_batch}.",
            f"Predicted {self.budget.counted.replace('_', ' ')} {format_bytes(self.budget.needed(self.memory))} of "
            f"{format_bytes(self.budget_bytes)} budget; verification: {self.verification}"
            + (f", {'measured' if self.verification == 'gpu' else 'replayed'} {format_bytes(measured)}"
               if measured is not None else "") + ".",
        )

    @property
    def measured_peak_bytes(self) -> int | None:
        ok = [t for t in self.trials if t.outcome == "fits" and t.micro_batch == self.plan.micro_batch]
        return ok[-1].measured_peak_bytes if ok else None

    def to_dict(self, max_candidates: int = 10) -> dict:
        s = self.spec
        plan = dict(self.plan.settings())
        plan["label"] = self.plan.label()
        return {
            "model": {"name": s.name, "model_type": s.model_type, "params": s.num_params, "source": s.source},
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "capacity_source": self.capacity_source,
            "margin_bytes": self.budget.margin_bytes,
            "budget_bytes": self.budget_bytes,
            "budget": self.budget.to_dict(),
            "gpu": self.gpu.to_dict() if self.gpu else None,
            "prefer": self.prefer,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "plan": plan,
            "memory": self.memory.to_dict(),
            "batch": self.batch.to_dict(),
            "throughput": self.throughput.to_dict() if self.throughput else None,
            "verification": self.verification,
            "trials": [t.to_dict() for t in self.trials],
            "measured_peak_bytes": self.measured_peak_bytes,
            "config_path": self.config_path,
            "command": self.command if self.config_path else None,
            "pytorch_cuda_alloc_conf": self.alloc_conf,
            "candidates": [c.to_dict() for c in self.search.candidates[:max_candidates]],
            "candidates_total": len(self.search.candidates),
            "candidates_fitting": len(self.search.fitting),
            "memory_evaluations": self.search.evaluations,
            "world_size": self.topology.world_size,
            "gpus_per_node": self.topology.gpus_per_node,
            "host_per_node_bytes": self.host_per_node_bytes,
            "strategies": [t.to_dict() for t in self.strategies],
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------- verification


def simulate_prober(spec: ModelSpec, budget: Budget, predicted: Callable[[Plan], int],
                    device: str = "cuda") -> Prober:
    """Verification without a GPU: ``estimate(spec, plan, "simulate", device)`` (the real HF step on fake tensors),
    judged by ``budget.fits``."""

    def run(plan: Plan, micro: int) -> Trial:
        p = plan.with_(micro_batch=micro)
        report("verify", f"verifying {p.label()} at micro-batch {micro} x {p.grad_accum}: the training step "
                         "replayed on fake tensors")
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():  # transformers deprecation chatter from the replayed step
                warnings.simplefilter("ignore")
                mem = estimate(spec, p, "simulate", device)
        except Exception as exc:  # noqa: BLE001 - any simulator failure is reported, not fatal
            return Trial(micro, p.grad_accum, "error", "simulate", p.label(), predicted(p),
                         seconds=time.perf_counter() - t0, message=f"{type(exc).__name__}: {exc}"[:500])
        ok = budget.fits(mem)
        return Trial(
            micro, p.grad_accum, "fits" if ok else "oom", "simulate", p.label(), predicted(p),
            measured_peak_bytes=budget.needed(mem), measured_peak_allocated_bytes=mem.peak_allocated,
            steps=2, seconds=time.perf_counter() - t0,
            message=None if ok else (f"simulated {budget.counted.replace('_', ' ')} {format_bytes(budget.needed(mem))}"
                                     f" > budget {format_bytes(budget.limit_bytes)}"),
        )

    return run


def gpu_prober(model_ref: str, spec: ModelSpec, capacity: int, predicted: Callable[[Plan], int], *,
               steps: int = 2, timeout_s: float = 900.0) -> Prober:
    """Verification on the local GPU: a child process runs ``steps`` real steps (``oomdoctor.engines.probe``), its
    allocator capped at ``capacity`` so that an OOM means "does not fit the card you planned for"."""

    def run(plan: Plan, micro: int) -> Trial:
        from oomdoctor.engines.probe import run_probe

        p = plan.with_(micro_batch=micro)
        report("verify", f"verifying {p.label()} at micro-batch {micro} x {p.grad_accum}: {steps} real steps on the "
                         "GPU in a child process")
        res = run_probe(model_ref, p, device="cuda", steps=steps, cap_bytes=capacity, timeout_s=timeout_s)
        return Trial(
            micro, p.grad_accum, res.outcome, "gpu", p.label(), predicted(p),
            measured_peak_bytes=res.peak_device_bytes, measured_peak_allocated_bytes=res.peak_allocated_bytes,
            steps=res.steps, seconds=res.seconds, message=res.message,
        )

    return run


class _ProbeFailed(Exception):
    pass


def verify(
    candidates: list[Candidate],
    prober: Prober,
    *,
    global_batch: int | None,
    limit: int,
    capacity: int,
    predicted_peak: Callable[[Plan], int],
    max_trials: int = 6,
    micro_limit: int = DEFAULT_MICRO_LIMIT,
    refine: bool = True,
) -> tuple[Candidate | None, Plan | None, list[Trial]]:
    """Verify the best candidate at its micro-batch, refine once upwards when the measurement shows room, step
    down (calibrated by the overshoot) when it fails, and move to the next candidate when even micro-batch 1
    fails (``oomdoctor.tune.batch_search.verify_and_refine``; ``limit`` is the budget's ``capacity - margin``,
    ``predicted_peak`` what it counts). Sizes stay divisors of the global batch.

    Returns (candidate, verified plan, trials). The plan is None when every trial failed or the trial budget ran
    out; an ``error`` outcome (the probe could not run at all) stops verification with plan None."""
    trials: list[Trial] = []
    allowed = divisors(global_batch, upto=micro_limit) if global_batch else range(1, micro_limit + 1)
    for cand in candidates:
        if not cand.fits or len(trials) >= max_trials:
            continue

        def sized(b: int, cand: Candidate = cand) -> Plan:
            return cand.plan.with_(micro_batch=b, grad_accum=(global_batch // b) if global_batch else 1)

        def trial(b: int) -> tuple[bool, int | None]:
            t = prober(sized(b), b)
            trials.append(t)
            if t.outcome == "error":
                raise _ProbeFailed(t.message)
            return t.outcome == "fits", t.measured_peak_bytes

        try:
            best, _ = verify_and_refine(cand.plan.micro_batch, allowed, lambda b: predicted_peak(sized(b)), trial,
                                        limit, capacity, max_trials=max_trials - len(trials), refine=refine)
        except _ProbeFailed:
            return cand, None, trials
        if best:
            return cand, sized(best), trials
    return None, None, trials


# ---------------------------------------------------------------------------------------------- tune


#: ``--seq-len max`` with tiled MLPs looks up to this many times a plan's longest untiled sequence.
TILED_REACH = 4
#: Knobs ``--seq-len max`` leaves to the regular search once the sequence is known.
NOT_PINNED_BY_MAX = ("micro_batch", "grad_accum", "seq_len")


def tiling_finalists(found: list[tuple[int, Plan]]) -> list[tuple[int, Plan]]:
    """The plans ``--seq-len max`` tries with tiled MLPs: of each group of plans that differ only in what does not
    grow with the sequence (the optimizer, its implementation, double quantization: constant bytes), the one with
    the longest untiled sequence — tiles save the same bytes per token across a group, so its longest plan stays
    its longest tiled. Longest first; the optimizer in backward cannot run tiles. Groups, not a couple of overall
    finalists: a plan that reaches less untiled can reach more tiled (its MLP the larger share of what grows), and a
    pinned knob would find it (Llama-3.3-70B QLoRA on 80 GB: 33,792 tokens unpinned, 89,728 with --tiled-mlp)."""
    from dataclasses import replace

    from oomdoctor.plan.techniques import DEFAULTS

    best: dict[Plan, tuple[int, Plan]] = {}
    for s, p in found:
        if p.optimizer_in_backward:
            continue
        key = replace(p, optimizer=DEFAULTS["optimizer"], optimizer_impl=DEFAULTS["optimizer_impl"],
                      double_quant=False, seq_len=SEQ_STEP)
        if s > best.get(key, (0, p))[0]:
            best[key] = (s, p)
    return sorted(best.values(), key=lambda sp: -sp[0])


def longest_context(spec: ModelSpec, pins: dict[str, Any], budget: Budget, estimator: Estimator,
                    profile: HardwareProfile, prefer: str, host_ram: int | None,
                    world_size: int = 1) -> tuple[Plan, int]:
    """The plan that fits the longest sequence (micro-batch ``pins["micro_batch"]`` or 1) and that length: every
    candidate plan's longest sequence by bisection (:func:`longest_seq_len`, up to the model's positions,
    :attr:`ModelSpec.position_limit`; offload and paged-optimizer plans only
    within ``host_ram`` bytes of CPU RAM, ``search.host_bytes``; None: unchecked), the longest wins, ties broken by
    the quality tier, then by the untiled MLP. Tiled MLPs (unless pinned off; one GPU, a model that runs them: ``memory.context.tiled_mlp_refusal``): each
    :func:`tiling_finalists` plan is bisected again with its MLPs tiled, from its untiled length up to
    :data:`TILED_REACH` times it (each power of two a block replay, seconds, cached per block shape) — unless one
    more step does not fit tiled (tiles gain it nothing) or its reach cannot beat a tiled plan already found;
    pinned on, only tiled plans count. No single pinned knob finds a longer sequence (tests/test_search_pins.py).
    DoesNotFit when no plan fits even one step of tokens."""
    micro = int(pins.get("micro_batch", 1))
    tiled_pin = pins.get("tiled_mlp")
    plans = enumerate_candidates({k: v for k, v in pins.items() if k not in ("micro_batch", "tiled_mlp")},
                                 Plan(seq_len=SEQ_STEP), bf16_supported=profile.bf16,
                                 chunked_loss=spec.arch_kind == "decoder", model_type=spec.model_type)

    def host_fits(p: Plan, mem) -> bool:  # what it offloads or pages out must fit this machine's RAM
        return host_ram is None or host_bytes(mem, budget, p) <= host_ram

    def at(p: Plan, s: int) -> Plan:
        return p.with_(seq_len=s, micro_batch=micro, grad_accum=1)

    reach = min(MAX_SEQ_LEN, spec.position_limit or MAX_SEQ_LEN)  # never past the model's positions

    def longest_of(plans: list[Plan], start: int = SEQ_STEP, limit: int = reach) -> list[tuple[int, Plan]]:
        found = [(longest_seq_len(spec, p, budget, estimator, micro_batch=micro, start=start, limit=limit,
                                  accept=host_fits), p) for p in plans]
        return [(s, at(p, s)) for s, p in found if s > 0]

    def gains(p: Plan, s: int) -> bool:  # one more step fits
        mem = estimator(spec, at(p, s + SEQ_STEP))
        return budget.fits(mem) and host_fits(at(p, s + SEQ_STEP), mem)

    found = longest_of(plans)
    if tiled_pin or (tiled_pin is None and world_size == 1 and tiled_mlp_refusal(spec) is None):
        tiled: list[tuple[int, Plan]] = []
        for s, p in tiling_finalists(found):
            limit = min(reach, max(s, SEQ_STEP) * TILED_REACH)
            reached = max((t for t, _ in tiled), default=0)
            if limit < reached or s + SEQ_STEP > limit:
                continue
            tp = p.with_(tiled_mlp=True)
            if not tiled_pin and not gains(tp, s):
                continue
            tiled += longest_of([tp], start=s + SEQ_STEP if not tiled_pin else s, limit=limit)
        found = tiled if tiled_pin else found + tiled
    if not found:
        raise DoesNotFit(f"no plan fits {budget.describe()} even at {SEQ_STEP} tokens per sequence",
                         f"see `oomdoctor diagnose {spec.name} --seq-len {SEQ_STEP}` for what is missing")
    longest = max(s for s, _ in found)
    ties = [Candidate(p, estimator(spec, p), None) for s, p in found if s == longest]
    best = min(ties, key=lambda c: (fidelity_key(c.plan) if prefer == "quality" else (0,), c.plan.tiled_mlp))
    return best.plan, longest


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
    (``oomdoctor.tune.strategies``) and ``global_batch`` is the batch over every GPU. ``seq_len="max"``: the longest sequence any plan fits
    (:func:`longest_context`), then the plan for it. ``margin``: what ``oomdoctor.plan.budget.parse_margin``
    reads (None: the default margin). ``gpu=True`` queries NVML, ``None``/``False`` means "no GPU" (tests), a
    :class:`GpuInfo` is used as given. ``host_mem``: the training machine's CPU RAM in bytes, which offload plans must fit
    (``--host-mem``; None: this machine's). ``device="cpu"``: a plan for a CPU run — priced without CUDA's context,
    workspace and allocator slack, ``gpu_mem`` the RAM its live tensors may fill (no NVML, no GPU verification); the
    emitted config says ``device: cpu``. ``estimator``: None prices with the analytic engine on ``device``."""
    if verify_mode not in VERIFY_MODES:
        raise BadInput(f"--verify {verify_mode!r}: use one of {', '.join(VERIFY_MODES)}")
    if verify_mode == "gpu" and device == "cpu":
        raise BadInput("--verify gpu probes a CUDA GPU; --device cpu plans a CPU run",
                       "use --verify simulate (fake-tensor replay) or none")
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):
        raise BadInput(f"--global-batch must be a positive integer, got {global_batch!r}")
    spec = load_spec(model) if isinstance(model, str) else model
    model_ref = model if isinstance(model, str) else spec.name
    on_cpu = device == "cpu"
    gpu_info: GpuInfo | None = None if on_cpu else detect_gpu() if gpu is True else (gpu or None)
    budget = resolve_budget(gpu_mem, margin, gpu_info, on_cpu=on_cpu)
    if budget is None and on_cpu:
        raise BadInput("--device cpu: tune needs the RAM the run may fill with tensors",
                       "pass it with --mem, e.g. `oomdoctor tune MODEL --device cpu --mem 8GB`")
    if budget is None:
        raise BadInput(
            "no --gpu-mem given and no NVIDIA GPU found (NVML): tune needs to know how much memory to plan for",
            "pass the card's memory, e.g. `oomdoctor tune MODEL --gpu-mem 24GB`",
        )
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
    rank_batch = _rank_batch(global_batch, topo.world_size)
    profile = profile_for(gpu_info.name if gpu_info else None)
    seq_max = seq_len == "max"
    if isinstance(seq_len, int):
        spec.check_seq_len(seq_len, "--seq-len")
    if seq_max:
        report("tune", "bisecting the longest sequence every plan fits")
        best, seq_len = longest_context(spec, all_pins, budget, estimator, profile, prefer, host_ram,
                                        topo.world_size)
        all_pins.update({t.name: getattr(best, t.name) for t in TECHNIQUES
                         if t.name not in NOT_PINNED_BY_MAX + TOPOLOGY_FIELDS})
        notes.append(f"--seq-len max: {seq_len:,} tokens at micro-batch {best.micro_batch} is the longest sequence "
                     f"any plan fits ({best.label()}; searched in steps of {SEQ_STEP} tokens"
                     + (f" up to the model's {spec.position_limit:,} positions)" if spec.position_limit else ")"))
    elif isinstance(seq_len, str):
        raise BadInput(f"--seq-len {seq_len!r}: give a number of tokens or max")
    if seq_len is None:
        seq_len = min(Plan().seq_len, spec.max_position_embeddings or Plan().seq_len)
        notes.append(f"no --seq-len: planning for {seq_len} tokens per sequence (the longest batch sets the peak)")
    if global_batch is None:
        notes.append("no --global-batch: the effective batch is the largest micro-batch that fits (accumulation 1); "
                     "pass --global-batch to keep it fixed")

    plans = enumerate_candidates(all_pins, Plan(seq_len=seq_len), bf16_supported=profile.bf16,
                                 chunked_loss=spec.arch_kind == "decoder",
                                 tiled_mlp=topo.world_size == 1 and tiling_applies(spec, seq_len),
                                 model_type=spec.model_type)
    report("tune", f"searching {len(plans)} plans with the analytic memory model")
    if topo.world_size == 1 and not topo_pins:
        result = search(spec, plans, budget, global_batch=rank_batch, estimator=estimator, prefer=prefer,  # type: ignore[arg-type]
                        profile=profile, micro_limit=micro_limit, host_ram=host_ram,
                        tiles="tiled_mlp" not in all_pins and tiled_mlp_refusal(spec) is None)
        ladders: dict[Plan, list[Candidate]] = {}
    else:
        result, ladders = _climb(spec, plans, budget, topo, topo_pins, global_batch=rank_batch, estimator=estimator,
                                 prefer=prefer, profile=profile, micro_limit=micro_limit, host_ram=host_ram)
    if result.best is None:
        low = result.smallest
        raise DoesNotFit(
            f"no plan fits {budget.describe()} at seq_len {seq_len}: the leanest, {low.plan.label()}, needs "
            f"{format_bytes(budget.needed(low.memory))} at micro-batch 1",
            "try a shorter --seq-len, a smaller --margin, a bigger GPU"
            + (", more GPUs or another --strategy" if topo.world_size > 1 else "") + ", or see "
            f"`oomdoctor diagnose {model_ref} --gpu-mem {format_bytes(capacity, binary=False).replace(' ', '')} "
            f"--seq-len {seq_len}"
            + (f" --gpus {topo.world_size}" if topo.world_size > 1 else "")
            + (f" --strategy {topo_pins['strategy']}" if "strategy" in topo_pins else "") + "`",
        )

    pred_cache: dict[Plan, int] = {}

    def predicted_peak(p: Plan) -> int:
        key = p.with_(grad_accum=min(p.grad_accum, 2))  # memory only sees accumulation 1 vs >= 2
        if key not in pred_cache:
            pred_cache[key] = budget.needed(estimator(spec, key))
        return pred_cache[key]

    mode = verify_mode
    if mode == "auto" and result.best.plan.strategy in DEEPSPEED:
        mode = "none"
        notes.append(f"{result.best.plan.strategy}: DeepSpeed is priced by its formulas only (the simulated engine "
                     "replays FSDP ranks and DDP, not DeepSpeed): the plan is unverified")
    foreign = result.best.plan.trainer != DEFAULTS["trainer"]
    if mode == "auto":
        on_gpu = gpu_info is not None and (gpu_mem is None or gpu_mem <= gpu_info.free_bytes)
        # the GPU probe runs oomdoctor's own step: another trainer's plan is verified by replaying that trainer's
        mode = "gpu" if on_gpu and topo.world_size == 1 and not foreign else "simulate"
    if mode == "gpu" and foreign:
        raise BadInput(f"--verify gpu runs oomdoctor's own step, not {result.best.plan.trainer}'s",
                       "use --verify simulate (the trainer's own step replayed on fake tensors) or none")
    if mode == "gpu" and gpu_info is None:
        raise BadInput("--verify gpu: no NVIDIA GPU found", "use --verify simulate (fake-tensor replay) or none")
    if mode == "gpu" and topo.world_size > 1:
        raise BadInput(f"--verify gpu probes one process; a plan for {topo.world_size} GPUs cannot run there",
                       "use --verify simulate (one rank replayed with a fake process group) or none")
    chosen = result.best
    plan = chosen.plan
    trials: list[Trial] = []
    verification = "none"
    if mode != "none":
        prober = (gpu_prober(model_ref, spec, capacity, predicted_peak, steps=probe_steps) if mode == "gpu"
                  else simulate_prober(spec, budget, predicted_peak, device))
        cand, vplan, trials = verify(result.fitting, prober, global_batch=rank_batch, limit=budget.limit_bytes,
                                     capacity=capacity, predicted_peak=predicted_peak, max_trials=max_trials,
                                     micro_limit=micro_limit)
        verification = mode if plan.trainer == DEFAULTS["trainer"] else f"{mode}:{plan.trainer}"
        if vplan is not None and cand is not None:
            if cand is not chosen:
                notes.append(f"{chosen.plan.label()} failed verification; using the next plan, {cand.plan.label()}")
            chosen, plan = cand, vplan
        elif trials and trials[-1].outcome == "error":
            notes.append(f"verification by {mode} could not run ({trials[-1].message}); the plan is the memory "
                         "model's prediction, unverified")
            verification = f"{mode} (failed to run)"
        elif seq_max and any(t.measured_peak_bytes for t in trials) and (
                shorter := calibrated_context(spec, plan, budget, estimator, trials, seq_len)):
            # the memory model's longest context did not verify: calibrated by the verified overshoot, a shorter
            # context is planned and verified again (once: that plan's sequence length is a number)
            # the techniques of the longest-context plan stay pinned, as they were for the search at max
            again = tune(spec, gpu_mem=gpu_mem, seq_len=shorter, global_batch=global_batch, method=None,
                         prefer=prefer, margin=margin, pins={**all_pins, **topo_pins}, verify_mode=verify_mode,
                         estimator=estimator, probe_steps=probe_steps, max_trials=max_trials,
                         gpu=gpu_info if gpu_info else False, micro_limit=micro_limit, gpus_per_node=gpus_per_node,
                         host_mem=host_mem, device=device)
            again.notes.insert(0, f"--seq-len max: the memory model's longest sequence, {seq_len:,} tokens, failed "
                                  f"verification by {mode}; {shorter:,} tokens (calibrated by the verified peak) is "
                                  "the plan")
            return again
        else:
            raise DoesNotFit(
                f"the predicted plans failed verification by {mode} ({len(trials)} trial(s)): "
                + "; ".join(f"{t.plan_label} micro-batch {t.micro_batch}: {t.outcome}" for t in trials),
                "raise --margin, shorten --seq-len, or check other processes on the GPU (nvidia-smi)",
            )
    if mode == "simulate":
        notes.append("no GPU verification: the plan was checked with the simulated engine (the real Hugging Face "
                     "training step replayed on fake tensors), not on a device")
    if plan.micro_batch != chosen.plan.micro_batch:
        model_max = chosen.batch.max_micro_batch if chosen.batch else plan.micro_batch
        moved_up = plan.micro_batch > chosen.plan.micro_batch
        batch = BatchChoice(max(model_max, plan.micro_batch) if moved_up else plan.micro_batch, plan.micro_batch,
                            plan.grad_accum, rank_batch,
                            f"verification moved the micro-batch from {chosen.plan.micro_batch} to "
                            f"{plan.micro_batch} (measured, not predicted)")
        memory = estimator(spec, plan)
    else:
        batch = chosen.batch or choose_micro_batch(plan.micro_batch, rank_batch)
        memory = chosen.memory
    if batch.note:
        notes.append(batch.note)
    throughput = estimate_throughput(spec, plan, profile, memory)
    if profile is not None and gpu_info is None:
        notes.append(f"throughput ranks use the {profile.name} profile (no GPU detected)")
    strategies = _strategy_table(chosen, ladders, budget, topo)
    return TuneResult(
        spec=spec, budget=budget, gpu=gpu_info, prefer=prefer, seq_len=seq_len, global_batch=global_batch, plan=plan, memory=memory,
        batch=batch, throughput=throughput, search=result, trials=trials, verification=verification, notes=notes,
        topology=topo, strategies=strategies, device=device,
    )


def calibrated_context(spec: ModelSpec, plan: Plan, budget: Budget, estimator: Estimator, trials: list[Trial],
                       failed: int) -> int:
    """The longest sequence below ``failed`` at which ``plan`` fits once the memory model is scaled by the worst
    verified overshoot (measured / predicted peak of the failed trials); 0 when none does."""
    k = max(t.measured_peak_bytes / max(t.predicted_peak_bytes, 1) for t in trials if t.measured_peak_bytes)
    return longest_seq_len(spec, plan, budget, estimator, micro_batch=plan.micro_batch, limit=failed - 1,
                           overshoot=max(k, 1.0))


def _rank_batch(global_batch: int | None, world_size: int) -> int | None:
    """The batch one rank accumulates: ``global_batch / world_size`` (effective batch = micro x accumulation x
    world size); BadInput when the GPUs cannot share it evenly."""
    if global_batch is None or world_size == 1:
        return global_batch
    if global_batch % world_size:
        lower = global_batch // world_size * world_size
        raise BadInput(f"--global-batch {global_batch} does not split over {world_size} GPUs "
                       "(effective batch = micro-batch x accumulation x GPUs)",
                       f"use a multiple of {world_size}, e.g. --global-batch {lower or world_size} or "
                       f"{lower + world_size}")
    return global_batch // world_size


def _climb(spec: ModelSpec, stacks: list[Plan], budget: Budget, topo: Topology, pins: dict[str, Any], *,
           global_batch: int | None, estimator: Estimator, prefer: str, profile: HardwareProfile,
           micro_limit: int, host_ram: int | None) -> tuple[SearchResult, dict[Plan, list[Candidate]]]:
    """Each stack climbs its strategy ladder until a rung fits (``oomdoctor.tune.strategies``); the kept rungs are
    ranked like single-GPU plans. Returns the ranking and every stack's priced rungs (ladder order)."""
    from oomdoctor.plan.batch import SearchTrace

    trace = SearchTrace()
    cands: list[Candidate] = []
    ladders: dict[Plan, list[Candidate]] = {}
    for stack in stacks:
        rungs: list[Candidate] = []
        for plan in ladder(stack, topo, pins):
            if refusals(plan, spec.model_type):  # a strategy rung the stack's trainer cannot run (TRL has no HSDP...)
                continue
            c = price(spec, plan, budget, global_batch=global_batch, estimator=estimator, profile=profile,
                      micro_limit=micro_limit, host_ram=host_ram, gpus_per_node=topo.gpus_per_node, trace=trace)
            rungs.append(c)
            if c.fits:
                break
        if rungs:
            ladders[stack] = rungs
            cands.append(rungs[-1] if rungs[-1].fits else min(rungs, key=lambda c: budget.needed(c.memory)))
    if not cands:
        raise BadInput(f"no plan can run with these topology flags on {topo.world_size} GPU(s): "
                       + ", ".join(f"{k}={v}" for k, v in pins.items()),
                       "see `oomdoctor diagnose MODEL --gpus N --strategy ...` for what each strategy accepts")
    return rank(cands, budget, prefer, len(trace.evaluations)), ladders  # type: ignore[arg-type]


def _strategy_table(chosen: Candidate, ladders: dict[Plan, list[Candidate]], budget: Budget,
                    topo: Topology) -> list[StrategyTrial]:
    """The rungs of the chosen plan's stack (after those of its on-device twin when the chosen plan offloads)."""
    mine = next((s for s, rungs in ladders.items() if chosen in rungs), None)
    if mine is None:
        return []
    stacks = [mine]
    if mine.offload_optimizer or mine.offload_params:
        twin = mine.with_(offload_optimizer=False, offload_params=False)
        if twin in ladders:
            stacks.insert(0, twin)
    rungs = [c for s in stacks for c in ladders[s]]
    return trials(rungs, budget, chosen, lambda c: node_host_bytes(c.memory.host_per_node, c.plan, topo.gpus_per_node))


# ---------------------------------------------------------------------------------------------- emitting


def default_output_path(directory: str | os.PathLike = ".") -> Path:
    """``./oomdoctor-plan.yaml``, or the first free ``oomdoctor-plan-N.yaml`` when it exists (never overwrite)."""
    return free_path(Path(directory) / DEFAULT_OUTPUT)


def holds_weights(ref: str | os.PathLike) -> bool:
    """Whether ``ref`` is a directory with weights (``*.safetensors`` / ``*.bin``) a trainer can load, as opposed
    to a config alone."""
    p = Path(ref).expanduser()
    return p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


def render_config(result: TuneResult, model_ref: str, *, dataset: str | None = None,
                  tokenizer: str | None = None, **extra: Any) -> str:
    """The ``oomdoctor train`` YAML for the tuned plan, through the train renderer (every key commented).

    A hub id or a weights directory becomes ``model.path`` (pretrained); a bare config (``config.json`` or a
    directory without weights; ``bundled:tiny/model/config.json`` stays a ``bundled:`` name) becomes ``init: random``
    with a tokenizer. ``gpu_mem`` is the tuned capacity so that ``oomdoctor train --dry-run`` checks the same
    budget."""
    from oomdoctor.train.config import config_from_plan, render_yaml

    bundled = is_bundled(model_ref)
    p = bundled_path(model_ref) if bundled else Path(model_ref).expanduser()
    local = p.exists()
    config_only = local and not holds_weights(p)
    # a bundled name stays as written (it resolves wherever the package is installed); local paths become absolute
    ref = model_ref if bundled or not local else str(p.resolve())
    kwargs: dict[str, Any] = dict(extra)
    if config_only:
        kwargs.update(init="random", tokenizer=tokenizer or SAMPLE_TOKENIZER)
    else:
        if tokenizer:
            kwargs["tokenizer"] = tokenizer
    kwargs.setdefault("dataset", dataset or SAMPLE_DATASET)
    kwargs.setdefault("gpu_mem", result.capacity_bytes)
    if result.device == "cpu":  # priced for the CPU: the run goes there, gpu_mem caps its live tensor bytes
        kwargs.setdefault("device", "cpu")
    cfg = config_from_plan(ref, result.plan, **kwargs)
    lines = ["Written by `oomdoctor tune`."] + list(result.summary_lines()) + [
        "Run: " + result.command.replace(shlex.quote(result.config_path or DEFAULT_OUTPUT), "THIS.yaml")]
    if not dataset and "dataset" not in extra:
        lines.append(f"dataset.path is the bundled sample ({SAMPLE_DATASET}): point it at your data.")
    if config_only and not tokenizer:
        lines.append(f"model: built from the config with random weights and the bundled sample tokenizer "
                     f"({SAMPLE_TOKENIZER}) - a smoke run; point model.path at real weights to fine-tune.")
    return render_yaml(cfg, header="\n".join(lines))


def write_config(result: TuneResult, model_ref: str, path: str | os.PathLike | None = None, *,
                 overwrite: bool = False, **render_kw: Any) -> Path:
    """Write the YAML atomically (temp file + rename in the same directory) and set ``result.config_path``.

    ``path=None``: :func:`default_output_path` (a fresh name, never overwriting). An explicit path that exists is
    refused (BadInput) unless ``overwrite``."""
    out = write_text_atomic(path if path is not None else default_output_path(),
                            render_config(result, model_ref, **render_kw), overwrite=overwrite)
    result.config_path = str(out)
    return out


__all__ = ["tune", "TuneResult", "Trial", "write_config", "render_config", "default_output_path", "verify",
           "ALLOC_CONF", "DEFAULT_OUTPUT", "VERIFY_MODES"]
