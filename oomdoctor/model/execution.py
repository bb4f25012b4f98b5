"""What the executor runs for a plan on a model, decided once for the executor (``execute/``) and the pricing
(``memory/``): the MoE experts kernel, whether the forward runs under autocast, whether peft's k-bit preparation
upcasts, the tiled MLP's tiles and where it applies, and what cannot run on a model at all. Pure Python.
"""

from __future__ import annotations

from oomdoctor.errors import BadInput
from oomdoctor.model.lora_targets import check_lora_targets, check_param_wrapper
from oomdoctor.model.spec import ModelSpec
from oomdoctor.plan import Plan


def experts_implementation(plan: Plan) -> str:
    """transformers' MoE experts kernel the executor picks for the plan (``execute/build.experts_kwargs``; ignored by
    dense models): its default ``grouped_mm`` where the expert weights are bf16, else ``eager`` (one matmul per
    expert). torch's grouped matmul takes bf16 only on CUDA (``aten/src/ATen/native/cuda/Blas.cpp``, mirrored by its
    meta kernel), so fp32 master weights (``fp32``, ``*-mixed``) and QLoRA's fp32-upcast experts
    (``prepare_model_for_kbit_training``; with ``kbit_upcast: false`` they stay bf16) fail there with "Expected
    inputs of BF16 type": the eager experts are what runs, on a GPU and in the replay alike."""
    return "grouped_mm" if plan.precision == "bf16" and not plan.upcasts_kbit else "eager"


def runs_autocast(plan: Plan) -> bool:
    """Whether the forward runs under autocast: ``*-mixed`` plans, and pure bf16 under any trainer but oomdoctor's own
    (their file says ``bf16: true`` / ``mixed_precision: bf16``, and accelerate autocasts the forward whatever the
    weights' dtype: ``execute/trainers/common.precision``; accelerate 1.15 ``Accelerator.prepare_model``) — bf16
    weights need no cast, but fp32 LoRA adapters are cast (and cached) and their matmuls run in bf16."""
    return plan.is_mixed or (plan.precision == "bf16" and plan.trainer != "oomdoctor")


def upcast_changes_bytes(plan: Plan) -> bool:
    """Whether ``kbit_upcast`` changes any byte of ``plan``: a quantized base whose unquantized weights load in 16
    bits (pure ``bf16``); ``fp32`` and ``*-mixed`` load them in fp32, where peft's cast is a no-op."""
    return plan.quant is not None and plan.precision == "bf16"


def upcast_to_fp32(plan: Plan) -> bool:
    """Whether peft's k-bit preparation makes the quantized base's unquantized weights (embeddings, norms, head,
    biases) fp32 where they were loaded in 16 bits (``Plan.upcasts_kbit`` and :func:`upcast_changes_bytes`)."""
    return plan.upcasts_kbit and upcast_changes_bytes(plan)


def num_tiles(tokens: int, hidden: int) -> int:
    """Tiles of one tiled-MLP call over ``tokens`` tokens (batch x sequence): ``ceil(tokens / hidden)``, at least
    1 — DeepSpeed's ``TiledMLP`` rule (a tile's intermediates about the size of one MLP weight). What
    ``execute/tiled`` runs and the memory model prices."""
    return max(1, -(-tokens // max(hidden, 1)))


#: A tiled MLP is searched (tune) and advised (diagnose) when a micro-batch holds at least this many times the hidden
#: size in tokens: below, a tile is most of the sequence, and the recompute costs more than the tiles save.
TILED_MIN_TOKENS_PER_HIDDEN = 8


def tiled_mlp_refusal(spec: ModelSpec) -> str | None:
    """Why ``spec`` cannot run a tiled MLP (None: it can): tiling applies to dense decoder MLPs."""
    if spec.num_experts:
        return "a mixture of experts (its router balances load over the whole batch)"
    if spec.arch_kind != "decoder":
        return f"not a decoder-only causal LM ({spec.arch_kind})"
    return None


def tiling_applies(spec: ModelSpec, tokens: int) -> bool:
    """Whether a tiled MLP (``execute/tiled``) is worth offering: a model that runs one (:func:`tiled_mlp_refusal`)
    and ``tokens`` per micro-batch at least :data:`TILED_MIN_TOKENS_PER_HIDDEN` x the hidden size. What else a plan
    must be for it (one GPU, no optimizer in backward) is ``plan.validate``'s."""
    return tiled_mlp_refusal(spec) is None and tokens >= TILED_MIN_TOKENS_PER_HIDDEN * spec.hidden_size


def check_plan_for_model(spec: ModelSpec, plan: Plan) -> None:
    """Refuse what cannot run on this model: the chunked loss on a model that is not a decoder-only causal LM, the
    tiled MLP where there is no dense decoder MLP, and LoRA targets that adapt nothing (peft raises on them too)."""
    if plan.loss == "chunked" and spec.arch_kind != "decoder":
        raise BadInput(
            f"loss chunked: {spec.name} is not a decoder-only causal LM ({spec.arch_kind})", "use the standard loss"
        )
    why = tiled_mlp_refusal(spec) if plan.tiled_mlp else None
    if why:
        raise BadInput(
            f"tiled_mlp: {spec.name} is {why}; tiling applies to dense decoder MLPs",
            "drop tiled_mlp (--no-tiled-mlp / tiled_mlp: false)",
        )
    check_lora_targets(spec, plan)
    check_param_wrapper(spec, plan)
