"""Plan search: enumerate the candidate plans, keep those that fit a :class:`Budget`, size each one's micro-batch
(``oomdoctor.tune.batch_search``), estimate its throughput (``oomdoctor.tune.throughput``) and rank them
(``oomdoctor.tune.ranking``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.memory.sharding import node_host_bytes
from oomdoctor.model.execution import upcast_changes_bytes
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import DEFAULT_MICRO_LIMIT, BatchChoice, SearchTrace
from oomdoctor.plan.budget import Budget
from oomdoctor.plan.targets import runnable
from oomdoctor.plan.techniques import DEFAULTS
from oomdoctor.tune.batch_search import Estimator, analytic_estimator, micro_batch_search
from oomdoctor.tune.ranking import PREFERS, Candidate, Prefer, fidelity_key, rank_key
from oomdoctor.tune.throughput import REFERENCE_PROFILE, HardwareProfile, estimate_throughput
from oomdoctor.units import format_bytes

#: Optimizers that keep AdamW's algorithm (what tune may choose on its own). Adafactor, Lion and SGD are different
#: optimizers (another training recipe, other hyper-parameters): tune only uses them when the user pins one.
ADAMW_FAMILY: tuple[str, ...] = ("adamw", "paged-adamw", "adamw-8bit", "paged-adamw-8bit")


@dataclass
class SearchResult:
    """Every candidate, ranked (fitting ones first, best first), and the budget used."""

    candidates: list[Candidate]
    budget: Budget
    """The budget every candidate was sized against."""
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
        """The candidate that needs the least of the budget (for "does not fit" messages)."""
        return min(self.candidates, key=lambda c: self.budget.needed(c.memory))


def enumerate_candidates(
    pins: dict[str, Any] | None,
    base: Plan,
    *,
    bf16_supported: bool = True,
    chunked_loss: bool = True,
    tiled_mlp: bool = False,
    model_type: str | None = None,
) -> list[Plan]:
    """Plans tune considers: the technique matrix (``oomdoctor.diagnose.matrix``) for the pins, minus optimizer swaps
    (Adafactor/Lion/SGD) unless the optimizer is pinned; on GPUs without bf16 the bf16 plans become fp16-mixed;
    then, unless pinned, every AdamW plan with each AdamW of bitsandbytes too (8-bit states, paged states in CUDA
    unified memory: evictable, what the card cannot hold lives in host RAM), every quantized base loaded in bf16 without peft's k-bit upcast too
    (``kbit_upcast: false``, TRL's and axolotl's QLoRA: the unquantized weights and the residual stream stay bf16;
    ranked after the upcast plans of its tier), every plan with the optimizer in backward (torchtune's low-memory
    recipe: no gradient kept, a LoRA's adapters' included; not with a pinned tiled MLP, which it cannot run with),
    with its activations offloaded too (checkpointed: unsloth's offloaded gradient checkpointing; not: every saved
    tensor to the host, ``save_on_cpu``; ranked after every on-device plan of its tier, and only within the host RAM:
    ``price``), with the chunked loss (``chunked_loss``: the model is a decoder), and with ``tiled_mlp``
    (``model.execution.tiling_applies``) with its MLPs tiled (each such plan's blocks are measured by a replay: seconds
    per distinct plan, cached). Every variant a single pin can select is in the unpinned list, so no pin finds a
    plan the search did not consider (tests/test_search_pins.py); diagnose's matrix leaves these variants out to
    stay readable. A pinned ``trainer`` other than oomdoctor keeps the plans it can run on ``model_type``, as it runs
    them (``oomdoctor.plan.targets.runnable``: BadInput naming a pinned knob it cannot run)."""
    from oomdoctor.diagnose.matrix import enumerate_plans

    pins = dict(pins or {})
    plans = enumerate_plans(pins, base)
    if "optimizer" not in pins:
        plans = [p for p in plans if p.optimizer in ADAMW_FAMILY]
        plans += [p.with_(optimizer=o) for p in plans if p.optimizer == "adamw" for o in ADAMW_FAMILY[1:]]
    if not bf16_supported and "precision" not in pins:
        out: list[Plan] = []
        for p in plans:
            if p.precision == "bf16":
                continue  # pure bf16 needs bf16 hardware; fp16 pure training is unstable
            if p.precision == "bf16-mixed":
                if p.adapter_dtype == "bf16":
                    continue  # fp16 autocast would cast bf16 adapters in every matmul (validate refuses it)
                p = p.with_(precision="fp16-mixed")
            if p not in out:
                out.append(p)
        plans = out
    if "kbit_upcast" not in pins:
        plans += [p.with_(kbit_upcast=False) for p in plans if upcast_changes_bytes(p) and p.kbit_upcast]
    if "optimizer_in_backward" not in pins:  # gradients freed as they are used (LoRA's adapters' too)
        plans += [
            p.with_(optimizer_in_backward=True)
            for p in plans
            if not p.offload_optimizer
            and p.precision != "fp16-mixed"
            and not p.optimizer_in_backward
            and not p.tiled_mlp
        ]
    if not any(k in pins for k in ("offload_activations", "offload_optimizer", "offload_params")):
        plans += [p.with_(offload_activations=True) for p in plans if not p.offload_activations]
    if "loss" not in pins and chunked_loss:  # changes no numbers: searched next to every plan
        plans += [p.with_(loss="chunked") for p in plans if p.loss != "chunked"]
    if "tiled_mlp" not in pins and tiled_mlp:
        plans += [p.with_(tiled_mlp=True) for p in plans if not p.tiled_mlp and not p.optimizer_in_backward]
    plans = list(dict.fromkeys(plans))
    trainer = pins.get("trainer", DEFAULTS["trainer"])
    if trainer != DEFAULTS["trainer"]:  # as that trainer runs them, only those it can run
        plans = runnable(plans, trainer, pins, model_type)
    return plans


def price(
    spec: ModelSpec,
    plan: Plan,
    budget: Budget,
    *,
    global_batch: int | None = None,
    estimator: Estimator = analytic_estimator,
    profile: HardwareProfile = REFERENCE_PROFILE,
    micro_limit: int = DEFAULT_MICRO_LIMIT,
    host_ram: int | None = None,
    gpus_per_node: int | None = None,
    trace: SearchTrace | None = None,
) -> Candidate:
    """One plan priced at micro-batch 1 and, when it fits ``budget``, sized (largest micro-batch, exact
    accumulation for the per-rank ``global_batch``). ``host_ram``: bytes of host RAM per node; an offload plan
    whose host share for ``gpus_per_node`` ranks (default: every rank on one node) exceeds it does not fit, paged
    optimizer states the card cannot hold counted (:func:`host_bytes`)."""
    trace = trace if trace is not None else SearchTrace()
    # optimizer in backward cannot accumulate: the micro-batch alone must reach the global batch
    oib = plan.optimizer_in_backward and global_batch is not None
    choice, mem = micro_batch_search(
        spec,
        plan,
        budget,
        estimator,
        global_batch=None if oib else global_batch,
        limit=min(micro_limit, global_batch) if oib else micro_limit,
        trace=trace,
    )
    if choice is None:
        return Candidate(plan.with_(micro_batch=1, grad_accum=1), mem, None)
    if oib and choice.micro_batch < global_batch:
        return Candidate(
            plan.with_(micro_batch=1, grad_accum=1),
            mem,
            None,
            why_not=f"optimizer in backward cannot accumulate gradients: the global batch "
            f"{global_batch} needs micro-batch {global_batch}, at most "
            f"{choice.micro_batch} fits",
        )
    if oib:
        choice = BatchChoice(choice.max_micro_batch, global_batch, 1, global_batch)
    host = host_bytes(mem, budget, plan, gpus_per_node)
    if host_ram is not None and host > host_ram:
        return Candidate(
            plan.with_(micro_batch=1, grad_accum=1),
            mem,
            None,
            why_not=f"needs {format_bytes(host)} of host RAM per node (what it offloads, paged "
            f"optimizer states the card cannot hold), the machine has {format_bytes(host_ram)}",
        )
    sized = plan.with_(micro_batch=choice.micro_batch, grad_accum=choice.grad_accum)
    return Candidate(sized, mem, choice, estimate_throughput(spec, sized, profile, mem))


def host_bytes(mem, budget: Budget, plan: Plan, gpus_per_node: int | None = None) -> int:
    """Host RAM one node needs for ``plan`` (``mem`` its breakdown): what it offloads, plus the bitsandbytes paged
    optimizer states the card cannot hold next to the resident peak (CUDA unified memory pages them out to the
    host), for every rank on the node (``gpus_per_node``; default: every rank on one node)."""
    spill = max(0, mem.paged_optimizer - max(budget.headroom(mem), 0))
    ranks = min(gpus_per_node or plan.world_size, plan.world_size)
    return node_host_bytes(mem.host_per_node, plan, gpus_per_node) + spill * ranks


def rank(cands: list[Candidate], budget: Budget, prefer: Prefer = "quality", evaluations: int = 0) -> SearchResult:
    """Fitting candidates best first (``rank_key``), then the others by what they need."""
    fitting = sorted((c for c in cands if c.fits), key=lambda c: rank_key(c, prefer))
    rest = sorted((c for c in cands if not c.fits), key=lambda c: (c.why_not is not None, budget.needed(c.memory)))
    for i, c in enumerate(fitting, 1):
        c.rank = i
    return SearchResult(fitting + rest, budget, prefer, evaluations)


def search(
    spec: ModelSpec,
    plans: Iterable[Plan],
    budget: Budget,
    *,
    global_batch: int | None = None,
    estimator: Estimator = analytic_estimator,
    prefer: Prefer = "quality",
    profile: HardwareProfile = REFERENCE_PROFILE,
    micro_limit: int = DEFAULT_MICRO_LIMIT,
    host_ram: int | None = None,
    gpus_per_node: int | None = None,
    tiles: bool = False,
) -> SearchResult:
    """Price every plan at micro-batch 1, size the micro-batch of those that fit ``budget`` (:func:`price`) and rank
    them (:func:`rank`). ``tiles`` (one GPU, a model that runs tiled MLPs, the knob not pinned): then also the tiled
    variants that could rank above the best (:func:`tiling_could_help`), priced by a block replay each — below
    ``tiling_applies``'s rule of thumb, where they are not enumerated, a tile can still make a better plan fit."""
    if prefer not in PREFERS:
        raise BadInput(f"--prefer {prefer!r}: use quality or speed")
    trace = SearchTrace()
    plans = list(plans)

    def priced(ps: list[Plan]) -> list[Candidate]:
        return [
            price(
                spec,
                plan,
                budget,
                global_batch=global_batch,
                estimator=estimator,
                profile=profile,
                micro_limit=micro_limit,
                host_ram=host_ram,
                gpus_per_node=gpus_per_node,
                trace=trace,
            )
            for plan in ps
        ]

    result = rank(priced(plans), budget, prefer, len(trace.evaluations))
    if tiles:
        known = set(plans)
        limit = min(micro_limit, global_batch or micro_limit)
        extra = [
            c.plan.with_(tiled_mlp=True, micro_batch=1, grad_accum=1)
            for c in result.candidates
            if tiling_could_help(spec, c, result.best, budget, estimator, prefer, limit)
        ]
        extra = [p for p in dict.fromkeys(extra) if p.with_(micro_batch=1, grad_accum=1) not in known]
        if extra:
            result = rank(result.candidates + priced(extra), budget, prefer, len(trace.evaluations))
    return result


