"""Optimizer states and the optimizer step's temporaries.

Sources: ZeRO paper (Rajbhandari et al. 2020) §3.1 (Adam keeps 2 states per parameter); torch ``optim/adam.py``
(``_multi_tensor_adam`` / ``_fused_adam``), bitsandbytes ``optim/optimizer.py`` (``Optimizer2State.init_state``,
``get_state_buffer``), Dettmers et al. 2021 "8-bit Optimizers via Block-wise Quantization" (arXiv 2110.02861),
transformers ``optimization.Adafactor`` (Shazeer & Stern 2018, arXiv 1804.04235), Lion (Chen et al. 2023,
arXiv 2302.06675; bitsandbytes ``Lion`` 32-bit: one state).

States are created lazily at the first ``step()``; steady state (from step 2) keeps them through forward and
backward, so ``analytic.py`` prices them in every phase.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.memory.context import Ctx
from oomdoctor.memory.gradients import param_bytes_per_trainable

#: bitsandbytes blockwise 8-bit optimizer: one fp32 absmax per 256 values (``Optimizer2State.init_state``).
BNB_8BIT_BLOCKSIZE = 256
#: bitsandbytes keeps 32-bit states for tensors smaller than this (``min_8bit_size`` default).
BNB_MIN_8BIT_SIZE = 4096
#: bitsandbytes pages only state buffers of at least this many elements (``get_state_buffer``: ``p.numel() < 1e5``
#: gets a regular device tensor).
BNB_MIN_PAGED_NUMEL = 100_000
#: torch fused/capturable Adam keeps a fp32 ``step`` tensor per parameter on the device (CPU otherwise).
STEP_TENSOR_BYTES = 4


@dataclass(frozen=True)
class OptimizerMemory:
    """Optimizer memory split by where it lives."""

    device: int
    """States allocated by PyTorch's caching allocator on the GPU."""
    paged: int
    """bitsandbytes paged states (CUDA unified memory, outside PyTorch's allocator)."""
    cpu: int
    """States on the host (``offload_optimizer``)."""
    temporaries: int
    """Peak transient bytes inside ``optimizer.step()`` on the GPU."""


#: Trainers built on transformers' ``Trainer``, whose ``create_optimizer`` registers a 32-bit bitsandbytes state
#: override for every ``nn.Embedding`` weight when the optimizer is 8-bit (transformers 5.24 ``trainer.py``
#: ``create_optimizer``: ``manager.register_module_override(module, "weight", {"optim_bits": 32})``).
HF_TRAINER_BASED: tuple[str, ...] = ("trl", "hf", "axolotl")


def trainable_tensors(c: Ctx) -> list[tuple[int, int, int]]:
    """(numel, rows, count) of every trainable tensor kind; rows = first dim for 2-D tensors, 0 for 1-D."""
    return [(n, rows, k) for n, rows, k, _emb in _trainable(c)]


def _trainable(c: Ctx) -> list[tuple[int, int, int, bool]]:
    """:func:`trainable_tensors` with whether the tensor is an embedding's weight."""
    out: list[tuple[int, int, int, bool]] = []
    if c.full:
        for g in c.spec.groups:
            if g.tower:
                continue
            if g.kind in ("linear", "embedding"):
                rows = g.out_features if g.kind == "linear" else g.in_features
                out.append((g.weight_numel, rows, g.count, g.kind == "embedding"))
                if g.bias_numel:
                    out.append((g.bias_numel, 0, g.count, False))
            else:
                out.append((g.numel_each, 0, g.count, False))
    else:
        r = c.plan.lora_r
        for g in c.lora_groups:
            out.append((r * g.in_features, r, g.count, False))  # lora_A: (r, in)
            out.append((g.out_features * r, g.out_features, g.count, False))  # lora_B: (out, r)
    return out


