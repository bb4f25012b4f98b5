"""Per-rank model states and communication buffers of each strategy (``plan.strategy`` on ``plan.world_size``
ranks). Pure formulas (no torch), applied by ``analytic.py`` on top of the single-GPU terms.

Notation (``shared/research/multi-gpu.md`` §7.2): Ψ parameters, Ψ_t trainable, N = world size, S = ``plan.shards``
(the shard group: N, or fewer under HSDP), b_w bytes per stored weight (4 fp32 / ``*-mixed``, 2 pure bf16), b_c
bytes per compute element (2 under ``*-mixed``/bf16, 4 fp32), K optimizer bytes per trainable parameter. Each term
below is a small function citing where it comes from:

* single: the single-GPU terms as they are;
* ddp: single + one gradient-sized bucket set, allocated at construction and kept (§1, measured at every N, with or
  without ``gradient_as_bucket_view`` when ``zero_grad(set_to_none=True)``);
* fsdp (FSDP2 ``fully_shard`` per decoder layer + the root, ``oomdoctor.execute.shard``): weights, gradients,
  optimizer states and the step's temporaries / S (§1: 12Ψ/N exactly for fp32 AdamW); the root unit (embedding,
  final norm, head) gathered in b_c for the whole forward (FSDP2 does not reshard the root after forward); the block
  computing and the one prefetched (b_c each); in backward also the unsharded gradients of the block in
  reduce-scatter (b_w); ``reshard_after_forward=False`` keeps every unit gathered from forward to backward (+b_c·Ψ);
  at world size 1 FSDP2 still gathers into separate buffers (§1 footnote 2: +1 root copy). Under ``*-mixed`` the
  gathered units are the compute copies (``MixedPrecisionPolicy(param_dtype=bf16)``): autocast keeps no weight casts;
* zero2 (DeepSpeed ZeRO stage 2): b_c·Ψ weights + (4 + K)Ψ_t/N fp32 master and optimizer states + (b_c + 4)Ψ_t/N
  gradients (DeepSpeed's estimator: 2Ψ + 18Ψ/N, §3) + the reduce bucket (``bucket_size`` elements in b_c, measured);
* zero3: b_c·Ψ/N weights + 4Ψ_t/N gradients + (4 + K)Ψ_t/N (16Ψ/N measured, 18Ψ/N DeepSpeed's estimator) + the
  largest layer gathered (DeepSpeed's ``largest_layer_memory = 4 * largest_layer_params``) + reduce and prefetch
  buckets;
* offload: ZeRO ``offload_optimizer`` moves the fp32 master, optimizer states and fp32 gradients to the host (ZeRO-2:
  2Ψ left on the GPU); ZeRO-3 ``offload_param`` also the weight partitions; FSDP2 ``CPUOffloadPolicy`` moves the
  sharded weights, gradients and optimizer states (the step runs on the CPU). Host RAM per node = ranks per node ×
  per-rank host bytes, × DeepSpeed's ``additional_buffer_factor`` 1.5 for ZeRO (its estimators' "per CPU" column).

The load phase (``RankStates.load``): ``from_pretrained`` on every rank puts a full copy on each (single, ddp; ZeRO-2
casts it to the compute dtype before moving it to the device, the full stored copy stays in host RAM);
``oomdoctor train`` builds fsdp models on the meta device and
materializes the shards only; ZeRO-3 ``zero.Init`` partitions at construction (one layer gathered).

Moments: a phase's peak is the largest of its moments, and FSDP gathers different units at each: the head and the
loss (``LOSS_MOMENT``: the root + one layer), inside the layers (root + the computing and the prefetched layer), and,
without ``reshard_after_forward``, every layer until its own backward (``TOP_MOMENT``). Under FSDP ``*-mixed`` the
gathered bf16 weights make the step compute like a pure bf16 one (``Ctx.gathered_in_compute_dtype``). Checked
against the fake-process-group replay within 0.1 % (tests/test_sharding.py).

Limits: activations under ZeRO mixed precision are the autocast step's (an upper bound: DeepSpeed's bf16 model makes
the residual stream bf16); FSDP's reduce-scatter output and DeepSpeed's meta-tensor lists are not priced; QLoRA
under FSDP is +3 % over the replay (bitsandbytes under FSDP is not checked against a real run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomdoctor.memory.context import Ctx
from oomdoctor.memory.gradients import gradient_bytes, param_bytes_per_trainable, trainable_numel
from oomdoctor.memory.optimizer import optimizer_memory
from oomdoctor.memory.parameters import parameter_bytes
from oomdoctor.memory.runtime import NCCL_BUFFER_BYTES
from oomdoctor.plan.plan import DEEPSPEED
from oomdoctor.plan.techniques import TORCH_OPTIMIZERS
from oomdoctor.units import format_bytes

#: DeepSpeed's estimators multiply host memory by this (``additional_buffer_factor=1.5`` in
#: ``deepspeed/runtime/zero/stage_1_and_2.py`` / ``stage3.py`` ``estimate_zero*_model_states_mem_needs``).
DEEPSPEED_HOST_BUFFER_FACTOR = 1.5
#: Bytes of DeepSpeed's fp32 master weights and fp32 gradient partitions (kept even for fp32 models, §3).
FP32 = 4
#: DeepSpeed's gathered-layer term: ``largest_layer_memory = 4 * largest_layer_params`` (stage3.py estimator).
DS_LARGEST_LAYER_BYTES = 4
#: Fraction of ``bucket_size`` Hugging Face's ``auto`` gives ZeRO-3's prefetch bucket (``0.9 * hidden^2``,
#: transformers ``integrations/deepspeed.py``).
PREFETCH_FRACTION = 0.9

LOAD = "load"
#: Moments inside a phase, as suffixes: the LM head and the loss (``forward-loss``, ``backward-loss``), the first
#: decoder layer backward reaches (``backward-top``). A strategy that does not tell a moment apart uses its phase's.
LOSS_MOMENT = "-loss"
TOP_MOMENT = "-top"


def phase_of(moment: str) -> str:
    """The phase a moment belongs to (``backward-loss`` -> ``backward``)."""
    for suffix in (LOSS_MOMENT, TOP_MOMENT):
        if moment.endswith(suffix):
            return moment.removesuffix(suffix)
    return moment


@dataclass(frozen=True)
class SingleTerms:
    """The single-GPU terms the strategies start from (``analytic.py`` computes them)."""

    parameters: int
    """Every stored weight (quantization constants and adapters included)."""
    gradients: int
    """Every gradient of a trainable parameter."""
    optimizer_states: int
    """Optimizer states on the device (0 when offloaded)."""
    optimizer_host: int
    """Optimizer states on the host (``offload_optimizer``)."""
    step_temporaries: int
    """The optimizer step's transient bytes (foreach)."""


