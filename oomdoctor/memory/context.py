"""Quantities every analytic component needs, derived once from (ModelSpec, Plan): dtypes, token counts, which
modules are quantized, trainable or LoRA-adapted. Pure Python (no torch import).

The dtypes follow what the real Hugging Face step allocates (transformers 5.x, peft 0.21, bitsandbytes 0.50,
torch 2.13), which the ``simulate`` engine replays:

* the model is built in the plan's weight dtype: fp32 for ``fp32`` and ``*-mixed`` (the fp32 weights are AMP's
  master copy), bf16 for pure ``bf16``;
* matmuls run in the compute dtype (autocast for ``*-mixed``); under autocast the residual stream stays fp32,
  because the embedding output is fp32 and ``residual + bf16_out`` promotes to fp32 (and so do RMSNorm outputs:
  ``fp32_weight * y``), see transformers ``models/llama/modeling_llama.py``;
* LoRA adapters are fp32 whatever the base dtype: ``get_peft_model(..., autocast_adapter_dtype=True)`` (the
  default) upcasts fp16/bf16 adapter weights to fp32 (peft ``tuners/tuners_utils.py``), and peft's LoRA
  ``Linear.forward`` casts the input to the adapter dtype (``_cast_input_dtype``), a per-module fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from oomdoctor.errors import BadInput
from oomdoctor.plan import Plan
from oomdoctor.model.spec import ModelSpec, ParamGroup

#: Bytes of one dropout mask element: torch's fused ``native_dropout`` (CUDA) keeps a bool mask; the CPU path
#: (``_dropout_impl``: ``input * bernoulli_noise``) keeps the noise in the input dtype.
CUDA_DROPOUT_MASK_BYTES = 1
#: The CPU path's noise element for LoRA dropout: the adapter input dtype, fp32 (peft upcasts adapters to fp32).
CPU_LORA_DROPOUT_NOISE_BYTES = 4

#: HEAD module names (never quantized by bitsandbytes, never in peft's ``all-linear``).
HEAD_NAMES = ("lm_head", "score", "classifier")


@dataclass(frozen=True)
class SpecSums:
    """Per-spec sums cached across plans (``diagnose`` prices ~200 plans of one model)."""

    linear_numel: int
    """Weights of every linear except the head (what bitsandbytes quantizes)."""
    head_numel: int
    """Output head weights (0 when tied to the embedding)."""
    embed_numel: int
    other_numel: int
    """Norms, biases of quantized linears, other small parameters."""
    per_layer_numel: int
    """Parameters of one transformer block (all per-layer groups / num_layers)."""
    max_tensor_numel: int
    """Largest single parameter tensor (optimizer per-tensor temporaries)."""
    n_tensors: int
    """Number of parameter tensors (weights + biases)."""
    hidden_norms_per_layer: int
    """Norms over the hidden size in one block (2 for Llama, 4 for Gemma2, 1 for parallel blocks)."""
    head_dim_norms_per_layer: int
    """Per-head q/k norms in one block (Qwen3)."""


@lru_cache(maxsize=256)
def spec_sums(spec: ModelSpec) -> SpecSums:
    lin = head = emb = other = per_layer = 0
    max_t = 0
    n_t = 0
    hidden_norms = head_norms = 0
    L = max(spec.num_layers, 1)
    for g in spec.groups:
        if g.kind == "linear":
            if g.name in HEAD_NAMES:
                head += g.weight_numel * g.count
            else:
                lin += g.weight_numel * g.count
            other += g.bias_numel * g.count
            n_t += g.count * (2 if g.bias else 1)
        elif g.kind == "embedding":
            emb += g.weight_numel * g.count
            n_t += g.count
        else:
            other += g.numel_each * g.count
            n_t += g.count
            if g.kind == "norm" and g.per_layer:
                per = g.count / L
                if g.numel_each in (spec.hidden_size, 2 * spec.hidden_size):
                    hidden_norms += per
                else:
                    head_norms += per
        max_t = max(max_t, g.weight_numel)
        if g.per_layer:
            per_layer += g.total_numel
    per_layer_numel = per_layer // L
    return SpecSums(
        linear_numel=lin,
        head_numel=head,
        embed_numel=emb,
        other_numel=other,
        per_layer_numel=per_layer_numel,
        max_tensor_numel=max_t,
        n_tensors=n_t,
        hidden_norms_per_layer=max(int(round(hidden_norms)), 0),
        head_dim_norms_per_layer=int(round(head_norms)),
    )


def lora_targets_match(name: str, targets: tuple[str, ...]) -> bool:
    """peft ``target_modules`` matching by module-name suffix; ``all-linear`` = every linear but the head."""
    if "all-linear" in targets:
        return name not in HEAD_NAMES
    return name in targets


def check_plan_for_model(spec: ModelSpec, plan: Plan) -> None:
    """Refuse what cannot run on this model: the chunked loss on a model that is not a decoder-only causal LM, and
    LoRA targets that adapt nothing (peft raises on them too)."""
    if plan.loss == "chunked" and spec.arch_kind != "decoder":
        raise BadInput(f"loss chunked: {spec.name} is not a decoder-only causal LM ({spec.arch_kind})",
                       "use the standard loss")
    check_lora_targets(spec, plan)


def check_lora_targets(spec: ModelSpec, plan: Plan) -> None:
    """Refuse LoRA targets that adapt nothing (peft raises on them too): BadInput listing the model's linears."""
    if not plan.uses_lora or plan.lora_on_head:
        return
    names = sorted({g.name for g in spec.groups if g.kind == "linear"})
    if not any(lora_targets_match(n, plan.lora_targets) for n in names):
        raise BadInput(f"LoRA targets {','.join(plan.lora_targets)} match no linear module of {spec.name}",
                       f"use all-linear or some of: {', '.join(names)}")


