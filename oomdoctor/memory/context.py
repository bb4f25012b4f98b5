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
from oomdoctor.model.spec import HEAD_NAMES, ModelSpec, ParamGroup

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


def lora_targets_match(name: str, targets: tuple[str, ...]) -> bool:
    """peft ``target_modules`` matching by module-name suffix; ``all-linear`` = every linear but the head."""
    if "all-linear" in targets:
        return name not in HEAD_NAMES
    return name in targets


def experts_implementation(plan: Plan) -> str:
    """transformers' MoE experts kernel the executor picks for the plan (``execute/build.experts_kwargs``; ignored by
    dense models): its default ``grouped_mm`` where the expert weights are bf16, else ``eager`` (one matmul per
    expert). torch's grouped matmul takes bf16 only on CUDA (``aten/src/ATen/native/cuda/Blas.cpp``, mirrored by its
    meta kernel), so fp32 master weights (``fp32``, ``*-mixed``) and QLoRA's fp32-upcast experts
    (``prepare_model_for_kbit_training``; with ``kbit_upcast: false`` they stay bf16) fail there with "Expected inputs of BF16 type": the eager experts are what
    runs, on a GPU and in the replay alike."""
    return "grouped_mm" if plan.precision == "bf16" and not plan.upcasts_kbit else "eager"


#: peft 0.21 ``utils/transformers_weight_conversion.py`` ``_MOE_TARGET_MODULE_MAPPING``: per conversion pattern,
#: the (transformers v4) target names peft moves to ``target_parameters`` -> the v5 parameter they adapt.
PEFT_MOE_TARGETS: dict[str, dict[str, str]] = {
    "mixtral": {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                  "down_proj": "down_proj"},
}
#: Module class recorded on the synthetic groups of :func:`lora_groups_of` that stand for a ``ParamWrapper``.
PARAM_WRAPPER = "ParamWrapper"


_MAMBA_MIXER = frozenset({"out_proj", "conv1d"})
#: Linear modules peft cannot adapt with LoRA, by model type, also when they come from the string ``all-linear``:
#: the Mamba mixers' ``out_proj``/``conv1d`` (peft 0.21 ``tuners/tuners_utils._check_lora_target_modules_mamba``
#: raises); Llama 4's ``router``, an nn.Linear subclass returning a tuple, which peft's LoRA forward cannot add to
#: (``'tuple' object has no attribute 'dtype'``, found replaying it).
PEFT_LORA_REFUSED: dict[str, frozenset[str]] = {
    **dict.fromkeys(("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"), _MAMBA_MIXER),
    **dict.fromkeys(("llama4", "llama4_text"), frozenset({"router"})),
}


def lora_refused_names(model_type: str) -> frozenset[str]:
    """Module names peft cannot adapt with LoRA on ``model_type`` (:data:`PEFT_LORA_REFUSED`): the executor's
    ``all-linear`` leaves them out, explicit targets naming them are refused."""
    return PEFT_LORA_REFUSED.get(model_type, frozenset())


def all_linear_string(plan: Plan, model_type: str) -> bool:
    """Whether peft gets the string ``all-linear`` (it resolves it, MoE conversion included): the plan targets
    all-linear alone, not the head, on a model where peft adapts every linear."""
    return plan.lora_targets == ("all-linear",) and not plan.lora_on_head and not lora_refused_names(model_type)


def all_linear_names(spec: ModelSpec) -> set[str]:
    """Leaf names of the linears peft's ``all-linear`` adapts on ``spec`` as the executor runs it: every linear but
    the head, the towers' (frozen, kept out by ``exclude_modules``) and those peft refuses."""
    refused = lora_refused_names(spec.model_type)
    return {g.name for g in spec.groups
            if g.kind == "linear" and not g.tower and g.name not in HEAD_NAMES and g.name not in refused}