@dataclass(frozen=True)
class RankStates:
    """Memory of one rank's model states under the plan's strategy (bytes)."""

    parameters: int
    """Weights resident on the device (the rank's shard, or a full copy)."""
    grad_scale: float
    """Rank gradient bytes / single-GPU gradient bytes (applies to every gradient term of the step's timeline)."""
    optimizer_states: int
    """Optimizer states (and ZeRO's fp32 master partition) on the device."""
    step_temporaries: int
    """The optimizer step's transient bytes on the device."""
    gathered: dict[str, int] = field(default_factory=dict)
    """Per phase: unsharded weights on the device (FSDP units, ZeRO-3's gathered layer and prefetch bucket)."""
    grad_buffers: dict[str, int] = field(default_factory=dict)
    """Per phase: gradient communication buffers (DDP bucket, FSDP unsharded block gradients, ZeRO reduce bucket)."""
    host: int = 0
    """Host RAM of this rank in steady state (offloaded states)."""
    host_load: int = 0
    """Host RAM of this rank while the model loads."""
    load: int = 0
    """Device bytes of this rank while the model loads."""
    amp_copies: bool = True
    """False: the compute copies are the gathered units / the bf16 model; autocast keeps no weight casts."""
    host_factor: float = 1.0
    """Buffer factor on host RAM (DeepSpeed's 1.5 for ZeRO)."""

    def gathered_at(self, moment: str) -> int:
        """Unsharded weights at ``moment``: a phase or a moment in it (``LOSS_MOMENT``, ``TOP_MOMENT``; the phase's
        own figure when the strategy does not tell them apart)."""
        return self.gathered.get(moment, self.gathered.get(phase_of(moment), 0))

    def grad_buffers_at(self, moment: str) -> int:
        """Gradient communication buffers at ``moment`` (as :meth:`gathered_at`)."""
        return self.grad_buffers.get(moment, self.grad_buffers.get(phase_of(moment), 0))

    def comm_buffers(self, moment: str) -> int:
        return self.gathered_at(moment) + self.grad_buffers_at(moment)