@dataclass(frozen=True)
class Ctx:
    """Derived view of one (spec, plan) pair."""

    spec: ModelSpec
    plan: Plan
    device: str
    """``cuda`` (what the estimate is for) or ``cpu`` (used by the CPU-vs-analytic tests: dropout masks differ)."""
    sums: SpecSums
    wb: int
    """Stored bytes per element of unquantized weights (4 fp32/mixed, 2 pure bf16)."""
    ab: int
    """Bytes per element of matmul outputs (compute dtype)."""
    rb: int
    """Bytes per element of the residual stream (fp32 under autocast, else the compute dtype)."""
    T: int
    """Tokens per micro-batch."""
    B: int
    S: int
    full: bool
    """Full fine-tune (every weight trains)."""
    lora_groups: tuple[ParamGroup, ...]
    """Linear groups carrying a LoRA adapter."""
    lora_numel: int
    mask_b: int
    """Bytes of one dropout-mask element on this device."""
    quant: str | None

    @property
    def mixed(self) -> bool:
        return self.plan.is_mixed

    @property
    def gathered_in_compute_dtype(self) -> bool:
        """FSDP2 with a ``*-mixed`` plan: every weight, adapters included, is gathered in the compute dtype
        (``MixedPrecisionPolicy(param_dtype)``, execute/shard.py), so the step computes like a pure low-precision
        model: a bf16 residual stream, no autocast weight casts, no per-adapter input casts."""
        return self.plan.strategy == "fsdp" and self.plan.is_mixed

    def is_adapted(self, name: str) -> bool:
        return any(g.name == name for g in self.lora_groups)


def make_ctx(spec: ModelSpec, plan: Plan, device: str = "cuda") -> Ctx:
    sums = spec_sums(spec)
    wb = plan.weight_dtype_bytes
    ab = 4 if plan.precision == "fp32" else 2
    rb = 4 if plan.precision in ("fp32", "fp16-mixed", "bf16-mixed") else 2
    if plan.strategy == "fsdp" and plan.is_mixed:  # Ctx.gathered_in_compute_dtype
        rb = ab
    if plan.quant is not None and plan.precision == "bf16":
        # peft's prepare_model_for_kbit_training (which the executor applies, as QLoRA recipes do) upcasts every
        # non-quantized fp16/bf16 parameter to fp32 (peft utils/other.py): embeddings, norms, head and biases are
        # fp32, so the residual stream and every activation after them are fp32 too; only the 4-bit matmuls
        # compute in bf16 internally. Measured on CPU: the same bytes as the fp32 QLoRA plan.
        wb = ab = rb = 4
    lora_groups: tuple[ParamGroup, ...] = ()
    lora_numel = 0
    if plan.uses_lora:
        lg = []
        for g in spec.groups:
            if g.kind != "linear":
                continue
            if g.name in HEAD_NAMES:
                if not plan.lora_on_head:
                    continue
            elif not lora_targets_match(g.name, plan.lora_targets):
                continue
            lg.append(g)
            # peft LoRA Linear: lora_A (r x in) + lora_B (out x r), no bias (Hu et al. 2021, peft tuners/lora/layer.py)
            lora_numel += plan.lora_r * (g.in_features + g.out_features) * g.count
        lora_groups = tuple(lg)
    return Ctx(
        spec=spec,
        plan=plan,
        device=device,
        sums=sums,
        wb=wb,
        ab=ab,
        rb=rb,
        T=plan.micro_batch * plan.seq_len,
        B=plan.micro_batch,
        S=plan.seq_len,
        full=plan.method == "full",
        lora_groups=lora_groups,
        lora_numel=lora_numel,
        mask_b=CUDA_DROPOUT_MASK_BYTES if device == "cuda" else CPU_LORA_DROPOUT_NOISE_BYTES,
        quant=plan.quant if plan.method == "qlora" else None,
    )