def _bnb_states(c: Ctx, eight_bit: bool, paged: bool, n_states: int) -> tuple[int, int]:
    """(device bytes, paged bytes) of bitsandbytes Optimizer{1,2}State states; under an HF-Trainer-based trainer
    (:data:`HF_TRAINER_BASED`) an embedding's states are 32-bit."""
    dev = pg = 0
    fp32_embeddings = c.plan.trainer in HF_TRAINER_BASED
    for numel, _rows, count, embedding in _trainable(c):
        if eight_bit and numel >= BNB_MIN_8BIT_SIZE and not (embedding and fp32_embeddings):
            state = numel * n_states  # uint8 states
            blocks = -(-numel // BNB_8BIT_BLOCKSIZE)
            dev += blocks * 4 * n_states * count  # absmax1/absmax2: regular device tensors
        else:
            state = numel * 4 * n_states  # 32-bit states are fp32 whatever the param dtype
        if paged and numel >= BNB_MIN_PAGED_NUMEL:
            pg += state * count
        else:
            dev += state * count
    return dev, pg


def optimizer_memory(c: Ctx) -> OptimizerMemory:
    p = c.plan
    pb = param_bytes_per_trainable(c)
    tensors = trainable_tensors(c)
    numel = sum(n * k for n, _r, k in tensors)
    n_tensors = sum(k for _n, _r, k in tensors)
    max_numel = max((n for n, _r, _k in tensors), default=0)
    dev = pg = tmp = 0
    opt = p.optimizer
    if opt == "adamw":
        # torch AdamW: exp_avg + exp_avg_sq, zeros_like(param) -> param dtype.
        dev = 2 * numel * pb
        if p.optimizer_impl == "foreach":
            # _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) is a full copy of the group's second
            # moments (one group per device/dtype, all trainable params share one dtype here); the other
            # _foreach ops are in place. Measured on CPU: exactly 1x trainable bytes.
            tmp = numel * pb
        elif p.optimizer_impl == "fused":
            # _fused_adamw_: one kernel, in place; the per-param step counters live on the device.
            dev += n_tensors * STEP_TENSOR_BYTES
        else:
            # _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps): two param-sized temps at once.
            tmp = 2 * max_numel * pb
    elif opt in ("adamw-8bit", "paged-adamw", "paged-adamw-8bit"):
        dev, pg = _bnb_states(c, eight_bit=opt.endswith("8bit"), paged=opt.startswith("paged"), n_states=2)
    elif opt == "lion":
        # bitsandbytes Lion (HF ``lion_32bit``): Optimizer1State, one fp32 state; fused kernel, no temporaries.
        dev, pg = _bnb_states(c, eight_bit=False, paged=False, n_states=1)
    elif opt == "sgd":
        # torch SGD: momentum_buffer = clone(grad) (param dtype) only when momentum > 0; HF passes no weight
        # decay, so the foreach path allocates no temporaries.
        dev = numel * pb if p.sgd_momentum > 0 else 0
    elif opt == "adafactor":
        # transformers Adafactor (HF optim="adafactor", beta1=None): factored second moment for >= 2-D tensors,
        # exp_avg_sq_row (rows) + exp_avg_sq_col (cols) in fp32 (``.to(grad)`` after ``grad.float()``); full
        # exp_avg_sq for 1-D tensors. Shazeer & Stern 2018 §3.
        for n, rows, k in tensors:
            if rows:
                dev += (rows + n // rows) * 4 * k
            else:
                dev += n * 4 * k
        # Per-parameter loop: grad.float() and p.float() copies for 16-bit params, update = grad**2 + eps and the
        # factored approximation: about two fp32 param-sized temporaries (+ two copies for 16-bit params).
        tmp = max_numel * 4 * (2 + (2 if pb == 2 else 0))
    cpu = 0
    if p.offload_optimizer:
        # States and the step run on the host (DeepSpeed CPU Adam style); the GPU keeps weights and grads.
        cpu, dev, pg, tmp = dev + pg, 0, 0, 0
    return OptimizerMemory(device=dev, paged=pg, cpu=cpu, temporaries=tmp)