def single_terms(c: Ctx) -> SingleTerms:
    """The single-GPU terms of ``c`` (``parameters``, ``gradients``, ``optimizer`` modules)."""
    opt = optimizer_memory(c)
    return SingleTerms(
        parameters=parameter_bytes(c),
        gradients=gradient_bytes(c),
        optimizer_states=opt.device,
        optimizer_host=opt.cpu,
        step_temporaries=opt.temporaries,
    )


# ---------------------------------------------------------------------------------------------- units


@dataclass(frozen=True)
class Units:
    """Element counts of FSDP's units as ``oomdoctor.execute.shard`` wraps them."""

    root: int
    """The root unit: every parameter outside the decoder layers (embedding, final norm, head)."""
    block: int
    """One decoder layer."""
    largest_layer: int
    """Largest single parameter tensor (DeepSpeed's ``largest_layer_params``: the embedding of a Llama)."""


def units(c: Ctx) -> Units:
    """Unit sizes from the spec's module inventory (plus LoRA adapters, which sit inside the blocks)."""
    s = c.sums
    L = max(c.spec.num_layers, 1)
    return Units(
        root=_numel(c) - c.lora_numel - s.per_layer_numel * L,
        block=s.per_layer_numel + c.lora_numel // L,
        largest_layer=s.max_tensor_numel,
    )


def _compute_bytes(c: Ctx) -> int:
    """b_c: bytes of a gathered weight (the compute dtype: FSDP2 ``MixedPrecisionPolicy(param_dtype)``, DeepSpeed's
    bf16/fp16 model)."""
    return 4 if c.plan.precision == "fp32" else 2


def gathered_unit_bytes(c: Ctx, numel: int, single_params: int) -> int:
    """Bytes of ``numel`` gathered weights: b_c each, or, for a quantized base, their share of the stored bytes."""
    if c.quant is not None:
        return int(single_params * numel / max(_numel(c), 1))
    return numel * _compute_bytes(c)


# ---------------------------------------------------------------------------------------------- the strategies


def ddp_bucket_bytes(t: SingleTerms) -> int:
    """DDP's gradient buckets: together exactly the gradient bytes, kept from construction on (§1, measured +4Ψ fp32
    at N = 1, 2, 4; ``bucket_cap_mb`` only splits them)."""
    return t.gradients


def ddp(c: Ctx, t: SingleTerms) -> RankStates:
    bucket = ddp_bucket_bytes(t)
    phases = ("forward", "backward", "optimizer-step")
    return RankStates(
        t.parameters,
        1.0,
        t.optimizer_states,
        t.step_temporaries,
        grad_buffers={p: bucket for p in phases},
        host=t.optimizer_host,
        load=t.parameters,
    )


def fsdp_gathered(c: Ctx, t: SingleTerms) -> dict[str, int]:
    """FSDP2's unsharded weights per phase (§1, §4 FSDPMemTracker: UNSHARDED_PARAM = root + the current layer,
    ALL_GATHER = the prefetched next one): root + 2 blocks in forward and backward; with
    ``reshard_after_forward=False`` every unit from the end of forward into backward (+b_c·Ψ)."""
    u = units(c)
    root = gathered_unit_bytes(c, u.root, t.parameters)
    block = gathered_unit_bytes(c, u.block, t.parameters)
    # the head and the loss: the root and one decoder layer's unsharded weights (measured by the fake-process-group
    # replay at the logits-bound moments of forward and backward; in backward it is the last layer, prefetched as
    # the loss backward starts), with no block gradient in reduce-scatter yet
    at_loss = root + block
    in_layers = root + 2 * block  # the computing and the prefetched layer
    if c.plan.reshard_after_forward:
        return {
            "forward": in_layers,
            "backward": in_layers,
            "optimizer-step": 0,
            "forward" + LOSS_MOMENT: at_loss,
            "backward" + LOSS_MOMENT: at_loss,
        }
    # every layer stays gathered from its forward until its own backward resharded it: all of them at the end of
    # forward and when backward enters the last layer, the computing and prefetched ones near the first
    everything = root + block * max(c.spec.num_layers, 1)
    return {
        "forward": everything,
        "backward": in_layers,
        "optimizer-step": 0,
        "backward" + LOSS_MOMENT: everything,
        "backward" + TOP_MOMENT: everything,
    }


