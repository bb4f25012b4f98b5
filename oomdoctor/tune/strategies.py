"""Choosing how N GPUs share a plan: the strategy ladder ``tune`` climbs for each technique stack
(``shared/research/multi-gpu.md`` §7.3).

For one stack (method, precision, optimizer, checkpointing...) the strategies are tried cheapest communication first
and the first that fits is kept:

1. **ddp**: a full replica per GPU plus the gradient bucket (2Ψ of traffic per step). Adapters are never sharded
   when DDP fits: FSDP's gathered units cost more than LoRA's frozen base saves (§1: 92.5 against 84.5 MB at N=2);
2. **fsdp** (torch FSDP2 ``fully_shard``, 3Ψ of traffic): model states / shard group; across nodes the shard group
   is one node (``gpus_per_node``): HSDP, shard inside a node, replicate across nodes;
3. **zero2 / zero3** (DeepSpeed) only when asked (``--strategy zero2|zero3``): tune prices them like the others but
   does not pick DeepSpeed on its own, because oomdoctor's own engines are torch DDP/FSDP2;
4. **offload** last (stacks whose optimizer the matrix offloads): FSDP2 ``CPUOffloadPolicy`` (weights, gradients
   and optimizer states on the host), or ZeRO ``offload_optimizer`` when DeepSpeed is asked, with the host RAM per
   node checked against this machine's RAM (``oomdoctor.gpu.host_ram_bytes``, assumed equal on every node).

Each rung is recorded as a :class:`StrategyTrial`, with the reason a cheaper rung failed ("ddp needs 26.7 GB >
24 GB"), for the table ``tune`` prints and its JSON ``strategies`` list. :func:`climb` prices every stack's ladder
(``oomdoctor.tune.search.price``) and ranks the kept rungs; :func:`strategy_table` is the chosen stack's rungs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import SearchTrace
from oomdoctor.plan.budget import Budget
from oomdoctor.plan.plan import DEEPSPEED  # tried only when pinned
from oomdoctor.plan.targets import refusals
from oomdoctor.tune.batch_search import Estimator
from oomdoctor.tune.ranking import Candidate
from oomdoctor.tune.search import SearchResult, host_bytes, price, rank
from oomdoctor.tune.throughput import HardwareProfile
from oomdoctor.units import format_bytes

#: torch strategies tune climbs on its own, cheapest communication first.
TORCH_LADDER: tuple[str, ...] = ("ddp", "fsdp")
#: Topology knobs: pinned by the user, set by the ladder, never spanned by the technique matrix.
TOPOLOGY_FIELDS: tuple[str, ...] = ("world_size", "strategy", "shard_group", "reshard_after_forward", "bucket_size")


@dataclass(frozen=True)
class Topology:
    """The GPUs a plan runs on."""

    world_size: int
    """Every GPU of every node (``--gpus``)."""
    gpus_per_node: int
    """GPUs per node (``--gpus-per-node``, default ``world_size``: one node)."""

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    @property
    def shard_group(self) -> int | None:
        """FSDP's shard group: one node when there are several (HSDP), else every rank."""
        return self.gpus_per_node if self.nodes > 1 else None


def topology(world_size: int | None, gpus_per_node: int | None) -> Topology:
    """Check ``--gpus`` / ``--gpus-per-node`` (BadInput with the fix)."""
    n = 1 if world_size is None else world_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadInput(f"--gpus must be a positive integer, got {world_size!r}")
    g = n if gpus_per_node is None else gpus_per_node
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or n % g:
        raise BadInput(
            f"--gpus-per-node {gpus_per_node} must be a positive divisor of --gpus {n}",
            f"e.g. --gpus {n} --gpus-per-node {n} (one node)",
        )
    return Topology(n, g)


def ladder(stack: Plan, topo: Topology, pins: dict) -> list[Plan]:
    """The plans of one stack in the order tune tries them (invalid combinations left out). ``pins``: the
    topology knobs the user gave (``strategy``, ``shard_group``, ``reshard_after_forward``, ``bucket_size``)."""
    offload = stack.offload_optimizer or stack.offload_params
    if "strategy" in pins:
        strategies: tuple[str, ...] = (pins["strategy"],)
    elif topo.world_size == 1:
        strategies = ("single",)
    else:
        strategies = ("fsdp",) if offload else TORCH_LADDER
    out: list[Plan] = []
    for strategy in strategies:
        changes: dict = dict(world_size=topo.world_size, strategy=strategy)
        if strategy == "fsdp":
            changes["shard_group"] = pins.get("shard_group", topo.shard_group)
            changes["reshard_after_forward"] = pins.get("reshard_after_forward", True)
            if offload:
                changes.update(offload_params=True, offload_optimizer=True)  # FSDP2 CPUOffloadPolicy
        if strategy in DEEPSPEED + ("ddp",) and "bucket_size" in pins:
            changes["bucket_size"] = pins["bucket_size"]
        try:
            out.append(stack.with_(**changes))
        except BadInput:
            continue
    return out


@dataclass(frozen=True)
class StrategyTrial:
    """One rung of the ladder for the chosen stack."""

    label: str
    """Strategy as the plan label shows it (``fsdp(8) hsdp 2x4``, ``+ offload``)."""
    fits: bool
    needed_bytes: int
    """What the budget counts of its breakdown at micro-batch 1 (or at the chosen micro-batch when it fits)."""
    host_per_node_bytes: int
    """Host RAM one node needs (offload), 0 otherwise."""
    reason: str
    """``chosen``, or why it is out (``ddp needs 26.7 GB > 24 GB``)."""

    def to_dict(self) -> dict:
        return {
            "strategy": self.label,
            "fits": self.fits,
            "needed_bytes": self.needed_bytes,
            "host_per_node_bytes": self.host_per_node_bytes,
            "reason": self.reason,
        }


