"""Plan search: enumerate plans, keep those that fit a memory budget, rank them, and size the micro-batch.

Pure library (no torch import): every memory number comes from an *estimator* ``(spec, plan) -> MemoryBreakdown``
(by default ``oomdoctor.memory.estimate(spec, plan, "analytic")``), so the same search runs on the analytic model,
the simulator, or a fake in a unit test.

Pieces, each usable alone:

* :func:`max_fitting` — the largest integer ``b`` in ``[1, limit]`` with ``fits(b)`` for a monotone predicate
  (doubling, then bisection: ``2*ceil(log2(b))`` evaluations at most).
* :func:`choose_micro_batch` — given that maximum and the global batch, the micro-batch that divides the global
  batch exactly (largest divisor <= max) and the gradient accumulation that keeps ``micro * accum == global``.
* :func:`estimate_throughput` — a roofline-style tokens/s estimate used to rank plans (see ``docs/tune.md``).
* :func:`search` — the whole thing: enumerate (``oomdoctor.diagnose.matrix``), price, drop what does not fit the budget,
  size the micro-batch of every survivor, rank by fidelity then throughput (or throughput first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from oomdoctor.errors import BadInput
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.plan import Plan
from oomdoctor.model.spec import ModelSpec

Estimator = Callable[[ModelSpec, Plan], MemoryBreakdown]
Prefer = Literal["quality", "speed"]
PREFERS: tuple[str, ...] = ("quality", "speed")

#: Optimizers that keep AdamW's algorithm (what tune may choose on its own). Adafactor, Lion and SGD are different
#: optimizers (another training recipe, other hyper-parameters): tune only uses them when the user pins one.
ADAMW_FAMILY: tuple[str, ...] = ("adamw", "paged-adamw", "adamw-8bit", "paged-adamw-8bit")

#: Upper end of the micro-batch search when no global batch bounds it.
DEFAULT_MICRO_LIMIT = 1024


def analytic_estimator(spec: ModelSpec, plan: Plan) -> MemoryBreakdown:
    """The default estimator: the analytic memory model (instant, no torch)."""
    from oomdoctor.engines import estimate

    return estimate(spec, plan, "analytic")


# ---------------------------------------------------------------------------------------------- margin / budget


def parse_margin(text: str | float | int, capacity: int | None = None) -> float:
    """Safety margin as a fraction of the capacity: ``0.1``, ``10%`` or an absolute size (``2GB``, needs capacity).

    Raises BadInput for anything outside [0, 0.9] or unreadable.
    """
    from oomdoctor.units import parse_size

    if isinstance(text, bool):
        raise BadInput(f"--margin: expected a fraction like 0.1, a percentage like 10% or a size like 2GB, got {text!r}")
    frac: float
    if isinstance(text, (int, float)):
        frac = float(text)
    else:
        s = str(text).strip()
        try:
            frac = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
        except ValueError:
            if capacity is None:
                raise BadInput(
                    f"--margin {s}: an absolute margin needs a capacity (--gpu-mem or a GPU)",
                    "use a fraction instead, e.g. --margin 0.1 (10%)",
                ) from None
            frac = parse_size(s, what="--margin") / capacity
    if not math.isfinite(frac) or frac < 0 or frac > 0.9:
        raise BadInput(f"--margin {text}: must be between 0 and 0.9 of the memory (e.g. 0.1 or 10%)")
    return frac


def budget_bytes(capacity: int, margin: float) -> int:
    """Bytes a plan's ``peak_device`` may use: the capacity minus the safety margin (a fraction of it)."""
    return int(capacity * (1.0 - margin))


# ---------------------------------------------------------------------------------------------- micro-batch


@dataclass
class SearchTrace:
    """Evaluations of the memory predicate made while searching (for tests and the benchmark's counts)."""

    evaluations: list[tuple[int, bool]] = field(default_factory=list)
    """(micro-batch, fits) in the order evaluated."""