def fsdp_block_grad_bytes(c: Ctx) -> int:
    """Unsharded gradients of the block in reduce-scatter (b_w·U_block for full fine-tuning; the block's adapters
    for LoRA; FSDP2 reduces in fp32, ``reduce_dtype``)."""
    L = max(c.spec.num_layers, 1)
    if c.full:
        return c.sums.per_layer_numel * param_bytes_per_trainable(c)
    return c.lora_numel // L * param_bytes_per_trainable(c)


def fsdp(c: Ctx, t: SingleTerms) -> RankStates:
    """States / S (§1: 12Ψ/N for fp32 AdamW; HSDP divides by the shard group, not N) + gathered units."""
    S = c.plan.shards
    params, grads, opt = t.parameters // S, t.gradients // S, (t.optimizer_states + t.optimizer_host) // S
    gathered = fsdp_gathered(c, t)
    rs_grads = {"backward": fsdp_block_grad_bytes(c), "backward" + LOSS_MOMENT: 0}  # no block in reduce-scatter yet
    if c.plan.offload_params:
        # CPUOffloadPolicy: sharded weights, gradients and optimizer states on the host; the step runs there
        # (torch ``fully_shard(offload_policy=CPUOffloadPolicy())``); the device holds the units in flight.
        return RankStates(
            0, 0.0, 0, 0, gathered, rs_grads, host=params + grads + opt, host_load=params, load=0, amp_copies=False
        )
    return RankStates(
        params, 1 / S, opt, t.step_temporaries // S, gathered, rs_grads, load=params, amp_copies=not c.mixed
    )


def zero_optimizer_bytes(c: Ctx, t: SingleTerms) -> int:
    """fp32 master weights + optimizer states of the whole model, before partitioning: DeepSpeed keeps a fp32
    master even for fp32 models (§3), and torch optimizers' states follow it into fp32."""
    pb = param_bytes_per_trainable(c)
    states = t.optimizer_states + t.optimizer_host
    if c.plan.optimizer in TORCH_OPTIMIZERS:
        states = states * FP32 // pb
    return FP32 * trainable_numel(c) + states


def zero_bucket_elems(c: Ctx) -> int:
    """DeepSpeed's bucket elements (``Plan.bucket_elems``: ``bucket_size`` or hidden²)."""
    return c.plan.bucket_elems(c.spec.hidden_size)


def zero2(c: Ctx, t: SingleTerms) -> RankStates:
    """DeepSpeed ZeRO-2: b_c·Ψ + (b_c + 4)Ψ_t/N gradients + (4 + K)Ψ_t/N (estimator 2Ψ + 18Ψ/N, PR 5099; measured
    steady 2Ψ + 12Ψ/N, §3) + the reduce bucket in b_c (measured: 5e8 × 2 B = 1.05 GB bf16)."""
    N, bc = c.plan.world_size, _compute_bytes(c)
    params = gathered_unit_bytes(c, _numel(c), t.parameters)
    grads = (bc + FP32) * trainable_numel(c) // N
    opt = zero_optimizer_bytes(c, t) // N
    tmp = t.step_temporaries * FP32 // param_bytes_per_trainable(c) // N
    bucket = zero_bucket_elems(c) * bc
    buffers = {p: bucket for p in ("forward", "backward", "optimizer-step")}
    scale = grads / t.gradients if t.gradients else 0.0
    # from_pretrained loads every rank's full copy in host RAM; the engine casts it (``module.bfloat16()``) and
    # only then moves it to the device (DeepSpeedEngine._configure_distributed_model)
    load = params
    host_load = c.wb * _numel(c)
    if c.plan.offload_optimizer:
        # offload_optimizer: fp32 master, states and fp32 gradients on the host; the GPU keeps 2Ψ (the estimator)
        return RankStates(
            params,
            0.0,
            0,
            0,
            grad_buffers=buffers,
            host=opt + FP32 * trainable_numel(c) // N,
            host_load=host_load,
            load=load,
            amp_copies=False,
            host_factor=DEEPSPEED_HOST_BUFFER_FACTOR,
        )
    return RankStates(
        params,
        scale,
        opt,
        tmp,
        grad_buffers=buffers,
        host_load=host_load,
        load=load,
        amp_copies=False,
        host_factor=DEEPSPEED_HOST_BUFFER_FACTOR,
    )