def tiling_could_help(
    spec: ModelSpec,
    c: Candidate,
    best: Candidate | None,
    budget: Budget,
    estimator: Estimator,
    prefer: Prefer,
    micro_limit: int,
) -> bool:
    """Whether ``c``'s plan with tiled MLPs could rank above ``best``: a plan tiles can run (not tiled, no optimizer
    in backward, not out for its host RAM) of a quality tier at least ``best``'s (any, for ``--prefer speed``) that
    tiles may let fit one more sequence than it does — the bytes the fits rule counts, less everything tiles could
    free (all activations, temporaries and allocator slack at the peak: the same moment of the tiled step holds the
    rest), within the budget."""
    p = c.plan
    if p.tiled_mlp or p.optimizer_in_backward or c.why_not:
        return False
    if best is not None and prefer == "quality" and fidelity_key(p) > fidelity_key(best.plan):
        return False
    mem = c.memory
    if c.fits:
        if c.batch.max_micro_batch >= micro_limit:
            return False
        mem = estimator(spec, p.with_(micro_batch=c.batch.max_micro_batch + 1, grad_accum=1))
    freeable = mem.activations + mem.temporaries + mem.allocator_slack
    return budget.needed(mem) - freeable <= budget.limit_bytes


__all__ = [
    "ADAMW_FAMILY",
    "SearchResult",
    "enumerate_candidates",
    "host_bytes",
    "price",
    "rank",
    "search",
    "tiling_could_help",
]
