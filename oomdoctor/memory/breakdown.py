"""The typed memory breakdown every engine returns (analytic, simulate, measure).

Categories follow torch's MemTracker: parameter, gradient, optimizer state, activation, temporary — plus the
items users hit in practice and naive estimators skip: logits/loss (the fp32 upcast), AMP weight copies, CUDA
context, cuBLAS workspace, allocator slack and bitsandbytes' paged (unified-memory) optimizer state.
All values are integer bytes on one device (one rank of a multi-GPU plan).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: Components that are tensor bytes inside PyTorch's caching allocator, in display order.
TENSOR_COMPONENTS: tuple[str, ...] = (
    "parameters",
    "master_weights",
    "gradients",
    "optimizer_states",
    "activations",
    "logits",
    "temporaries",
)
#: Components outside the tensor bytes (allocator / driver level).
DEVICE_COMPONENTS: tuple[str, ...] = (
    "allocator_slack",
    "cuda_context",
    "cublas_workspace",
    "nccl_buffers",
    "paged_optimizer",
)

LABELS: dict[str, str] = {
    "parameters": "weights",
    "adapters": "LoRA adapters",
    "master_weights": "AMP weight copies",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "logits": "logits/loss",
    "temporaries": "temporaries",
    "allocator_slack": "allocator slack",
    "cuda_context": "CUDA context",
    "cublas_workspace": "cuBLAS workspace",
    "paged_optimizer": "paged optimizer",
    "cpu_offloaded": "offloaded to CPU",
    "comm_buffers": "communication buffers",
    "nccl_buffers": "NCCL buffers",
    "host_per_node": "host RAM per node",
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory of one training plan at its peak, by component, plus the three peaks.

    The tensor components describe the moment of ``peak_allocated`` (``peak_phase``), so they sum to it:
    ``parameters + master_weights + gradients + optimizer_states + activations + logits + temporaries
    == peak_allocated``.
    """

    parameters: int
    """Model weights as stored on the device, quantization constants included, LoRA adapters included."""
    adapters: int
    """Of ``parameters``: the LoRA adapter weights (0 for full fine-tuning)."""
    master_weights: int
    """AMP's second copy of the weights. With ``*-mixed`` the fp32 parameters are the master copy and autocast keeps
    low-precision working copies of the trainable weights through the step; those copies are counted here."""
    gradients: int
    """Gradients of trainable parameters live at the peak (dtype of the parameter)."""
    optimizer_states: int
    """Optimizer state on the device (AdamW: 2 per trainable parameter; 0 when offloaded or paged)."""
    activations: int
    """Tensors saved for backward live at the peak (excluding logits/loss)."""
    logits: int
    """Logits, their fp32 upcast, loss intermediates and logits gradient live at the peak."""
    temporaries: int
    """Other transient buffers at the peak: optimizer-step temporaries (foreach), attention workspace, casts."""
    allocator_slack: int
    """``peak_reserved - peak_allocated``: caching-allocator rounding and fragmentation."""
    cuda_context: int
    """CUDA context + kernels loaded by torch/cuBLAS (what nvidia-smi shows before any tensor)."""
    cublas_workspace: int
    """cuBLAS/cuBLASLt workspace buffers."""
    paged_optimizer: int = 0
    """bitsandbytes paged optimizer state: CUDA unified memory outside PyTorch's allocator, in ``peak_device`` but
    evictable — the driver pages it out to host RAM when the device runs short, so it is not in
    :attr:`resident_device`."""
    cpu_offloaded: int = 0
    """Bytes moved to host RAM by offloading (not on the device), per rank."""
    comm_buffers: int = 0
    """Of the tensor components (weights and gradients), the communication buffers at the peak: FSDP's gathered
    (unsharded) units and the unsharded gradients in reduce-scatter, DDP's gradient bucket, ZeRO's gathered layer and
    reduce/prefetch buckets (0 on one GPU)."""
    nccl_buffers: int = 0
    """NCCL's own communication buffers (``cudaMalloc``, outside the caching allocator; 0 on one rank), in
    ``peak_device``: a CUDA assumption, see ``oomdoctor.memory.runtime``."""
    host_per_node: int = 0
    """Host RAM one node needs for what its ranks offload (every rank on one node; ×1.5 for DeepSpeed), 0 when
    nothing is offloaded."""
    peak_allocated: int = 0
    """Peak tensor bytes (``torch.cuda.max_memory_allocated``)."""
    peak_reserved: int = 0
    """Peak caching-allocator reservation (``torch.cuda.max_memory_reserved``)."""
    peak_device: int = 0
    """What nvidia-smi would show at the peak: reserved + context + NCCL buffers + paged memory."""
    peak_phase: str = "forward"
    """Phase at which ``peak_allocated`` occurs: ``forward``, ``backward`` or ``optimizer-step`` (``load``: the
    weights while the model loads, priced for multi-rank strategies)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Peak allocated bytes per phase."""
    engine: str = "analytic"
    notes: tuple[str, ...] = ()
    """Caveats specific to this estimate (known limits of the formulas that apply)."""

    @property
    def resident_device(self) -> int:
        """Device memory the plan cannot give back under pressure: ``peak_device`` minus the evictable paged optimizer
        state. What ``oomdoctor.plan.budget.Budget.fits`` compares with the capacity on a GPU."""
        return self.peak_device - self.paged_optimizer

    def tensor_sum(self) -> int:
        return sum(getattr(self, c) for c in TENSOR_COMPONENTS)

    def to_dict(self) -> dict:
        """JSON form (the ``memory`` object of diagnose/tune/train JSON): ``<component>_bytes`` keys."""
        d = asdict(self)
        out: dict = {}
        for k, v in d.items():
            if k in ("peak_phase", "phases", "engine", "notes"):
                out[k] = list(v) if k == "notes" else v
            else:
                out[f"{k}_bytes"] = int(v)
        out["resident_device_bytes"] = self.resident_device
        return out