def zero3_gathered_bytes(c: Ctx) -> int:
    """The largest layer gathered: DeepSpeed's ``largest_layer_memory = 4 * largest_layer_params``."""
    return DS_LARGEST_LAYER_BYTES * units(c).largest_layer


def zero3(c: Ctx, t: SingleTerms) -> RankStates:
    """DeepSpeed ZeRO-3: (b_c + 4 + 4 + K)Ψ/N (estimator 18Ψ/N for bf16 AdamW; measured 16Ψ/N steady, §3) + the
    largest layer gathered + the reduce bucket (allocated at init, measured) and the prefetch bucket (b_c)."""
    N, bc = c.plan.world_size, _compute_bytes(c)
    params = gathered_unit_bytes(c, _numel(c), t.parameters) // N
    grads = FP32 * trainable_numel(c) // N
    opt = zero_optimizer_bytes(c, t) // N
    tmp = t.step_temporaries * FP32 // param_bytes_per_trainable(c) // N
    bucket = zero_bucket_elems(c)
    gathered = zero3_gathered_bytes(c) + int(PREFETCH_FRACTION * bucket) * bc
    phases = ("forward", "backward", "optimizer-step")
    gathered_by = {"forward": gathered, "backward": gathered, "optimizer-step": 0}
    buffers = {p: bucket * bc for p in phases}
    scale = grads / t.gradients if t.gradients else 0.0
    host_load = FP32 * units(c).largest_layer  # zero.Init: one layer at a time (estimator, zero_init=1)
    load = (0 if c.plan.offload_params else params) + zero3_gathered_bytes(c)  # zero.Init: partitions + one layer
    kw = dict(host_load=host_load, load=load, amp_copies=False, host_factor=DEEPSPEED_HOST_BUFFER_FACTOR)
    if c.plan.offload_params:
        return RankStates(0, 0.0, 0, 0, gathered_by, buffers, host=params + grads + opt, **kw)
    if c.plan.offload_optimizer:
        return RankStates(params, 0.0, 0, 0, gathered_by, buffers, host=grads + opt, **kw)
    return RankStates(params, scale, opt, tmp, gathered_by, buffers, **kw)


def _numel(c: Ctx) -> int:
    """Ψ: every parameter, LoRA adapters included."""
    s = c.sums
    return s.linear_numel + s.head_numel + s.embed_numel + s.other_numel + c.lora_numel


def rank_states(c: Ctx, t: SingleTerms) -> RankStates:
    """The plan's strategy applied to the single-GPU terms ``t``."""
    strategy = c.plan.strategy
    if strategy == "ddp":
        return ddp(c, t)
    if strategy == "fsdp":
        return fsdp(c, t)
    if strategy == "zero2":
        return zero2(c, t)
    if strategy == "zero3":
        return zero3(c, t)
    return RankStates(
        t.parameters, 1.0, t.optimizer_states, t.step_temporaries, host=t.optimizer_host, load=t.parameters
    )


def host_per_node(rs: RankStates, ranks_per_node: int) -> int:
    """Host RAM one node needs for its ranks' offloaded states (the larger of steady state and load), × DeepSpeed's
    buffer factor for ZeRO; 0 when nothing is offloaded."""
    if not rs.host:
        return 0
    return int(rs.host_factor * ranks_per_node * max(rs.host, rs.host_load))


