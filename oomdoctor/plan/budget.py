"""The memory budget: how much a plan may use, where that number came from, and the one rule that decides "fits".

Every verb uses the same :class:`Budget` (``diagnose``, ``tune``, ``train --dry-run`` and ``train``'s
``micro_batch_size: auto``), resolved once by :func:`resolve_budget`, so one plan and one capacity get one verdict.

Capacity (first that applies):

* ``--gpu-mem`` (or the train config's ``gpu_mem``): the card the user plans for, taken as given;
* the local GPU's *free* memory through NVML (``oomdoctor.gpu.detect_gpu``): its total minus what other processes and
  the driver already hold — memory this process cannot get, whatever the plan. NVML's *total* is not used: on a
  shared card it promises memory that is taken, and the verdict would then differ from the one ``tune`` plans with;
* nothing: no verdict (``diagnose``, the dry-run) or an error (``tune``, ``micro_batch_size: auto``).

The rule: a plan fits when the memory it keeps *resident* is at most ``capacity - margin``. On a GPU that is
``MemoryBreakdown.resident_device``: ``peak_device`` (tensors at the peak + allocator slack + cuBLAS workspace + CUDA
context) minus bitsandbytes' paged optimizer state, which lives in CUDA unified memory and is evicted to host RAM when
the device runs short (it is shown, never counted; Dettmers et al. 2023, QLoRA sec. 2 "Paged Optimizers"). On a CPU
run, where ``--gpu-mem`` caps live tensor bytes (``oomdoctor.execute.tracking.LiveBytes``), it is ``peak_allocated``.

Default margin: :data:`DEFAULT_MARGIN_BYTES` = 0 bytes. Everything the memory model knows about a device beyond the
tensors is already a component of the breakdown (``oomdoctor.memory.runtime``): the CUDA context (512 MiB), two cuBLAS
workspaces, the allocator's per-tensor rounding and segment tails, and a fragmentation allowance of 8 % of the
transient bytes (activations, logits, temporaries, casts). The NVML source already subtracts other processes and the
driver's reservation. A flat extra 10 % counted that allowance a second time — and over the whole card, weights
included, which never fragment: on an 80 GB card it held back 8 GB, more than the activations of most LoRA plans. The
analytic engine matches real CPU steps and the replayed Hugging Face step within about 1.2 % (README, "How memory
is priced"); a miss on a real GPU is caught by ``tune``'s verification on the device and by ``train``'s OOM guard.
What the tool cannot know — a job that starts on the card later, a display server on the card ``--gpu-mem`` names —
is the user's reserve: ``--margin``, as a fraction (``0.1``), a percentage (``10%``) or a size (``2GB``), always held
and reported in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from oomdoctor.errors import BadInput
from oomdoctor.gpu import GpuInfo
from oomdoctor.units import format_bytes, parse_size

#: Margin kept free when none is given, in bytes (see the module docstring for why it is 0).
DEFAULT_MARGIN_BYTES = 0

#: Largest margin as a share of the capacity (a budget of less than a tenth of the card is a typo).
MAX_MARGIN_FRACTION = 0.9

#: Where a capacity came from.
#: (``explain``: the card ``oomdoctor explain`` judges fixes against, ``--gpu-mem`` or the OOM message's total.)
CapacitySource = Literal["--gpu-mem", "config gpu_mem", "nvml free", "explain"]
#: How the margin was given: not at all (the default), as a fraction, a percentage or a size.
MarginForm = Literal["default", "fraction", "percent", "size"]
#: The breakdown quantity the rule compares: the resident device peak (GPU) or live tensor bytes (CPU cap).
Counted = Literal["resident_device", "peak_allocated"]


@dataclass(frozen=True)
class Budget:
    """How much memory a plan may keep resident, and where the numbers came from."""

    capacity_bytes: int
    """Memory available to the plan: ``--gpu-mem``, the config's ``gpu_mem`` or the GPU's free memory (NVML)."""
    source: CapacitySource
    """Where :attr:`capacity_bytes` came from."""
    margin_bytes: int = DEFAULT_MARGIN_BYTES
    """Bytes kept free on top of everything the memory model prices (the user's reserve)."""
    margin_form: MarginForm = "default"
    """How the margin was given (a fraction or percentage is converted to bytes of the capacity once)."""
    counted: Counted = "resident_device"
    """Breakdown quantity compared: ``resident_device`` on a GPU, ``peak_allocated`` under a CPU run's live-byte cap."""
    notes: tuple[str, ...] = ()
    """What the user should know about the capacity (other processes on the card, a flag bigger than the card)."""

    @property
    def limit_bytes(self) -> int:
        """``capacity - margin``: the most a plan may keep resident."""
        return self.capacity_bytes - self.margin_bytes

    def needed(self, memory: Any) -> int:
        """Bytes of ``memory`` (a ``MemoryBreakdown``) that the rule counts."""
        return int(getattr(memory, self.counted))

    def headroom(self, memory: Any, overshoot: float = 1.0) -> int:
        """``limit - needed``: bytes left (>= 0 fits) or missing (< 0); ``overshoot`` scales what is needed (a
        verified calibration of the estimate: measured / predicted)."""
        return self.limit_bytes - int(self.needed(memory) * overshoot)

    def fits(self, memory: Any, overshoot: float = 1.0) -> bool:
        """The one rule: the counted bytes of ``memory`` (times ``overshoot``) are at most ``capacity - margin``."""
        return self.headroom(memory, overshoot) >= 0

    def describe(self) -> str:
        """One line: ``22.35 GiB (--gpu-mem) - margin 0 B = 22.35 GiB for the resident device peak``."""
        what = "resident device peak" if self.counted == "resident_device" else "live tensor bytes"
        return (
            f"{format_bytes(self.capacity_bytes)} ({self.source}) - margin {format_bytes(self.margin_bytes)} = "
            f"{format_bytes(self.limit_bytes)} for the {what}"
        )

    def to_dict(self) -> dict:
        return {
            "capacity_bytes": self.capacity_bytes,
            "source": self.source,
            "margin_bytes": self.margin_bytes,
            "margin_form": self.margin_form,
            "limit_bytes": self.limit_bytes,
            "counted": self.counted,
        }


def parse_margin(text: str | float | int | None, capacity: int) -> tuple[int, MarginForm]:
    """``(bytes, form)`` of a margin given as a fraction (``0.1``), a percentage (``10%``) or a size (``2GB``) of
    ``capacity``; None is :data:`DEFAULT_MARGIN_BYTES`. A bare number is a fraction; a size needs a unit.
    BadInput for anything unreadable, negative, or above 0.9 of the capacity."""
    if text is None:
        return DEFAULT_MARGIN_BYTES, "default"
    hint = "e.g. --margin 0.1, --margin 10% or --margin 2GB"
    if isinstance(text, bool):
        raise BadInput(f"--margin: expected a fraction, a percentage or a size, got {text!r}", hint)
    form: MarginForm
    if isinstance(text, (int, float)):
        frac, form = float(text), "fraction"
    else:
        s = str(text).strip()
        try:
            frac, form = (float(s[:-1]) / 100.0, "percent") if s.endswith("%") else (float(s), "fraction")
        except ValueError:
            frac, form = parse_size(s, what="--margin") / capacity, "size"
    if not math.isfinite(frac) or frac < 0 or frac > MAX_MARGIN_FRACTION:
        raise BadInput(
            f"--margin {text}: must be between 0 and {MAX_MARGIN_FRACTION} of the memory ({format_bytes(capacity)})",
            hint,
        )
    return int(round(frac * capacity)), form


def resolve_budget(
    gpu_mem: int | None,
    margin: str | float | int | None,
    gpu_info: GpuInfo | None,
    *,
    gpu_mem_source: CapacitySource = "--gpu-mem",
    on_cpu: bool = False,
) -> Budget | None:
    """The budget from ``gpu_mem`` (labelled ``gpu_mem_source``), else ``gpu_info``'s free memory, else None.

    ``margin`` is anything :func:`parse_margin` reads (None: the default). ``on_cpu``: the capacity caps live tensor
    bytes of a CPU run, so the rule compares ``peak_allocated``. BadInput for a non-positive ``gpu_mem``."""
    notes: list[str] = []
    gpu = gpu_info
    if gpu_mem is not None:
        if isinstance(gpu_mem, bool) or gpu_mem <= 0:
            raise BadInput(f"{gpu_mem_source} must be a positive size, e.g. 24GB")
        capacity, source = int(gpu_mem), gpu_mem_source
        if gpu is not None and capacity > gpu.free_bytes:
            notes.append(
                f"{gpu_mem_source} {format_bytes(capacity)} is more than the {format_bytes(gpu.free_bytes)} "
                f"free on {gpu.name} now: the plan is for the card you named, not this one"
            )
    elif gpu is not None:
        capacity, source = gpu.free_bytes, "nvml free"
        if gpu.used_by_others_bytes:
            notes.append(
                f"{gpu.name}: {format_bytes(gpu.total_bytes)} total, {format_bytes(gpu.used_by_others_bytes)} "
                f"held by {len(gpu.other_processes)} other process(es); planning for the "
                f"{format_bytes(gpu.free_bytes)} free"
            )
    else:
        return None
    margin_bytes, form = parse_margin(margin, capacity)
    return Budget(
        capacity_bytes=capacity,
        source=source,
        margin_bytes=margin_bytes,
        margin_form=form,
        counted="peak_allocated" if on_cpu else "resident_device",
        notes=tuple(notes),
    )


__all__ = [
    "Budget",
    "resolve_budget",
    "parse_margin",
    "DEFAULT_MARGIN_BYTES",
    "MAX_MARGIN_FRACTION",
    "CapacitySource",
    "MarginForm",
    "Counted",
]