def strategy_label(plan: Plan) -> str:
    """``ddp(8)``, ``fsdp(8) hsdp 2x4``, ``zero3(8) + offload``: the topology part of the plan label."""
    if plan.strategy == "single":
        label = "single"
    else:
        label = f"{plan.strategy}({plan.world_size})"
        if plan.shard_group and plan.shard_group < plan.world_size:
            label += f" hsdp {plan.world_size // plan.shard_group}x{plan.shard_group}"
        if not plan.reshard_after_forward:
            label += " keep-gathered"
    if plan.offload_params or plan.offload_optimizer:
        label += " + offload"
    return label


def trials(rungs: list[Candidate], budget: Budget, chosen: Candidate, host_of) -> list[StrategyTrial]:
    """The rungs up to ``chosen`` (``rungs`` in ladder order), each with its verdict; ``host_of(candidate)``: the
    host RAM per node it needs."""
    out: list[StrategyTrial] = []
    for c in rungs:
        label = strategy_label(c.plan)
        need = budget.needed(c.memory)
        if c is chosen:
            reason = "chosen"
        elif c.fits:
            reason = "fits, a cheaper strategy was kept"
        elif c.why_not:
            reason = f"{label}: {c.why_not}"
        else:
            reason = f"{label} needs {format_bytes(need)} > {format_bytes(budget.limit_bytes)}"
        out.append(StrategyTrial(label, c.fits, need, host_of(c), reason))
        if c is chosen:
            break
    return out


def per_rank_batch(global_batch: int | None, world_size: int) -> int | None:
    """The batch one rank accumulates: ``global_batch / world_size`` (effective batch = micro x accumulation x
    world size); BadInput when the GPUs cannot share it evenly."""
    if global_batch is None or world_size == 1:
        return global_batch
    if global_batch % world_size:
        lower = global_batch // world_size * world_size
        raise BadInput(
            f"--global-batch {global_batch} does not split over {world_size} GPUs "
            "(effective batch = micro-batch x accumulation x GPUs)",
            f"use a multiple of {world_size}, e.g. --global-batch {lower or world_size} or {lower + world_size}",
        )
    return global_batch // world_size


def climb(
    spec: ModelSpec,
    stacks: list[Plan],
    budget: Budget,
    topo: Topology,
    pins: dict[str, Any],
    *,
    global_batch: int | None,
    estimator: Estimator,
    prefer: str,
    profile: HardwareProfile,
    micro_limit: int,
    host_ram: int | None,
) -> tuple[SearchResult, dict[Plan, list[Candidate]]]:
    """Each stack climbs its strategy ladder (:func:`ladder`) until a rung fits; the kept rungs are ranked like
    single-GPU plans. Returns the ranking and every stack's priced rungs (ladder order)."""
    trace = SearchTrace()
    cands: list[Candidate] = []
    ladders: dict[Plan, list[Candidate]] = {}
    for stack in stacks:
        rungs: list[Candidate] = []
        for plan in ladder(stack, topo, pins):
            if refusals(plan, spec.model_type):  # a strategy rung the stack's trainer cannot run (TRL has no HSDP...)
                continue
            c = price(
                spec,
                plan,
                budget,
                global_batch=global_batch,
                estimator=estimator,
                profile=profile,
                micro_limit=micro_limit,
                host_ram=host_ram,
                gpus_per_node=topo.gpus_per_node,
                trace=trace,
            )
            rungs.append(c)
            if c.fits:
                break
        if rungs:
            ladders[stack] = rungs
            cands.append(rungs[-1] if rungs[-1].fits else min(rungs, key=lambda c: budget.needed(c.memory)))
    if not cands:
        raise BadInput(
            f"no plan can run with these topology flags on {topo.world_size} GPU(s): "
            + ", ".join(f"{k}={v}" for k, v in pins.items()),
            "see `oomdoctor diagnose MODEL --gpus N --strategy ...` for what each strategy accepts",
        )
    return rank(cands, budget, prefer, len(trace.evaluations)), ladders  # type: ignore[arg-type]


def strategy_table(
    chosen: Candidate, ladders: dict[Plan, list[Candidate]], budget: Budget, topo: Topology
) -> list[StrategyTrial]:
    """The rungs of the chosen plan's stack (after those of its on-device twin when the chosen plan offloads), each
    with the host RAM per node it needs by the search's rule (``oomdoctor.tune.search.host_bytes``: what it offloads
    and the paged optimizer state the card cannot hold)."""
    mine = next((s for s, rungs in ladders.items() if chosen in rungs), None)
    if mine is None:
        return []
    stacks = [mine]
    if mine.offload_optimizer or mine.offload_params:
        twin = mine.with_(offload_optimizer=False, offload_params=False)
        if twin in ladders:
            stacks.insert(0, twin)
    rungs = [c for s in stacks for c in ladders[s]]
    return trials(rungs, budget, chosen, lambda c: host_bytes(c.memory, budget, c.plan, topo.gpus_per_node))


__all__ = [
    "DEEPSPEED",
    "TOPOLOGY_FIELDS",
    "TORCH_LADDER",
    "StrategyTrial",
    "Topology",
    "climb",
    "ladder",
    "per_rank_batch",
    "strategy_label",
    "strategy_table",
    "topology",
    "trials",
]
