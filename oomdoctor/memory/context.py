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

from oomdoctor.model.execution import runs_autocast, upcast_to_fp32
from oomdoctor.model.lora_targets import PARAM_WRAPPER, lora_groups_of
from oomdoctor.model.spec import HEAD_NAMES, ModelSpec, ParamGroup
from oomdoctor.plan import Plan

#: Bytes of one dropout mask element: torch's fused ``native_dropout`` (CUDA) keeps a bool mask; the CPU path
#: (``_dropout_impl``: ``input * bernoulli_noise``) keeps the noise in the input dtype.
CUDA_DROPOUT_MASK_BYTES = 1
#: The CPU path's noise element for LoRA dropout: the adapter input dtype, fp32 (peft upcasts adapters to fp32).
CPU_LORA_DROPOUT_NOISE_BYTES = 4


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
    """Query/key norms in one block: per head (Qwen3, width ``head_dim``) or over the whole projection (OLMo 2/3,
    width ``heads * head_dim``, which is the hidden size when the heads span it)."""
    qk_norms_per_head: bool
    """The query/key norms normalize each head (per-head statistics), not the whole projection."""
    tower_numel: int
    """Parameters of a multimodal model's towers (:attr:`ParamGroup.tower`): held, never trained."""
    post_mlp_norm: bool
    """A norm over the MLP's output (``post_feedforward_layernorm``: Gemma 2/3, OLMo 2/3): its backward runs first in
    the block's, every save of the block still alive."""
    post_norms_only: bool
    """Every hidden-size norm of a block follows its sublayer (OLMo 2/3, EXAONE 4: ``post_attention_layernorm`` and
    ``post_feedforward_layernorm`` only; Llama's ``post_attention_layernorm`` is the MLP's pre-norm, next to
    ``input_layernorm``): the attention reads the block input itself."""


#: Query/key norms: read the projections' outputs, never the residual stream, whatever their width (OLMo 2/3
#: normalize over all heads: hidden-sized when the heads span the hidden size).
QK_NORM_NAMES = frozenset({"q_norm", "k_norm"})


@lru_cache(maxsize=256)
def spec_sums(spec: ModelSpec) -> SpecSums:
    lin = head = emb = other = per_layer = tower = 0
    max_t = 0
    n_t = 0
    hidden_norms = head_norms = 0
    hidden_norm_names = set()
    per_head = True
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
                if g.name not in QK_NORM_NAMES and g.numel_each in (spec.hidden_size, 2 * spec.hidden_size):
                    hidden_norms += per
                    hidden_norm_names.add(g.name)
                else:
                    head_norms += per
                    per_head = per_head and g.numel_each == spec.head_dim
        max_t = max(max_t, g.weight_numel)
        tower += g.total_numel if g.tower else 0
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
        qk_norms_per_head=per_head,
        tower_numel=tower,
        post_mlp_norm="post_feedforward_layernorm" in hidden_norm_names,
        post_norms_only=bool(hidden_norm_names) and all(n.startswith("post_") for n in hidden_norm_names),
    )


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
    adapter_b: int
    """Bytes per element of the LoRA adapter weights (and their gradients): 4, or 2 with ``adapter_dtype: bf16``."""
    mask_b: int
    """Bytes of one dropout-mask element on this device."""
    quant: str | None

    @property
    def mixed(self) -> bool:
        """fp32 weights under autocast: ``*-mixed`` plans, and a k-bit-upcast (fp32) base under a foreign trainer's
        bf16 autocast."""
        return self.autocast and self.wb == 4

    @property
    def autocast(self) -> bool:
        """Whether the forward runs under autocast (:func:`runs_autocast`)."""
        return runs_autocast(self.plan)

    @property
    def cast_lora_numel(self) -> int:
        """LoRA weights autocast casts (:attr:`autocast`; cached for the forward: leaves that require grad): every
        fp32 adapter but peft's ``ParamWrapper`` factors, which it merges into W' in the parameter's dtype first (W'
        and its casts are activations); bf16 adapters need no cast. Measured with the simulated engine on
        wide-expert OLMoE/Qwen3-MoE shapes."""
        if self.adapter_b == 2:
            return 0
        return self.lora_numel - adapter_numel(self.plan, [g for g in self.lora_groups if g.module == PARAM_WRAPPER])

    @property
    def gathered_in_compute_dtype(self) -> bool:
        """FSDP2 with a ``*-mixed`` plan: every weight, adapters included, is gathered in the compute dtype
        (``MixedPrecisionPolicy(param_dtype)``, execute/shard.py), so the step computes like a pure low-precision
        model: a bf16 residual stream, no autocast weight casts, no per-adapter input casts."""
        return self.plan.strategy == "fsdp" and self.plan.is_mixed

    def is_adapted(self, name: str) -> bool:
        return any(g.name == name for g in self.lora_groups)


def adapter_numel(plan: Plan, groups) -> int:
    """LoRA parameters on ``groups``: lora_A (r x in) + lora_B (out x r) per module, no bias (Hu et al. 2021, peft
    tuners/lora/layer.py)."""
    return sum(plan.lora_r * (g.in_features + g.out_features) * g.count for g in groups)


def make_ctx(spec: ModelSpec, plan: Plan, device: str = "cuda") -> Ctx:
    sums = spec_sums(spec)
    wb = plan.weight_dtype_bytes
    ab = 4 if plan.precision == "fp32" else 2
    rb = 4 if plan.precision in ("fp32", "fp16-mixed", "bf16-mixed") else 2
    if plan.strategy == "fsdp" and plan.is_mixed:  # Ctx.gathered_in_compute_dtype
        rb = ab
    if upcast_to_fp32(plan):
        # peft's prepare_model_for_kbit_training (which the executor applies, as QLoRA recipes do) upcasts every
        # non-quantized fp16/bf16 parameter to fp32 (peft utils/other.py): embeddings, norms, head and biases are
        # fp32, so the residual stream and every activation after them are fp32 too; only the 4-bit matmuls
        # compute in bf16 internally. Measured on CPU: the same bytes as the fp32 QLoRA plan. Under a foreign
        # trainer's autocast (``bf16: true``) the matmuls run in bf16: priced as the bf16-mixed plan (Ctx.mixed).
        # Without the upcast (kbit_upcast: false) they stay bf16: the pure-bf16 dtypes above.
        wb = rb = 4
        ab = 2 if runs_autocast(plan) else 4
    lora_groups = lora_groups_of(spec, plan) if plan.uses_lora else ()
    lora_numel = adapter_numel(plan, lora_groups)
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
        adapter_b=2 if plan.adapter_dtype == "bf16" else 4,
        mask_b=CUDA_DROPOUT_MASK_BYTES if device == "cuda" else CPU_LORA_DROPOUT_NOISE_BYTES,
        quant=plan.quant if plan.method == "qlora" else None,
    )