def executor_targets(spec: ModelSpec, plan: Plan) -> set[str] | None:
    """The target names the executor hands peft (``execute/build.lora_targets_of_model``; ``tune --emit`` writes the
    same): None for the string ``all-linear`` (:func:`all_linear_string`), else the explicit leaf names
    (all-linear expanded to every non-head linear peft adapts, the head added with ``lora_on_head``)."""
    if all_linear_string(plan, spec.model_type):
        return None
    names = {t for t in plan.lora_targets if t != "all-linear"}
    if "all-linear" in plan.lora_targets:
        names |= all_linear_names(spec)
    if plan.lora_on_head:
        names |= {g.name for g in spec.groups if g.kind == "linear" and g.name in HEAD_NAMES} or {"lm_head"}
    return names


def lora_groups_of(spec: ModelSpec, plan: Plan) -> tuple[ParamGroup, ...]:
    """The groups peft 0.21 puts a LoRA adapter on, as ``get_peft_model`` resolves the executor's targets.

    Dense models: the matching linear groups. On a model with ``spec.peft_moe_conversion`` peft first converts the
    targets (``_convert_peft_config_moe``): a string ``all-linear`` resolves to every non-head linear leaf name plus
    the conversion's v4 names; those names then leave ``target_modules`` (an nn.Linear named ``gate_proj`` —
    DeepSeek's dense layers, shared experts — gets no adapter) and become ``target_parameters``, each wrapped by a
    ``ParamWrapper`` (peft ``tuners/lora/layer.py``) whose factors are per expert, stacked:

    * router ``gate.weight`` (E, h): lora_A (r, h), lora_B (E, r);
    * ``gate_up_proj`` (E, 2I, h), rank 2r and alpha x2 (``rank_pattern``/``alpha_pattern``, two fused names):
      lora_A (2r·E, h), lora_B (2I, 2r·E);
    * ``down_proj`` (E, h, I): lora_A (r·E, I), lora_B (h, r·E).

    Each becomes a synthetic ``linear`` group (``module`` :data:`PARAM_WRAPPER`, ``name`` its parameter path's last
    two parts) whose r·(in+out) is the adapter's trainable count and r·in / out·r the element counts of lora_A /
    lora_B."""
    names = executor_targets(spec, plan)
    conv = PEFT_MOE_TARGETS.get(spec.peft_moe_conversion, {})
    if names is None:
        names = all_linear_names(spec)
        if conv:
            names |= set(conv)
    params = {conv[n] for n in names if n in conv}
    modules = names - set(conv)
    out = [g for g in spec.groups if g.kind == "linear" and not g.tower and g.name in modules
           and (plan.lora_on_head or g.name not in HEAD_NAMES)]
    E, h = max(spec.num_experts, 1), spec.hidden_size
    for g in spec.groups:
        if g.kind == "linear" or not params:
            continue
        path = g.path or g.name
        if "gate.weight" in params and path.endswith(".gate") and g.numel_each == E * h:
            io = (h, E)
        elif "gate_up_proj" in params and path.endswith("experts.gate_up_proj"):
            io = (2 * E * h, 2 * g.numel_each // h)  # out = 2E·2I
        elif "down_proj" in params and path.endswith("experts.down_proj"):
            io = (g.numel_each // h, E * h)  # in = E·I
        else:
            continue
        out.append(ParamGroup(name=".".join(path.split(".")[-2:]), kind="linear", in_features=io[0],
                              out_features=io[1], count=g.count, per_layer=g.per_layer, path=path,
                              module=PARAM_WRAPPER))
    return tuple(out)


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
        raise BadInput(f"loss chunked: {spec.name} is not a decoder-only causal LM ({spec.arch_kind})",
                       "use the standard loss")
    why = tiled_mlp_refusal(spec) if plan.tiled_mlp else None
    if why:
        raise BadInput(f"tiled_mlp: {spec.name} is {why}; tiling applies to dense decoder MLPs",
                       "drop tiled_mlp (--no-tiled-mlp / tiled_mlp: false)")
    check_lora_targets(spec, plan)
    check_param_wrapper(spec, plan)


def check_param_wrapper(spec: ModelSpec, plan: Plan) -> None:
    """Refuse what peft refuses on adapters of raw parameters (:func:`lora_groups_of`): ``ParamWrapper`` raises
    with ``lora_dropout != 0`` (peft 0.21 ``tuners/lora/layer.py``), and ``_convert_peft_config_moe`` raises when
    only one of two names fused into one parameter is targeted (``gate_proj`` without ``up_proj``)."""
    if not plan.uses_lora or not spec.peft_moe_conversion:
        return
    names = executor_targets(spec, plan) or set()
    conv = PEFT_MOE_TARGETS[spec.peft_moe_conversion]
    fused = sorted(n for n, p in conv.items() if p == "gate_up_proj")
    if 0 < len(names & set(fused)) < len(fused):
        raise BadInput(f"LoRA targets of {spec.name}: {' and '.join(fused)} are fused into one expert parameter "
                       "(gate_up_proj); peft cannot adapt one without the other",
                       f"target both {' and '.join(fused)}, or neither")
    if plan.lora_dropout and any(g.module == PARAM_WRAPPER for g in lora_groups_of(spec, plan)):
        raise BadInput(f"lora_dropout {plan.lora_dropout:g}: on {spec.name} the LoRA targets include MoE router/expert "
                       "parameters, which peft adapts with a ParamWrapper that does not support dropout",
                       "set lora_dropout: 0, or target attention only "
                       "(--lora-targets / target_modules: q_proj,k_proj,v_proj,o_proj)")


def check_lora_targets(spec: ModelSpec, plan: Plan) -> None:
    """Refuse LoRA targets that adapt nothing (peft raises on them too): BadInput listing the model's linears."""
    if not plan.uses_lora:
        return
    refused = sorted(lora_refused_names(spec.model_type) & set(plan.lora_targets))
    if refused:
        raise BadInput(f"LoRA targets {','.join(refused)}: peft cannot adapt them in {spec.model_type} models",
                       "leave them out; all-linear adapts every other linear")
    if plan.lora_on_head:
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


def runs_autocast(plan: Plan) -> bool:
    """Whether the forward runs under autocast: ``*-mixed`` plans, and pure bf16 under any trainer but oomdoctor's own
    (their file says ``bf16: true`` / ``mixed_precision: bf16``, and accelerate autocasts the forward whatever the
    weights' dtype: ``execute/trainers/common.precision``; accelerate 1.15 ``Accelerator.prepare_model``) — bf16
    weights need no cast, but fp32 LoRA adapters are cast (and cached) and their matmuls run in bf16."""
    return plan.is_mixed or (plan.precision == "bf16" and plan.trainer != "oomdoctor")


def adapter_numel(plan: Plan, groups) -> int:
    """LoRA parameters on ``groups``: lora_A (r x in) + lora_B (out x r) per module, no bias (Hu et al. 2021, peft
    tuners/lora/layer.py)."""
    return sum(plan.lora_r * (g.in_features + g.out_features) * g.count for g in groups)


def upcast_changes_bytes(plan: Plan) -> bool:
    """Whether ``kbit_upcast`` changes any byte of ``plan``: a quantized base whose unquantized weights load in 16
    bits (pure ``bf16``); ``fp32`` and ``*-mixed`` load them in fp32, where peft's cast is a no-op."""
    return plan.quant is not None and plan.precision == "bf16"


def upcast_to_fp32(plan: Plan) -> bool:
    """Whether peft's k-bit preparation makes the quantized base's unquantized weights (embeddings, norms, head,
    biases) fp32 where they were loaded in 16 bits (``Plan.upcasts_kbit`` and :func:`upcast_changes_bytes`)."""
    return plan.upcasts_kbit and upcast_changes_bytes(plan)


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