def max_fitting(fits: Callable[[int], bool], limit: int, trace: SearchTrace | None = None) -> int:
    """Largest ``b`` in ``[1, limit]`` with ``fits(b)``, for a monotone predicate (fits(b) implies fits(b-1)).

    Doubling from 1 until the first failure (or ``limit``), then bisection between the last success and the
    first failure. Returns 0 when even ``fits(1)`` is false. Each ``b`` is evaluated at most once.
    """
    if limit < 1:
        raise BadInput(f"micro-batch search limit must be >= 1, got {limit}")
    cache: dict[int, bool] = {}

    def ok(b: int) -> bool:
        if b not in cache:
            cache[b] = bool(fits(b))
            if trace is not None:
                trace.evaluations.append((b, cache[b]))
        return cache[b]

    if not ok(1):
        return 0
    lo, hi = 1, None  # lo fits; hi (if set) does not
    b = 1
    while hi is None:
        if b >= limit:
            return limit
        nb = min(b * 2, limit)
        if ok(nb):
            lo = b = nb
        else:
            hi = nb
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    if n < 1:
        raise BadInput(f"expected a positive integer, got {n}")
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


@dataclass(frozen=True)
class BatchChoice:
    """Micro-batch and gradient accumulation for one plan."""

    max_micro_batch: int
    """Largest micro-batch that fits the budget (capped at the global batch when one is given)."""
    micro_batch: int
    """Chosen micro-batch (``per_device_train_batch_size``): divides the global batch exactly."""
    grad_accum: int
    """``gradient_accumulation_steps``: ``micro_batch * grad_accum == global_batch``."""
    global_batch: int | None
    """The requested effective batch (None: not given, the effective batch is the micro-batch)."""
    note: str | None = None
    """Set when exactness cost micro-batch size, with the nearest global batches that would not."""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum

    @property
    def exact(self) -> bool:
        return self.global_batch is None or self.effective_batch == self.global_batch

    def to_dict(self) -> dict:
        return {
            "max_micro_batch": self.max_micro_batch,
            "micro_batch_size": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "global_batch": self.global_batch,
            "effective_batch_size": self.effective_batch,
            "note": self.note,
        }


