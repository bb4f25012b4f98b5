"""Advice: for a plan that does not fit, the smallest changes that make it fit, with the bytes each saves.

Every candidate is a one-knob change of the plan, priced with the memory model (bytes saved = what ``Budget.fits``
counts, before minus after). Candidates are ranked by what they cost the user — first changes that
keep the same math (micro-batch split with more accumulation, memory-efficient attention, fused optimizer), then
compute for memory (gradient checkpointing, offload), then numerics (bf16, 8-bit states, a quantized base without
peft's fp32 upcast), then what is trained
(LoRA, QLoRA), and last the data (shorter sequences). If no single change fits, the cheapest combination of changes is
returned; if nothing fits at all, the largest bundled model of the same family that does.

The texts teach the techniques as they are: LoRA is Low-Rank Adaptation (peft), AdamW costs exactly Adam's
memory (decoupled weight decay adds no state), Xavier init saves nothing (efficient init = meta device / loading
straight into the target dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from oomdoctor.engines import estimate
from oomdoctor.memory import MemoryBreakdown
from oomdoctor.model.execution import tiling_applies, upcast_to_fp32
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.budget import Budget
from oomdoctor.plan.changes import CHANGES
from oomdoctor.plan.techniques import how

Estimator = Callable[[ModelSpec, Plan], MemoryBreakdown]


def _analytic(spec: ModelSpec, plan: Plan) -> MemoryBreakdown:
    return estimate(spec, plan, "analytic")


@dataclass(frozen=True)
class Change:
    """One change to a plan and what it buys."""

    id: str
    """Stable id, e.g. ``gradient-checkpointing``, ``optimizer:adamw-8bit``, ``method:qlora``."""
    description: str
    """What to do and what it costs, in words."""
    changes: dict
    """The plan knobs it sets (technique-table names): rendered as flags or YAML keys by :attr:`flags` /
    :attr:`yaml`."""
    cost: int
    """Rank of what the change costs the user (0 = same math ... 9 = different data)."""
    plan: Plan
    """The plan after the change."""
    saves_bytes: int = 0
    """What the fits rule counts (``Budget.needed``: the resident device peak on a GPU), before minus after."""
    fits: bool | None = None

    @property
    def flags(self) -> str:
        """How to apply it on the diagnose/tune command line."""
        return how(self.changes, "flags", self.plan.lora_targets)

    @property
    def yaml(self) -> str:
        """How to apply it in a train YAML (``oomdoctor train``, Hugging Face key names)."""
        return how(self.changes, "yaml", self.plan.lora_targets)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "description": self.description,
            "flags": self.flags,
            "yaml": self.yaml,
            "saves_bytes": self.saves_bytes,
            "fits": self.fits,
            "settings": self.plan.settings(),
        }


def candidate_changes(spec: ModelSpec, plan: Plan) -> list[tuple[str, str, int, dict]]:
    """(id, description, cost, plan changes) for every one-knob change that could save memory."""
    c: list[tuple[str, str, int, dict]] = []
    if plan.micro_batch > 1:
        mb = plan.micro_batch // 2
        acc = plan.grad_accum * plan.micro_batch // mb if plan.micro_batch % mb == 0 else plan.grad_accum * 2
        c.append(
            (
                "micro-batch",
                f"micro-batch {plan.micro_batch} -> {mb} with gradient accumulation {plan.grad_accum} -> {acc}: "
                + CHANGES["micro-batch"],
                0,
                dict(micro_batch=mb, grad_accum=acc),
            )
        )
    if plan.attn == "eager":
        c.append(("attn:sdpa", CHANGES["attn:sdpa"], 0, dict(attn="sdpa")))
    torch_opt = plan.optimizer in ("adamw", "sgd")
    if torch_opt and plan.optimizer_impl == "foreach" and not plan.offload_optimizer:
        c.append(("optimizer:fused", CHANGES["optimizer:fused"], 0, dict(optimizer_impl="fused")))
    if plan.loss != "chunked" and spec.arch_kind == "decoder":
        c.append(("loss:chunked", CHANGES["loss:chunked"], 0, dict(loss="chunked")))
    if not plan.gradient_checkpointing:
        c.append(("gradient-checkpointing", CHANGES["gradient-checkpointing"], 1, dict(gradient_checkpointing=True)))
    if plan.world_size > 1 and plan.strategy == "ddp":
        c.append(("strategy:fsdp", f"{plan.world_size} GPUs: " + CHANGES["strategy:fsdp"], 1, dict(strategy="fsdp")))
    if plan.strategy == "zero2":
        c.append(("strategy:zero3", CHANGES["strategy:zero3"], 1, dict(strategy="zero3")))
    if plan.strategy == "fsdp" and not plan.reshard_after_forward:
        c.append(("reshard-after-forward", CHANGES["reshard-after-forward"], 1, dict(reshard_after_forward=True)))
    if not plan.tiled_mlp and tiling_applies(spec, plan.tokens_per_micro_batch):  # validate refuses the rest
        c.append(("tiled-mlp", CHANGES["tiled-mlp"], 1, dict(tiled_mlp=True)))
    if not plan.offload_activations:
        c.append(("offload:activations", CHANGES["offload:activations"], 2, dict(offload_activations=True)))
    if not plan.offload_optimizer and plan.optimizer not in ("sgd",) and not plan.optimizer_is_paged:
        c.append(("offload:optimizer", CHANGES["offload:optimizer"], 2, dict(offload_optimizer=True)))
    if (
        plan.method == "full"
        and plan.grad_accum == 1
        and not plan.optimizer_in_backward
        and not plan.offload_optimizer
        and plan.precision != "fp16-mixed"
    ):
        c.append(("optimizer-in-backward", CHANGES["optimizer-in-backward"], 3, dict(optimizer_in_backward=True)))
    if plan.precision == "fp32":
        c.append(("precision:bf16-mixed", CHANGES["precision:bf16-mixed"], 2, dict(precision="bf16-mixed")))
    if plan.precision in ("fp32", "fp16-mixed", "bf16-mixed"):
        c.append(("precision:bf16", CHANGES["precision:bf16"], 3, dict(precision="bf16")))
    if upcast_to_fp32(plan):
        c.append(("kbit-upcast:off", CHANGES["kbit-upcast:off"], 3, dict(kbit_upcast=False)))
    if plan.optimizer in ("adamw", "paged-adamw"):
        c.append(("optimizer:adamw-8bit", CHANGES["optimizer:adamw-8bit"], 3, dict(optimizer="adamw-8bit")))
    if plan.optimizer in ("adamw", "adamw-8bit"):
        c.append(
            ("optimizer:paged-adamw-8bit", CHANGES["optimizer:paged-adamw-8bit"], 3, dict(optimizer="paged-adamw-8bit"))
        )
    if plan.optimizer not in ("adafactor", "sgd", "lion"):
        c.append(("optimizer:adafactor", CHANGES["optimizer:adafactor"], 4, dict(optimizer="adafactor")))
        c.append(("optimizer:lion", CHANGES["optimizer:lion"], 4, dict(optimizer="lion")))
    if plan.optimizer != "sgd":
        c.append(("optimizer:sgd", CHANGES["optimizer:sgd"], 4, dict(optimizer="sgd")))
    if plan.method == "full":
        c.append(("method:lora", CHANGES["method:lora"], 5, dict(method="lora")))
    if plan.method in ("full", "lora"):
        c.append(
            (
                "method:qlora",
                CHANGES["method:qlora"],
                6,
                dict(
                    method="qlora",
                    quant="nf4",
                    double_quant=True,
                    precision="bf16-mixed" if plan.precision == "fp32" else plan.precision,
                ),
            )
        )
    if plan.method == "qlora" and plan.quant == "int8":
        c.append(("quant:nf4", CHANGES["quant:nf4"], 5, dict(quant="nf4", double_quant=True)))
    if plan.method == "qlora" and plan.quant in ("nf4", "fp4") and not plan.double_quant:
        c.append(("quant:double", CHANGES["quant:double"], 1, dict(double_quant=True)))
    if plan.uses_lora and plan.lora_on_head:
        c.append(("lora:no-head", CHANGES["lora:no-head"], 2, dict(lora_on_head=False)))
    if plan.seq_len > 256:
        c.append(
            (
                "seq-len",
                f"shorter sequences ({plan.seq_len} -> {plan.seq_len // 2} tokens): " + CHANGES["seq-len"],
                8,
                dict(seq_len=plan.seq_len // 2),
            )
        )
    return c


def _counted(budget: Budget | None, memory: MemoryBreakdown) -> int:
    """The bytes the fits rule counts (``Budget.needed``; without a budget the resident device peak)."""
    return budget.needed(memory) if budget is not None else memory.resident_device


def _priced(
    spec: ModelSpec, plan: Plan, before: MemoryBreakdown, budget: Budget | None, estimator: Estimator
) -> list[Change]:
    out: list[Change] = []
    for cid, desc, cost, changes in candidate_changes(spec, plan):
        try:
            new_plan = plan.with_(**changes)
        except Exception:  # noqa: BLE001 - a change that is invalid for this plan is simply not offered
            continue
        after = estimator(spec, new_plan)
        saved = _counted(budget, before) - _counted(budget, after)
        if saved <= 0:
            continue
        out.append(
            Change(cid, desc, changes, cost, new_plan, saved, budget.fits(after) if budget is not None else None)
        )
    return out


@dataclass
class Advice:
    """Ranked ways to make one plan fit."""

    single: list[Change] = field(default_factory=list)
    """One-knob changes that save memory: those that make the plan fit first, then by cost, then bytes saved."""
    path: list[Change] = field(default_factory=list)
    """When no single change fits: cumulative changes, cheapest first, until the plan fits (may not reach it)."""
    path_fits: bool = False

    def to_dict(self) -> dict:
        return {
            "changes": [c.to_dict() for c in self.single],
            "path": [c.to_dict() for c in self.path],
            "path_fits": self.path_fits,
        }


def advise(
    spec: ModelSpec,
    plan: Plan,
    budget: Budget | None,
    *,
    estimator: Estimator | None = None,
    max_depth: int = 3,
    with_path: bool = True,
) -> Advice:
    """Ranked changes that make ``plan`` fit ``budget`` (``Budget.fits``; None: savings only, no verdicts);
    ``with_path=False`` skips the combination search."""
    est = estimator or _analytic
    before = est(spec, plan)
    single = _priced(spec, plan, before, budget, est)
    single.sort(key=lambda ch: (not ch.fits, ch.cost, -ch.saves_bytes))
    advice = Advice(single=single)
    if budget is None or budget.fits(before) or any(ch.fits for ch in single) or not with_path:
        advice.path_fits = bool(budget is not None and (budget.fits(before) or single and single[0].fits))
        return advice
    advice.path, advice.path_fits = _cheapest_combination(spec, plan, before, budget, est, max_depth)
    return advice


def _cheapest_combination(
    spec: ModelSpec, plan: Plan, before: MemoryBreakdown, budget: Budget, est: Estimator, max_depth: int, beam: int = 48
) -> tuple[list[Change], bool]:
    """Breadth-first over combinations of changes (depth <= ``max_depth``): the fitting combination with the
    lowest total cost (then fewest changes, then most saved). Intermediate steps may save nothing on their own
    (LoRA without gradient checkpointing can need more than full fine-tuning with offload; together they fit),
    which is why this is not a greedy walk. Without a fitting combination, the path to the smallest peak found."""
    frontier: list[tuple[Plan, MemoryBreakdown, list[Change]]] = [(plan, before, [])]
    seen = {plan}
    best: tuple[int, list[Change]] = (budget.needed(before), [])
    for _ in range(max_depth):
        fitting: list[list[Change]] = []
        nxt: list[tuple[Plan, MemoryBreakdown, list[Change]]] = []
        for cur, mem, path in frontier:
            used = {c.id.split(":")[0] for c in path}
            for cid, desc, cost, changes in candidate_changes(spec, cur):
                if cid.split(":")[0] in used:  # one change per knob
                    continue
                try:
                    new_plan = cur.with_(**changes)
                except Exception:  # noqa: BLE001 - invalid combination: not offered
                    continue
                if new_plan in seen:
                    continue
                seen.add(new_plan)
                after = est(spec, new_plan)
                ok = budget.fits(after)
                step = Change(cid, desc, changes, cost, new_plan, budget.needed(mem) - budget.needed(after), ok)
                new_path = path + [step]
                if ok:
                    fitting.append(new_path)
                else:
                    nxt.append((new_plan, after, new_path))
                    if budget.needed(after) < best[0]:
                        best = (budget.needed(after), new_path)
        if fitting:
            return min(fitting, key=lambda p: (sum(c.cost for c in p), len(p), -sum(c.saves_bytes for c in p))), True
        nxt.sort(key=lambda t: (budget.needed(t[1]), sum(c.cost for c in t[2])))
        frontier = nxt[:beam]
    return best[1], False


@dataclass(frozen=True)
class SmallerModel:
    """A bundled model of the same family that fits, with the most faithful plan that does."""

    model_id: str
    params: int
    plan: Plan
    memory: MemoryBreakdown

    def to_dict(self) -> dict:
        return {
            "model": self.model_id,
            "params": self.params,
            "settings": self.plan.settings(),
            "memory": self.memory.to_dict(),
        }


def smaller_model_that_fits(
    spec: ModelSpec, base: Plan, budget: Budget, *, estimator: Estimator | None = None
) -> SmallerModel | None:
    """Largest bundled model of ``spec``'s family, smaller than it, for which some matrix plan fits."""
    from oomdoctor.diagnose.matrix import enumerate_plans
    from oomdoctor.model.load import bundled_ids, load_spec, registry_entry

    est = estimator or _analytic
    if not spec.family:
        return None
    candidates = []
    for mid in bundled_ids():
        entry = registry_entry(mid) or {}
        if entry.get("family") != spec.family or mid == spec.name:
            continue
        other = load_spec(mid)
        if other.num_params < spec.num_params:
            candidates.append((other.num_params, mid, other))
    pins = {"micro_batch": base.micro_batch, "seq_len": base.seq_len}
    for params, mid, other in sorted(candidates, key=lambda t: (-t[0], t[1])):
        for plan in enumerate_plans(pins, base):
            mem = est(other, plan)
            if budget.fits(mem):
                return SmallerModel(mid, params, plan, mem)
    return None
