"""Throughput model used to rank plans: GPU speed profiles and a roofline-style tokens/s estimate
(see ``docs/tune.md``). Pure Python; the number ranks plans, it is not a promise of speed."""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.memory.context import adapter_numel
from oomdoctor.model.lora_targets import lora_groups_of
from oomdoctor.model.roles import layer_roles
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan


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
    link_bytes_per_s: float | None = None
    """GPU-to-GPU bandwidth per rank for collectives (None: the PCIe figure, a PCIe-only box; NVLink is faster)."""


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
    """Trainable parameters: all for full fine-tuning; for LoRA ``r * (in + out)`` per module peft adapts
    (``model/lora_targets.lora_groups_of``: the one rule the executor and the pricing use)."""
    if plan.method == "full":
        return spec.num_params
    return adapter_numel(plan, lora_groups_of(spec, plan))


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
    comm_s: float = 0.0
    """Collectives between the GPUs (all-reduce, all-gather, reduce-scatter), assumed not overlapped."""

    def to_dict(self) -> dict:
        return {
            "tokens_per_s": round(self.tokens_per_s, 1),
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "transfer_s": self.transfer_s,
            "comm_s": self.comm_s,
            "profile": self.profile,
        }


def estimate_throughput(
    spec: ModelSpec, plan: Plan, profile: HardwareProfile, memory: MemoryBreakdown | None = None
) -> Throughput:
    """Roofline-style estimate of training tokens/s for ``plan`` (micro-batch and accumulation included).

    Compute (Kaplan et al. 2020, "Scaling Laws", sec. 2.1; Chinchilla appendix F): a forward pass costs
    ``F = 2 * N_matmul + 4 * L * s * d_attn`` FLOPs per token (weights that multiply, plus QK^T and AV);
    full fine-tuning's backward costs ``2F`` (activation and weight gradients), LoRA's about ``F`` (no weight
    gradients for the frozen base; adapters are negligible); gradient checkpointing adds one more forward ``F``
    (so +1/3 for full fine-tuning), a tiled MLP one more forward of the MLPs, the chunked loss one more of the LM
    head. Time = FLOPs / (peak * MFU); fp32 plans use the fp32 peak.
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
    if plan.loss == "chunked" and spec.arch_kind == "decoder":
        per_token += 2 * spec.hidden_size * spec.vocab_size  # each chunk's LM head runs again in backward
    if plan.tiled_mlp:
        per_token += 2 * _mlp_numel(spec)  # each MLP tile runs again in backward
    peak = profile.fp32_flops if plan.precision == "fp32" else profile.bf16_flops
    tokens_micro = plan.micro_batch * s
    compute_micro = tokens_micro * per_token / (peak * profile.mfu)

    mem_micro = 0.0
    if plan.quant is not None:
        qbytes = 1.0 if plan.quant == "int8" else 0.5
        mem_micro += passes * n_lin * (qbytes + 4.0) / profile.hbm_bytes_per_s

    trainable = trainable_params(spec, plan)
    wbytes = plan.weight_dtype_bytes
    state_bytes = {
        "adamw": 2 * wbytes,
        "paged-adamw": 8,
        "adamw-8bit": 2,
        "paged-adamw-8bit": 2,
        "adafactor": 1,
        "lion": wbytes,
        "sgd": wbytes if plan.sgd_momentum else 0,
    }.get(plan.optimizer, 8)
    opt_bytes = trainable * (2 * wbytes + wbytes + 2 * state_bytes)
    memory_step = 0.0 if plan.offload_optimizer else opt_bytes / profile.hbm_bytes_per_s

    transfer_micro = 0.0
    transfer_step = 0.0
    if plan.offload_optimizer:
        transfer_step += trainable * 2 * wbytes / profile.pcie_bytes_per_s  # grads down, weights up
        transfer_step += opt_bytes / profile.cpu_bytes_per_s
    if plan.offload_activations:
        act = (
            memory.cpu_offloaded
            if (memory is not None and memory.cpu_offloaded)
            else (memory.activations if memory is not None else 0)
        )
        transfer_micro += 2 * act / profile.pcie_bytes_per_s
    if plan.offload_params:
        pbytes = N * (1 if plan.quant == "int8" else 0.5 if plan.quant else wbytes)
        transfer_micro += passes * pbytes / profile.pcie_bytes_per_s

    ga = plan.grad_accum
    compute_s = ga * compute_micro
    memory_s = ga * mem_micro + memory_step
    transfer_s = ga * transfer_micro + transfer_step
    comm_s = communication_bytes(spec, plan) / (profile.link_bytes_per_s or profile.pcie_bytes_per_s)
    step = compute_s + memory_s + transfer_s + comm_s
    tokens = ga * tokens_micro
    return Throughput(tokens / step if step > 0 else 0.0, step, compute_s, memory_s, transfer_s, profile.name, comm_s)


def _mlp_numel(spec: ModelSpec) -> int:
    """Weights of every block's MLP (the matmuls a tiled MLP's backward runs again), per token visited."""
    roles = layer_roles(spec)
    return int(max(spec.num_layers, 1) * sum(i * o * m for _n, i, o, m in roles.mlp_in + roles.mlp_out))


def communication_bytes(spec: ModelSpec, plan: Plan) -> float:
    """Bytes one rank sends per optimizer step, ring collectives ((n-1)/n of the buffer per all-gather or
    reduce-scatter, twice that per all-reduce; ZeRO paper §7 and multi-gpu.md §5: 2Ψ for DDP and ZeRO-1/2, 3Ψ for
    FSDP/ZeRO-3). DDP all-reduces the gradients once per step (``no_sync`` while accumulating); FSDP and ZeRO-3
    all-gather the weights in forward and again in backward (once with ``reshard_after_forward=False``) and
    reduce-scatter the gradients (fp32) every micro-batch; ZeRO-2 reduce-scatters the gradients every micro-batch
    and all-gathers the updated weights once per step."""
    n = plan.world_size
    if n == 1 or plan.strategy == "single":
        return 0.0
    bc = 4 if plan.precision == "fp32" else 2
    grad_b = plan.weight_dtype_bytes if plan.method == "full" else 4
    trainable = trainable_params(spec, plan)
    ga = plan.grad_accum
    if plan.strategy == "ddp":
        return 2 * (n - 1) / n * trainable * grad_b
    if plan.strategy == "zero2":
        return (n - 1) / n * (ga * trainable * bc + spec.num_params * bc)
    shards = plan.shards
    gathers = 2 if plan.reshard_after_forward or plan.strategy == "zero3" else 1
    per_micro = (shards - 1) / shards * (gathers * spec.num_params * bc + trainable * 4)
    replicas = n // shards
    across = 2 * (replicas - 1) / replicas * trainable * 4 / shards  # HSDP: all-reduce of the shards across groups
    return ga * per_micro + across


__all__ = [
    "HardwareProfile",
    "REFERENCE_PROFILE",
    "GPU_PROFILES",
    "profile_for",
    "trainable_params",
    "Throughput",
    "communication_bytes",
    "estimate_throughput",
]
