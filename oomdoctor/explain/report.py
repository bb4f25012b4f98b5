"""What ``explain`` produces: the parsed message (:class:`OomMessage`), the report with its traceback context
(:class:`OomReport`), and the diagnosis (:class:`Cause`, :class:`Fix`, :class:`Diagnosis`).

Plain frozen dataclasses; their JSON forms are built in :mod:`oomdoctor.explain.render`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from oomdoctor.explain import render

#: Cause ids, in no particular order (the diagnosis orders them by likelihood).
CAUSE_IDS: tuple[str, ...] = ("fragmentation", "other-processes", "huge-allocation", "capacity")
#: Phases a traceback can reveal.
PHASES: tuple[str, ...] = (
    "model-load",
    "forward",
    "loss",
    "backward",
    "optimizer-step",
    "evaluation",
    "checkpoint-save",
)


@dataclass(frozen=True)
class ProcessUse:
    """One ``Process N has X memory in use`` entry of the message."""

    pid: int | None
    """Process id (``None`` for the ``this process`` entry)."""
    bytes: int | None
    """Memory in use, ``None`` when NVML could not tell (printed as 0 bytes or 2**64 - 1 bytes)."""
    is_self: bool = False
    """The process that raised the OOM."""


@dataclass(frozen=True)
class OomMessage:
    """What one out-of-memory message says, as numbers, as one parser read it. ``None`` wherever it does not say."""

    kind: str
    """``cuda-allocator`` (torch's caching allocator), ``cuda-error`` (``CUDA error: out of memory``),
    ``cpu-allocator``,
    ``mps-allocator``, ``fsdp-clone-warning``, ``quantized-offload`` (bitsandbytes model spilled to CPU/disk) or
    ``batch-size-exhausted`` (accelerate/HF auto batch size gave up: every batch size down to 1 ran out of memory)
    or ``cpu-oom-killer`` (the Linux kernel killed the process: host RAM)."""
    format: str
    """Which wording was recognised, e.g. ``torch>=2.2``, ``torch-2.1``, ``torch<=2.0``, ``cudnn``,
    ``torch-mps-buffer``, ``linux-oom-killer-cgroup``."""
    device: str
    """``cuda:0``, ``cpu``, ``mps``... (``cuda`` when the index is not printed)."""
    message: str
    """The OOM sentence itself, as found (prefixes stripped, whitespace collapsed)."""
    requested_bytes: int | None = None
    """Size of the allocation that failed (``Tried to allocate``)."""
    total_bytes: int | None = None
    """Total memory of the device (``total capacity``; MPS: ``max allowed``; a container's OOM kill: its memory
    cgroup's limit)."""
    free_bytes: int | None = None
    """Memory the driver reported free on the device when the allocation failed."""
    allocated_bytes: int | None = None
    """Bytes held by live tensors (``allocated by PyTorch`` / ``already allocated``), private pools included."""
    reserved_bytes: int | None = None
    """Bytes held by PyTorch's caching allocator (allocated + reserved-but-unallocated)."""
    reserved_unallocated_bytes: int | None = None
    """Cached by PyTorch but not holding a tensor: free for PyTorch, but maybe in blocks too small (fragmentation)."""
    private_pool_bytes: int | None = None
    """Of ``allocated_bytes``: allocated in private pools (CUDA Graphs), torch >= 2.2 only."""
    allowed_bytes: int | None = None
    """Per-process cap set with ``torch.cuda.set_per_process_memory_fraction`` (``M allowed;``, printed only then)."""
    this_process_bytes: int | None = None
    """``Including non-PyTorch memory, this process has X memory in use`` (PyTorch + CUDA context + other libs)."""
    other_processes_bytes: int | None = None
    """Sum of ``Process N has X memory in use`` for every other process; ``None`` when not listed or unknowable."""
    processes: tuple[ProcessUse, ...] = ()
    """Every process entry, in the order printed."""
    non_pytorch_bytes: int | None = None
    """``total - free - reserved``: held outside PyTorch's allocator (CUDA context, cuBLAS/NCCL, other processes)."""
    occurrences: int = 1
    """How many OOM messages the text holds (one per rank and retry); the numbers are from the first full one."""
    alloc_conf_var: str = "PYTORCH_CUDA_ALLOC_CONF"
    """Allocator env var name for this torch: ``PYTORCH_ALLOC_CONF`` when the message already prints that name."""
    tensor_name: str | None = None
    """FSDP clone warnings: the state-dict entry that failed to clone."""
    notes: tuple[str, ...] = ()
    """Things worth knowing about how the numbers were read (unknown values, assumptions)."""


@dataclass(frozen=True)
class OomReport(OomMessage):
    """The message plus what its traceback shows: the phase and the failing line."""

    phase: str | None = None
    """Training phase the traceback shows (one of :data:`PHASES`), ``None`` without a telling frame."""
    phase_frame: str | None = None
    """The traceback frame that decided the phase (``file:line in func: code``)."""
    failing_frame: str | None = None
    """The innermost traceback frame: the line that asked for the memory."""
    ranks: tuple[int, ...] = ()
    """Distributed ranks (``[rankN]:`` prefixes / ``on rank N``) that reported an OOM."""

    @classmethod
    def of(
        cls,
        message: OomMessage,
        *,
        phase: str | None,
        phase_frame: str | None,
        failing_frame: str | None,
        ranks: tuple[int, ...],
    ) -> "OomReport":
        """``message`` with its traceback context and the ranks that reported it."""
        own = {f.name: getattr(message, f.name) for f in fields(OomMessage)}
        return cls(**own, phase=phase, phase_frame=phase_frame, failing_frame=failing_frame, ranks=ranks)

    def to_dict(self) -> dict:
        return render.report_dict(self)


@dataclass(frozen=True)
class Fix:
    """One concrete change: what to set, where."""

    id: str
    """Stable id (``expandable-segments``, ``gradient-checkpointing``, ``eval-batch-size``...)."""
    text: str
    """What to do and why, one sentence."""
    how: str
    """The exact env var / config key / flag to set."""
    saves_bytes: int | None = None
    """Peak bytes saved for the user's plan (memory model), when ``--model`` was given and the fix changes the plan."""
    peak_after_bytes: int | None = None
    """The plan's device peak with this fix applied (memory model)."""
    fits: bool | None = None
    """Whether the plan with this fix fits the card (memory model vs. the card's capacity)."""

    def to_dict(self) -> dict:
        return render.fix_dict(self)


@dataclass(frozen=True)
class Cause:
    """One likely cause with the numbers behind it and the fixes that address it, best first."""

    id: str
    """One of :data:`CAUSE_IDS`."""
    score: float
    """Likelihood in [0, 1] used for ordering (a heuristic weight, not a probability)."""
    evidence: tuple[str, ...]
    """Sentences with the numbers from the message (and the memory model) that point to this cause."""
    fixes: tuple[Fix, ...]
    """What to change, best first."""

    def to_dict(self) -> dict:
        return render.cause_dict(self)


@dataclass(frozen=True)
class Diagnosis:
    """The parsed message plus its causes, most likely first."""

    report: OomReport
    """The message and its traceback context."""
    causes: tuple[Cause, ...]
    """Likely causes, most likely first."""
    plan_label: str | None = None
    """The user's plan (``--model``/``--config``), when given."""
    plan_peak_bytes: int | None = None
    """Device peak of the user's plan according to the memory model (``MemoryBreakdown.peak_device``)."""
    plan_peak_phase: str | None = None
    """Phase of the plan's peak (memory model)."""
    capacity_bytes: int | None = None
    """Card capacity used for the fits/does-not-fit verdicts (``--gpu-mem`` or the message's total)."""
    next_command: str | None = None
    """The oomdoctor command to run next (``oomdoctor tune MODEL --gpu-mem SIZE``); ``None`` for host-RAM OOMs."""

    def to_dict(self) -> dict:
        return render.diagnosis_dict(self)
