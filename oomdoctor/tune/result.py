"""What ``oomdoctor tune`` found: the plan with its batch, its memory, its verification, the strategies tried, and
the command that runs it — everything ``tune --json`` prints (:meth:`TuneResult.to_dict`) and the header of every
file tune writes (:meth:`TuneResult.summary_lines`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from oomdoctor.gpu import GpuInfo
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.memory.runtime import ALLOC_CONF, ALLOC_CONF_VAR
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import BatchChoice
from oomdoctor.plan.budget import Budget
from oomdoctor.tune.search import SearchResult, host_bytes
from oomdoctor.tune.strategies import StrategyTrial, Topology
from oomdoctor.tune.throughput import Throughput
from oomdoctor.tune.verify import Trial
from oomdoctor.units import format_bytes

#: Recommended caching-allocator setting: expandable segments map more memory into one growing segment instead of
#: fixed-size blocks, so freed blocks of different sizes can be reused (fragmentation is the "reserved but
#: unallocated" part of an OOM message). torch >= 2.1; CUDA only (ignored on ROCm/CPU). See torchtune #1185.

#: Default file ``tune`` writes (a numbered sibling when it exists: ``oomdoctor.tune.emit.default_output_path``).
DEFAULT_OUTPUT = "oomdoctor-plan.yaml"


@dataclass
class TuneResult:
    """Everything ``oomdoctor tune`` reports (``--json`` prints :meth:`to_dict`)."""

    spec: ModelSpec
    budget: Budget
    """Capacity, where it came from, margin, and the fits rule every plan was checked with."""
    gpu: GpuInfo | None
    """The local GPU NVML reported (None: none, or a CPU plan)."""
    prefer: str
    """``--prefer``: ``quality`` (fidelity first) or ``speed`` (throughput first)."""
    seq_len: int
    """Tokens per sequence planned for (``--seq-len max``: the longest that fits)."""
    global_batch: int | None
    """``--global-batch`` over every GPU (None: the largest micro-batch that fits, accumulation 1)."""
    plan: Plan
    """The chosen plan with ``micro_batch`` and ``grad_accum`` set."""
    memory: MemoryBreakdown
    """Memory model breakdown of the chosen plan (same keys as ``diagnose``)."""
    batch: BatchChoice
    """The micro-batch and accumulation chosen, and why."""
    throughput: Throughput | None
    """Estimated throughput of the chosen plan on the profiled GPU."""
    search: SearchResult
    """Every candidate ranked, and the memory-model evaluations the search made."""
    trials: list[Trial] = field(default_factory=list)
    """The verification trials, in the order they ran."""
    verification: str = "none"
    """``gpu``, ``simulate`` or ``none`` — what checked the prediction."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the result (defaults taken, verification fallbacks, profiles used)."""
    alloc_conf: str = ALLOC_CONF
    """``PYTORCH_CUDA_ALLOC_CONF`` the command sets on a GPU."""
    config_path: str | None = None
    """Where the YAML was written (set by ``oomdoctor.tune.emit.write_config``)."""
    topology: Topology = Topology(1, 1)
    """The GPUs planned for (``--gpus``, ``--gpus-per-node``)."""
    strategies: list[StrategyTrial] = field(default_factory=list)
    """The strategies tried for the chosen plan's stack, cheapest first, up to the chosen one (N > 1)."""
    device: str = "cuda"
    """The device the plan is priced for and emitted for: ``cuda`` or ``cpu`` (``--device``)."""

    @property
    def host_per_node_bytes(self) -> int:
        """Host RAM one node needs for the plan by the search's rule (``oomdoctor.tune.search.host_bytes``): what it
        offloads plus the paged optimizer state the card cannot hold (0: nothing on the host)."""
        return host_bytes(self.memory, self.budget, self.plan, self.topology.gpus_per_node)

    @property
    def capacity_bytes(self) -> int:
        """The memory planned for (``budget.capacity_bytes``)."""
        return self.budget.capacity_bytes

    @property
    def capacity_source(self) -> str:
        """Where the capacity came from (``budget.source``)."""
        return self.budget.source

    @property
    def budget_bytes(self) -> int:
        """``capacity - margin``: the most a plan may keep resident."""
        return self.budget.limit_bytes

    @property
    def command(self) -> str:
        """The exact command that runs the emitted config (a GPU run with the recommended allocator setting)."""
        return self.run_command(self.config_path or DEFAULT_OUTPUT)

    def run_command(self, path: str | os.PathLike) -> str:
        """The command that runs the plan's ``oomdoctor train`` config at ``path``."""
        env = f"{ALLOC_CONF_VAR}={self.alloc_conf} " if self.device == "cuda" else ""
        return f"{env}oomdoctor train {shlex.quote(str(path))}{self.launch_flags}"

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
            + (
                f", {'measured' if self.verification == 'gpu' else 'replayed'} {format_bytes(measured)}"
                if measured is not None
                else ""
            )
            + ".",
        )

    @property
    def measured_peak_bytes(self) -> int | None:
        """The verified peak of the chosen micro-batch (None: not verified)."""
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


__all__ = ["DEFAULT_OUTPUT", "TuneResult"]