def choose_micro_batch(max_micro: int, global_batch: int | None) -> BatchChoice:
    """Pick the micro-batch (largest divisor of ``global_batch`` <= ``max_micro``) and the accumulation steps.

    Without a global batch the micro-batch is ``max_micro`` and accumulation 1. When the largest divisor is below
    ``max_micro`` the choice says so and names the nearest global batches that the full ``max_micro`` divides.
    """
    if max_micro < 1:
        raise BadInput("no micro-batch fits (not even 1)")
    if global_batch is None:
        return BatchChoice(max_micro, max_micro, 1, None)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise BadInput(f"--global-batch must be a positive integer, got {global_batch!r}")
    cap = min(max_micro, global_batch)
    micro = max(d for d in divisors(global_batch) if d <= cap)
    accum = global_batch // micro
    note = None
    if micro < cap:
        lower = (global_batch // cap) * cap
        upper = lower + cap
        alts = [g for g in (lower, upper) if g >= cap]
        alt_txt = " or ".join(f"--global-batch {g} ({cap} x {g // cap})" for g in alts)
        note = (
            f"the largest micro-batch that fits is {cap}, but {global_batch} is not a multiple of it: using the "
            f"largest divisor, {micro} x {accum} accumulation steps ({100 * (1 - micro / cap):.0f}% smaller "
            f"micro-batch, same effective batch); {alt_txt} would use all {cap}"
        )
    return BatchChoice(max_micro, micro, accum, global_batch, note)


def accum_for(micro: int, global_batch: int | None) -> int:
    """Gradient accumulation to price a micro-batch with: ``global // micro`` (1 without a global batch or when the
    micro-batch covers it). Memory depends only on whether it is 1 or more."""
    if not global_batch or micro >= global_batch:
        return 1
    return max(global_batch // micro, 2)


def micro_batch_search(
    spec: ModelSpec,
    plan: Plan,
    budget: int,
    estimator: Estimator,
    *,
    global_batch: int | None = None,
    limit: int = DEFAULT_MICRO_LIMIT,
    trace: SearchTrace | None = None,
) -> tuple[BatchChoice | None, MemoryBreakdown]:
    """Largest micro-batch of ``plan`` whose ``peak_device`` fits ``budget``, then the divisor choice.

    Returns (None, breakdown at micro-batch 1) when micro-batch 1 does not fit; else (choice, breakdown at the
    chosen micro-batch).
    """
    cache: dict[int, MemoryBreakdown] = {}

    def mem(b: int) -> MemoryBreakdown:
        # accumulation matters for memory only as "1" vs ">= 2" (from the second micro-batch on, the backward runs
        # with every gradient already allocated): price the accumulation the global batch implies at this size
        if b not in cache:
            cache[b] = estimator(spec, plan.with_(micro_batch=b, grad_accum=accum_for(b, global_batch)))
        return cache[b]

    upper = min(limit, global_batch) if global_batch else limit
    best = max_fitting(lambda b: mem(b).peak_device <= budget, upper, trace)
    if best == 0:
        return None, mem(1)
    choice = choose_micro_batch(best, global_batch)
    final = mem(choice.micro_batch)
    if choice.grad_accum != accum_for(choice.micro_batch, global_batch):  # pragma: no cover - same rule both ways
        final = estimator(spec, plan.with_(micro_batch=choice.micro_batch, grad_accum=choice.grad_accum))
    return choice, final


@dataclass
class VerifyStep:
    """One device trial made by :func:`verify_and_refine`."""

    micro_batch: int
    fits: bool
    predicted: int
    """Memory-model prediction for this micro-batch (same quantity as ``measured``)."""
    measured: int | None
    """Measured peak when the trial reports one (None after an OOM on a real GPU)."""


def verify_and_refine(
    start: int,
    allowed: Iterable[int],
    predicted: Callable[[int], int],
    trial: Callable[[int], tuple[bool, int | None]],
    budget: int,
    capacity: int,
    *,
    max_trials: int = 4,
    refine: bool = True,
) -> tuple[int, list[VerifyStep]]:
    """Predict, verify once, refine once: the device-trial part of the batch finder.

    ``start`` is the memory model's answer; ``trial(b) -> (fits, measured peak or None)`` runs it for real.

    * fits: with a measured peak, the prediction is calibrated by ``k = measured / predicted`` and the largest
      ``allowed`` size above ``start`` with ``predicted * k <= budget`` is tried once (``refine``); if that one
      fails, the verified ``start`` stays the answer. Without a measurement the verified size is returned.
    * fails: the overshoot is at least ``capacity / predicted`` (the trial needed more than the capacity), times
      1.05, 1.10, 1.20... for the 1st, 2nd, 3rd failure; the next size is the largest allowed one below whose
      prediction times the overshoot fits the budget — at least one step down — until one fits (then refine once
      below the smallest failing size) or ``max_trials`` is spent.

    Returns (verified size or 0, trials). ``allowed`` are the admissible sizes (divisors of the global batch, or
    1..limit); memory must be monotone in the size.
    """
    sizes = sorted(set(int(a) for a in allowed if a >= 1))
    steps: list[VerifyStep] = []
    b = start
    best = 0
    failed = 1 << 62  # smallest size seen failing
    refined = False
    while b >= 1 and len(steps) < max_trials:
        pred = max(int(predicted(b)), 1)
        ok, measured = trial(b)
        steps.append(VerifyStep(b, ok, pred, measured))
        if ok:
            best = max(best, b)
            if refined or not refine or not measured:
                break
            k = measured / pred
            up = [d for d in sizes if b < d < failed and predicted(d) * k <= budget]
            if not up:
                break
            b, refined = max(up), True
            continue
        failed = min(failed, b)
        if best:  # the refinement step failed: keep the verified size
            break
        fails = sum(1 for s in steps if not s.fits)
        # the trial needed more than the capacity: assume the model is off by at least that, plus 5%, 10%, 20%...
        # for successive failures (a geometric step-down instead of one size at a time)
        over = max(capacity / pred, (measured or 0) / pred, 1.0) * (1.0 + 0.05 * 2 ** (fails - 1))
        down = [d for d in sizes if d < b]
        fit_down = [d for d in down if predicted(d) * over <= budget]
        b = max(fit_down) if fit_down else (max(down) if down else 0)
    return best, steps


# ---------------------------------------------------------------------------------------------- throughput


@dataclass(frozen=True)
class HardwareProfile:
    """Rough speeds of one GPU model, for ranking plans by estimated throughput (vendor datasheet peaks)."""

    name: str
    bf16_flops: float
    """Dense bf16/fp16 tensor-core FLOP/s (no sparsity)."""
    fp32_flops: float
    """Dense fp32 FLOP/s without TF32 (torch's default matmul precision is ``highest``)."""
    hbm_bytes_per_s: float
    """Device memory bandwidth."""
    pcie_bytes_per_s: float
    """Effective host<->device copy bandwidth (about 80% of the link's peak)."""
    bf16: bool = True
    """Has bf16 tensor cores (compute capability >= 8.0). Without them bf16 plans become fp16-mixed."""
    cpu_bytes_per_s: float = 20e9
    """Host memory bandwidth available to a CPU optimizer step (offloaded AdamW is memory-bound)."""
    mfu: float = 0.4
    """Fraction of peak FLOP/s a training step reaches (model FLOPs utilization; 0.3-0.5 is typical)."""


#: Reference profile when the GPU is unknown (``--gpu-mem`` without a GPU): an A10/L4-class 24 GB card on PCIe 4.0.
REFERENCE_PROFILE = HardwareProfile("reference (A10-class, PCIe 4.0)", 125e12, 31e12, 600e9, 25e9)

#: (substring of the NVML name, profile); first match wins. Datasheet numbers, dense.
GPU_PROFILES: tuple[tuple[str, HardwareProfile], ...] = (
    ("H200", HardwareProfile("H200", 989e12, 67e12, 4.8e12, 50e9)),
    ("H100 PCIe", HardwareProfile("H100 PCIe", 756e12, 51e12, 2.0e12, 50e9)),
    ("H100", HardwareProfile("H100 SXM", 989e12, 67e12, 3.35e12, 50e9)),
    ("A100", HardwareProfile("A100", 312e12, 19.5e12, 1.6e12, 25e9)),
    ("L40S", HardwareProfile("L40S", 362e12, 91.6e12, 864e9, 25e9)),
    ("L40", HardwareProfile("L40", 181e12, 90.5e12, 864e9, 25e9)),
    ("L4", HardwareProfile("L4", 121e12, 30e12, 300e9, 25e9)),
    ("A10", HardwareProfile("A10", 125e12, 31e12, 600e9, 25e9)),
    ("4090", HardwareProfile("RTX 4090", 165e12, 82.6e12, 1.0e12, 25e9)),
    ("3090", HardwareProfile("RTX 3090", 71e12, 35.6e12, 936e9, 25e9)),
    ("A6000", HardwareProfile("RTX A6000", 155e12, 38.7e12, 768e9, 25e9)),
    ("V100", HardwareProfile("V100", 125e12, 15.7e12, 900e9, 12e9, bf16=False)),
    ("T4", HardwareProfile("T4", 65e12, 8.1e12, 320e9, 12e9, bf16=False)),
)


def profile_for(gpu_name: str | None) -> HardwareProfile:
    """The profile whose key appears in ``gpu_name`` (case-insensitive), else :data:`REFERENCE_PROFILE`."""
    if gpu_name:
        low = gpu_name.lower()
        for key, prof in GPU_PROFILES:
            if key.lower() in low:
                return prof
    return REFERENCE_PROFILE


def _linear_numel(spec: ModelSpec) -> int:
    return sum(g.total_numel for g in spec.groups if g.kind == "linear")


def _embedding_numel(spec: ModelSpec) -> int:
    return sum(g.total_numel for g in spec.groups if g.kind == "embedding")


def trainable_params(spec: ModelSpec, plan: Plan) -> int:
    """Trainable parameters: all for full fine-tuning; for LoRA ``r * (in + out)`` per adapted linear.

    ``all-linear`` adapts every linear but the output head (peft's rule); named targets match module names.
    """
    if plan.method == "full":
        return spec.num_params
    head = spec.head_name
    n = 0
    for g in spec.groups:
        if g.kind != "linear":
            continue
        if g.name == head:
            hit = plan.lora_on_head
        else:
            hit = "all-linear" in plan.lora_targets or g.name in plan.lora_targets
        if hit:
            n += plan.lora_r * (g.in_features + g.out_features) * g.count
    return n


@dataclass(frozen=True)
class Throughput:
    """Estimated time of one optimizer step (``grad_accum`` micro-batches + the step) and tokens/s."""

    tokens_per_s: float
    step_s: float
    compute_s: float
    """Matmul time of all micro-batches (FLOPs / (peak * MFU))."""
    memory_s: float
    """Memory-bound extras on the GPU: QLoRA dequantization, the optimizer step."""
    transfer_s: float
    """Host<->device copies (offload) and the CPU optimizer step, assumed not overlapped with compute."""
    profile: str

    def to_dict(self) -> dict:
        return {
            "tokens_per_s": round(self.tokens_per_s, 1),
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "transfer_s": self.transfer_s,
            "profile": self.profile,
        }


def estimate_throughput(spec: ModelSpec, plan: Plan, profile: HardwareProfile,
                        memory: MemoryBreakdown | None = None) -> Throughput:
    """Roofline-style estimate of training tokens/s for ``plan`` (micro-batch and accumulation included).

    Compute (Kaplan et al. 2020, "Scaling Laws", sec. 2.1; Chinchilla appendix F): a forward pass costs
    ``F = 2 * N_matmul + 4 * L * s * d_attn`` FLOPs per token (weights that multiply, plus QK^T and AV);
    full fine-tuning's backward costs ``2F`` (activation and weight gradients), LoRA's about ``F`` (no weight
    gradients for the frozen base; adapters are negligible); gradient checkpointing adds one more forward ``F``
    (so +1/3 for full fine-tuning). Time = FLOPs / (peak * MFU); fp32 plans use the fp32 peak.
    QLoRA dequantizes every quantized weight in each forward/backward (read 0.5 or 1 byte, write and re-read
    2 bytes per weight) at HBM bandwidth. The optimizer step reads/writes weights, gradients and states once.
    Offload (no overlap with compute assumed: an upper bound of its cost): optimizer offload copies gradients
    to the host and weights back each step and runs AdamW on the CPU at host bandwidth; activation offload copies
    the saved activations out and back each micro-batch; parameter offload streams the weights in for every
    forward and backward. Known limits: kernel efficiency at small micro-batches, attention kernels, overlap of
    copies and the paged optimizer's eviction traffic are not modelled — the number ranks plans, it is not a
    promise of speed.
    """
    N = spec.num_params
    n_lin = _linear_numel(spec)
    d_attn = spec.num_heads * spec.head_dim
    s = plan.seq_len
    fwd = 2 * n_lin + 4 * spec.num_layers * s * d_attn  # FLOPs per token, forward
    if plan.method == "full":
        per_token = 3 * fwd
    else:
        per_token = 2 * fwd
    passes = 2  # weight reads per micro-batch: forward + backward
    if plan.gradient_checkpointing:
        per_token += fwd
        passes += 1
    peak = profile.fp32_flops if plan.precision == "fp32" else profile.bf16_flops
    tokens_micro = plan.micro_batch * s
    compute_micro = tokens_micro * per_token / (peak * profile.mfu)

    mem_micro = 0.0
    if plan.quant is not None:
        qbytes = 1.0 if plan.quant == "int8" else 0.5
        mem_micro += passes * n_lin * (qbytes + 4.0) / profile.hbm_bytes_per_s

    trainable = trainable_params(spec, plan)
    wbytes = plan.weight_dtype_bytes
    state_bytes = {"adamw": 2 * wbytes, "paged-adamw": 8, "adamw-8bit": 2, "paged-adamw-8bit": 2,
                   "adafactor": 1, "lion": wbytes, "sgd": wbytes if plan.sgd_momentum else 0}.get(plan.optimizer, 8)
    opt_bytes = trainable * (2 * wbytes + wbytes + 2 * state_bytes)
    memory_step = 0.0 if plan.offload_optimizer else opt_bytes / profile.hbm_bytes_per_s

    transfer_micro = 0.0
    transfer_step = 0.0
    if plan.offload_optimizer:
        transfer_step += trainable * 2 * wbytes / profile.pcie_bytes_per_s  # grads down, weights up
        transfer_step += opt_bytes / profile.cpu_bytes_per_s
    if plan.offload_activations:
        act = memory.cpu_offloaded if (memory is not None and memory.cpu_offloaded) else (
            memory.activations if memory is not None else 0)
        transfer_micro += 2 * act / profile.pcie_bytes_per_s
    if plan.offload_params:
        pbytes = N * (1 if plan.quant == "int8" else 0.5 if plan.quant else wbytes)
        transfer_micro += passes * pbytes / profile.pcie_bytes_per_s

    ga = plan.grad_accum
    compute_s = ga * compute_micro
    memory_s = ga * mem_micro + memory_step
    transfer_s = ga * transfer_micro + transfer_step
    step = compute_s + memory_s + transfer_s
    tokens = ga * tokens_micro
    return Throughput(tokens / step if step > 0 else 0.0, step, compute_s, memory_s, transfer_s, profile.name)


# ---------------------------------------------------------------------------------------------- ranking

METHOD_RANK = {"full": 0, "lora": 1, "qlora": 2}
QUANT_RANK = {None: 0, "int8": 1, "nf4": 2, "fp4": 3}
#: fp32 weights with bf16 autocast keep fp32 master weights: same fidelity tier as fp32.
PRECISION_RANK = {"fp32": 0, "bf16-mixed": 0, "fp16-mixed": 1, "bf16": 2}
OPTIMIZER_RANK = {"adamw": 0, "paged-adamw": 0, "adamw-8bit": 1, "paged-adamw-8bit": 1, "adafactor": 2, "lion": 3,
                  "sgd": 4}


def fidelity_key(plan: Plan) -> tuple[int, ...]:
    """Lower is more faithful: method (full > LoRA > QLoRA), quantization bits, weight precision (fp32 master
    weights > pure bf16), optimizer state precision (32-bit/bf16 > 8-bit > other optimizers), then plain > a
    compute-for-memory trade (gradient checkpointing or offload). GC and offload change no numbers, so they come
    last, as one criterion: between the two, the estimated throughput decides."""
    trade = plan.gradient_checkpointing or plan.offload_optimizer or plan.offload_activations or plan.offload_params
    return (
        METHOD_RANK[plan.method],
        QUANT_RANK.get(plan.quant, 9),
        PRECISION_RANK.get(plan.precision, 9),
        OPTIMIZER_RANK.get(plan.optimizer, 9),
        int(trade),
    )


@dataclass
class Candidate:
    """One enumerated plan, priced."""

    plan: Plan
    """The plan; when it fits, with the chosen micro-batch and gradient accumulation."""
    memory: MemoryBreakdown
    """Breakdown at the chosen micro-batch (at micro-batch 1 when nothing fits)."""
    batch: BatchChoice | None
    """Micro-batch choice; None when micro-batch 1 does not fit."""
    throughput: Throughput | None = None
    rank: int | None = None
    """1 = chosen; None for plans that do not fit."""

    @property
    def fits(self) -> bool:
        return self.batch is not None

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "label": self.plan.label(),
            "fits": self.fits,
            "peak_device_bytes": self.memory.peak_device,
            "batch": self.batch.to_dict() if self.batch else None,
            "throughput": self.throughput.to_dict() if self.throughput else None,
        }


def rank_key(c: Candidate, prefer: Prefer = "quality") -> tuple:
    """Sort key (ascending = better). ``quality``: fidelity, then throughput. ``speed``: throughput, then
    fidelity. Throughput is compared at 3 significant digits so estimation noise does not beat fidelity."""
    tps = c.throughput.tokens_per_s if c.throughput else 0.0
    tps_r = float(f"{tps:.3g}") if tps > 0 else 0.0
    if prefer == "speed":
        return (-tps_r, fidelity_key(c.plan))
    return (fidelity_key(c.plan), -tps_r)


@dataclass
class SearchResult:
    """Every candidate, ranked (fitting ones first, best first), and the budget used."""

    candidates: list[Candidate]
    budget: int
    prefer: str
    evaluations: int = 0
    """Estimator calls made (memory-model evaluations, not device trials)."""

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    @property
    def best(self) -> Candidate | None:
        f = self.fitting
        return f[0] if f else None

    @property
    def smallest(self) -> Candidate:
        """The candidate with the lowest peak (for "does not fit" messages)."""
        return min(self.candidates, key=lambda c: c.memory.peak_device)


def enumerate_candidates(pins: dict[str, Any] | None, base: Plan, *, bf16_supported: bool = True) -> list[Plan]:
    """Plans tune considers: the technique matrix (``oomdoctor.diagnose.matrix``) for the pins, minus optimizer swaps
    (Adafactor/Lion/SGD) unless the optimizer is pinned; on GPUs without bf16 the bf16 plans become fp16-mixed."""
    from oomdoctor.diagnose.matrix import enumerate_plans

    pins = dict(pins or {})
    plans = enumerate_plans(pins, base)
    if "optimizer" not in pins:
        plans = [p for p in plans if p.optimizer in ADAMW_FAMILY]
    if not bf16_supported and "precision" not in pins:
        out: list[Plan] = []
        for p in plans:
            if p.precision == "bf16":
                continue  # pure bf16 needs bf16 hardware; fp16 pure training is unstable
            if p.precision == "bf16-mixed":
                p = p.with_(precision="fp16-mixed")
            if p not in out:
                out.append(p)
        plans = out
    return plans


def search(
    spec: ModelSpec,
    plans: Iterable[Plan],
    budget: int,
    *,
    global_batch: int | None = None,
    estimator: Estimator = analytic_estimator,
    prefer: Prefer = "quality",
    profile: HardwareProfile = REFERENCE_PROFILE,
    micro_limit: int = DEFAULT_MICRO_LIMIT,
) -> SearchResult:
    """Price every plan at micro-batch 1, size the micro-batch of those that fit ``budget`` and rank them."""
    if prefer not in PREFERS:
        raise BadInput(f"--prefer {prefer!r}: use quality or speed")
    if budget <= 0:
        raise BadInput("the memory budget is not positive (capacity minus margin); check --gpu-mem and --margin")
    cands: list[Candidate] = []
    evaluations = 0
    for plan in plans:
        trace = SearchTrace()
        choice, mem = micro_batch_search(spec, plan, budget, estimator, global_batch=global_batch,
                                         limit=micro_limit, trace=trace)
        evaluations += len(trace.evaluations)
        if choice is None:
            cands.append(Candidate(plan.with_(micro_batch=1, grad_accum=1), mem, None))
            continue
        sized = plan.with_(micro_batch=choice.micro_batch, grad_accum=choice.grad_accum)
        cands.append(Candidate(sized, mem, choice, estimate_throughput(spec, sized, profile, mem)))
    fitting = sorted((c for c in cands if c.fits), key=lambda c: rank_key(c, prefer))
    rest = sorted((c for c in cands if not c.fits), key=lambda c: c.memory.peak_device)
    for i, c in enumerate(fitting, 1):
        c.rank = i
    return SearchResult(fitting + rest, budget, prefer, evaluations)


__all__ = [
    "Estimator", "analytic_estimator", "parse_margin", "budget_bytes", "max_fitting", "divisors", "BatchChoice",
    "choose_micro_batch", "micro_batch_search", "accum_for", "HardwareProfile", "REFERENCE_PROFILE", "profile_for",
    "trainable_params", "Throughput", "estimate_throughput", "fidelity_key", "Candidate", "rank_key",
    "SearchResult", "enumerate_candidates", "search", "SearchTrace", "ADAMW_FAMILY", "verify_and_refine",
    "VerifyStep",
]