def node_host_bytes(host_per_node: int, plan, ranks_on_node: int | None = None) -> int:
    """Host RAM one node needs: a breakdown's ``host_per_node`` (every rank on one node) scaled to the
    ``ranks_on_node`` that share it (default: every rank). The one host-RAM rule of tune and train."""
    ranks = min(ranks_on_node or plan.world_size, plan.world_size)
    return host_per_node * ranks // plan.world_size


def notes(c: Ctx) -> list[str]:
    """Caveats of the per-rank pricing that apply to the plan."""
    p = c.plan
    if p.strategy == "single":
        return []
    out = [f"per rank of {p.world_size} ({p.strategy}); activations of the per-rank micro-batch"]
    if p.strategy == "ddp":
        out.append(
            "ddp: a full replica per rank + gradient buckets as large as the gradients (kept from "
            "construction on); from_pretrained puts a full copy on every rank"
        )
    elif p.strategy == "fsdp":
        S = p.shards
        group = f"HSDP: sharded over {S} ranks, replicated {p.world_size // S}x" if S < p.world_size else f"/ {S}"
        out.append(
            f"fsdp: weights, gradients and optimizer states {group}; the root unit (embedding, head) stays "
            "gathered through the forward, plus the computing and the prefetched block"
            + (
                "; reshard_after_forward false keeps every unit gathered until its backward"
                if not p.reshard_after_forward
                else ""
            )
        )
        out.append(
            "fsdp: oomdoctor train builds the model on the meta device and materializes the shards only "
            "(no full copy per rank at load)"
        )
        if p.world_size == 1:
            out.append("fsdp on one GPU still gathers every unit into a separate buffer (one more copy of the root)")
    else:
        out.append(
            f"{p.strategy}: DeepSpeed priced by formula (its estimator's terms) + buckets of "
            f"{zero_bucket_elems(c):,} elements (bucket_size; Hugging Face 'auto' = hidden^2)"
        )
    if p.offload_params or p.offload_optimizer:
        out.append(
            "host RAM per node assumes every rank on one node"
            + (" and includes DeepSpeed's 1.5 buffer factor" if p.strategy in DEEPSPEED else "")
        )
    if c.mixed and p.strategy in DEEPSPEED:
        out.append(
            "activations priced as the autocast step (an upper bound: DeepSpeed's bf16 model makes the "
            "residual stream bf16)"
        )
    if c.device == "cuda" and p.world_size > 1:
        out.append(f"NCCL buffers: {format_bytes(NCCL_BUFFER_BYTES)} per rank, a CUDA assumption (calibrate on GPUs)")
    return out


@dataclass(frozen=True)
class DeepSpeedView:
    """DeepSpeed's "model states" estimate (params + grads + optimizer only; no activations, buckets, logits)."""

    per_gpu: int
    per_cpu: int
    """Host RAM per node: ranks per node × the larger of the load copy and the offloaded states, × 1.5."""


def deepspeed_view(c: Ctx, gpus_per_node: int | None = None) -> DeepSpeedView:
    """What ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs`` print for the plan,
    computed from the terms above (§3: ZeRO-2 GPU 2Ψ + 18Ψ/N, offload 2Ψ; ZeRO-3 4L + 18Ψ/N, offload optimizer
    4L + 2Ψ/N, offload both 4L; CPU × 1.5)."""
    t = single_terms(c)
    rs = rank_states(c, t)
    gpu = rs.parameters + int(rs.grad_scale * t.gradients) + rs.optimizer_states
    if c.plan.strategy == "zero3":
        gpu += zero3_gathered_bytes(c)
    g = gpus_per_node or c.plan.world_size
    return DeepSpeedView(per_gpu=gpu, per_cpu=int(rs.host_factor * g * max(rs.host, rs.host_load)))


__all__ = [
    "DEEPSPEED_HOST_BUFFER_FACTOR",
    "DeepSpeedView",
    "RankStates",
    "SingleTerms",
    "Units",
    "deepspeed_view",
    "host_per_node",
    "notes",
    "rank_states",
    "single_terms",
    "units",
]
