"""Activations: tensors saved for backward by the transformer blocks, per block and in total, with and without
gradient checkpointing, by attention implementation, for full fine-tuning and (Q)LoRA. Here: a block's saves term by
term (:func:`layer_activations`) and the model-level ones (embedding leaf, final norm and head); what one module
saves is ``memory/saves``, a block's forward/backward transients ``memory/transients``, MoE expert terms
``memory/experts``, activation offloading ``memory/offloaded``, masks ``memory/masks``, measured blocks
``memory/measured``; the per-model-type facts they read are ``model/quirks``, the linears' roles ``model/roles``.

Starting point: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198) §4.1, which counts ``sbh(34 + 5as/h)`` bytes per fp16 layer (attention ``11sbh + 5as²b``,
MLP ``19sbh``, norms ``4sbh``). That count is for Megatron's GPT (GeLU MLP, fused kernels, dropout); here every term
is recounted per tensor for what Hugging Face's modeling code actually saves (checked tensor by tensor against a
real CPU step with a TorchDispatchMode, see ``tests/test_analytic_vs_cpu.py``):

* RMSNorm (``LlamaRMSNorm``) upcasts to fp32 and saves the fp32 input (a copy under bf16, the input itself under
  fp32), ``rsqrt`` (4 bytes/token) and, when its weight trains, the normalized ``y`` in the input dtype;
  LayerNorm saves its input plus fp32 mean/rstd.
* A linear saves its input for the weight gradient only when the weight trains; a frozen base linear saves
  nothing (its input gradient needs only the weight). Under autocast each consumer saves its own low-precision
  cast of an fp32 input (casts of non-leaf tensors are not cached).
* peft LoRA per adapted module: the input cast to the fp32 adapter dtype, ``dropout(x)`` (saved by ``lora_A``) +
  the dropout mask (bool on CUDA, 1 byte), and ``lora_A``'s output (r per token, saved by ``lora_B``). Without
  dropout (``nn.Identity``) ``lora_A`` saves the (cast) input itself.
* Rotary: ``q*cos + rotate_half(q)*sin`` saves nothing but produces new q/k (saved by attention).
* SDPA / flash: q, k, v, output and the fp32 logsumexp (B·heads·S); GQA via ``enable_gqa`` keeps k/v at kv-head
  size; the output's ``transpose(1,2).contiguous()`` is a no-op (kernels return B,S,H,D memory).
  Eager: fp32 softmax probabilities (B·heads·S², ``softmax(dtype=float32)``) + their cast to the compute dtype,
  repeated k/v for GQA, and a contiguous copy of the output (+ dropout mask/output when ``attention_dropout > 0``).
* Gated MLP: gate output (saved by SiLU/GeLU), activation and up outputs (saved by the product), the product
  (saved by ``down_proj``); plain MLP: fc1 output (saved by the activation) and the activation (saved by fc2).
* Gradient checkpointing (non-reentrant, transformers' default ``use_reentrant=False``): only each block's input
  is kept; in backward one block at a time is recomputed (early-stopped: its output is not rebuilt).

Known limits: MoE experts are priced as ``experts_per_token`` dense MLPs on every token plus the token gathers
(perfect load balance); T5 cross-attention and encoder/decoder length differences are approximated with one
sequence length; activation functions implemented as several pointwise ops (GPT-2 ``gelu_new`` without a fused
kernel) save more than one tensor and are priced as one; mem-efficient SDPA pads logsumexp to 32 rows (ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.memory.context import Ctx
from oomdoctor.memory.experts import param_wrapped, param_wrapper_weights, routing_weight_bytes
from oomdoctor.memory.logits import fused_head
from oomdoctor.memory.masks import sliding_fraction
from oomdoctor.memory.measured import BlockSaves
from oomdoctor.memory.saves import (
    RMS_STATS_BYTES,
    AttentionSaves,
    MlpSaves,
    attn_saves_output,
    bnb_outputs_fp32,
    consumers_saved,
    hidden_norm_count,
    int8_held_only,
    int8_inputs,
    mab_global,
    norm_saved,
    saves_input_itself,
)
from oomdoctor.memory.transients import backward_extra, forward_transient, mlp_adapter_forward
from oomdoctor.model.execution import experts_implementation
from oomdoctor.model.quirks import (
    EMBEDDINGS_SCALED_IN_FORWARD,
    FP32_ROUTING_WEIGHTS,
    POW_ACTS,
    act_extra_tensors,
    activation_name,
    config_float,
    effective_attn,
)
from oomdoctor.model.roles import LayerRoles, layer_roles
from oomdoctor.model.spec import HEAD_NAMES


@dataclass(frozen=True)
class LayerActs:
    """One block's activation terms (bytes), from the formulas (:func:`layer_activations`) or measured blocks."""

    saved: int
    """Bytes one block saves for backward (its own norm inputs included; its output is counted by the next norm)."""
    stack: int
    """Bytes all blocks save for backward without gradient checkpointing."""
    bottom: int
    """Bytes block 0 saves: less than ``saved`` when its input does not require grad (LoRA, frozen embeddings)."""
    gc_saved: int
    """Bytes one block keeps under gradient checkpointing (its input)."""
    fwd_transient: int
    """Peak bytes a block's forward holds beyond what it saves (with activations offloaded and no checkpointing,
    every save is on the host: all it holds, ``offloaded_mlp_forward``)."""
    bwd_extra: int
    """Peak bytes a block's backward holds beyond its saved tensors (input/output grads, intermediate grads)."""
    down_saved: int
    """Bytes saved by the MLP output linear(s) (freed first in the block's backward)."""
    gc_alias: int = 0
    """Bytes of ``saved`` that are the block input itself (fp32 RMSNorm / LayerNorm save their input): under
    gradient checkpointing the recomputed block shares them with the kept input."""
    gc_extra: int = 0
    """Bytes a block keeps under gradient checkpointing besides its input: LLM.int8()'s ``MatMul8bitLt`` stores
    its inputs as ``ctx.tensors`` attributes, outside the saved-tensor hooks checkpointing relies on (and
    activation offloading: they stay on the device, checkpointed or not)."""
    gc_recompute: int = 0
    """LoRA under gradient checkpointing: bytes beyond ``saved`` at the costliest MLP adapter's forward during block
    0's recompute — the widest MLP-input adapter (its base output, lora_B output and scaled copy — fp32 unless under
    autocast — minus the MLP tensors not yet recomputed) or, under autocast with fp32 adapters, down_proj's (peft's
    fp32 cast of the 16-bit product and the base output, every MLP save alive) — plus the forward's held residual/norm
    output, with the block's output gradient (rb, twice) and its fp32 copy alive, and block 0's first-norm saves back
    (``enable_input_require_grads``: the embedding output requires grad under GC)."""
    bwd_over_gradients: int | None = None
    """Measured blocks: ``bwd_extra`` net of the weight gradients the block makes (the bottom moment counts the
    stack's gradients as made); None where ``bwd_extra`` holds no weight gradient (the formulas)."""


def norms_saved(c: Ctx) -> int:
    """Bytes one block's norms save: those over the hidden size (input: the residual stream, ``rb`` bytes) and the
    q/k norms over q (T x qd) and k (T x kvd), input in the compute dtype; per head (Qwen3) their statistics are per
    head, over the whole projection (OLMo 2) per token."""
    spec, T = c.spec, c.T
    nh, nkv = spec.num_heads, spec.num_kv_heads
    qd, kvd = nh * spec.head_dim, nkv * spec.head_dim
    norms = hidden_norm_count(c) * norm_saved(c, spec.hidden_size, T, c.rb)
    if c.sums.head_dim_norms_per_layer:
        norms += norm_saved(c, qd, T, c.ab) + norm_saved(c, kvd, T, c.ab)
        if c.sums.qk_norms_per_head:
            norms += (nh + nkv - 2) * T * RMS_STATS_BYTES
    return norms


def eager_kernel_saved(c: Ctx, kv_w: float, rep: float) -> float:
    """Bytes eager attention (transformers ``eager_attention_forward``) saves per attention block: q, the repeated
    k/v (copies under GQA), the fp32 softmax output, its cast to the compute dtype (saved by the matmul with v),
    soft-capping's tanh output (Gemma 2), attention dropout's mask and output, and the contiguous output copy a
    trainable output projection saves."""
    spec, T, B, S, ab = c.spec, c.T, c.B, c.S, c.ab
    nh, qd = spec.num_heads, spec.num_heads * spec.head_dim
    inner = ab * T * (qd + kv_w * rep)  # q, repeated k/v (copies when GQA)
    inner += 4 * B * nh * S * S  # fp32 softmax output
    if ab != 4:
        inner += ab * B * nh * S * S  # probs cast back to the compute dtype (saved by matmul with v)
    if spec.config.get("attn_logit_softcapping") is not None:
        inner += ab * B * nh * S * S  # tanh soft-capping keeps its output (Gemma-2 eager_attention_forward)
    p_att = config_float(spec, "attention_dropout", "attention_probs_dropout_prob", "attn_pdrop")
    if p_att > 0:
        inner += (c.mask_b + ab) * B * nh * S * S
    return inner + eager_output_copy(c)


def eager_output_copy(c: Ctx) -> int:
    """The contiguous copy of eager attention's output a trainable output projection saves (outside autocast)."""
    return c.ab * c.T * c.spec.num_heads * c.spec.head_dim if c.full and not c.mixed else 0


def fused_kernel_saved(c: Ctx, roles: LayerRoles, kv_w: float, impl: str) -> float:
    """Bytes SDPA / flash attention saves per attention block: q, k, v, the output and the fp32 logsumexp, plus what
    T5's position bias, sliding-window masks, repeated GQA k/v and a fused qkv keep alive."""
    spec, T, B, S, ab = c.spec, c.T, c.B, c.S, c.ab
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qd, kvd = nh * hd, nkv * hd
    n_att = roles.attn_blocks
    inner = ab * T * (qd + kv_w) + ab * T * qd + 4 * B * nh * S  # q,k,v + out + logsumexp
    if spec.model_type == "t5":
        # T5 hands its relative position bias (1 x heads x S x S) to SDPA as attn_mask: each self-attention
        # saves its own copy (cross-attention: one shared zero bias, in shared_forward_bytes)
        inner += ab * nh * S * S / max(n_att, 1e-9)
    if impl == "sdpa":
        # sliding-window blocks hand SDPA a boolean mask, which it turns into an additive mask in the query's
        # dtype (aten/src/ATen/native/transformers/attention.cpp ``convert_boolean_attn_mask``) that the kernel
        # saves (CUDA: memory-efficient attention, flash takes no mask); with a mask (or head_dim > 256)
        # transformers repeats GQA's k/v to the query heads instead of passing enable_gqa
        # (integrations/sdpa_attention.py ``use_gqa_in_sdpa``): SDPA saves the repeated copies
        masked = sliding_fraction(c)
        inner += masked * ab * B * S * S
        if nkv and nkv < nh:
            inner += (1.0 if hd > 256 else masked) * ab * T * 2 * (qd - kvd)
    if len(roles.attn_in) == 1 and spec.model_type not in ("gpt2", "falcon") and not bnb_outputs_fp32(c, roles.attn_in):
        # fused qkv (Phi-3 qkv_proj): v is a view of the fused output, so SDPA's saved v keeps all of it alive
        # while rotary made new q/k — unless autocast casts v for SDPA: a bitsandbytes qkv under autocast
        # returns fp32 (traced on replayed Phi-3-mini blocks, QLoRA: 25 MB per block at 2k tokens over before)
        inner += ab * T * (qd + kv_w / 2)
    return inner


def attention_saved(c: Ctx, roles: LayerRoles) -> AttentionSaves:
    """What one block's attention saves: its input linears' saves (:func:`consumers_saved` of the norm output), the
    kernel's per attention block (:func:`eager_kernel_saved`, :func:`fused_kernel_saved`) and the output
    projection's, unless the kernel saved that very tensor already (:func:`attn_saves_output`)."""
    spec, T, ab = c.spec, c.T, c.ab
    nh, nkv = spec.num_heads, spec.num_kv_heads
    qd, kvd = nh * spec.head_dim, nkv * spec.head_dim
    n_att = roles.attn_blocks
    att = consumers_saved(c, T, c.rb, roles.attn_in)
    qkv_out = sum(o * m for _n, _i, o, m in roles.attn_in) / max(n_att, 1e-9)  # q+k+v width per attention block
    kv_w = max(qkv_out - qd, 2 * kvd) if qkv_out else qd + 2 * kvd
    impl = effective_attn(spec, c.plan.attn)
    rep = 1.0
    if impl == "eager":
        rep = qd / max(kvd, 1) if nkv and nkv != nh else 1.0
        inner = eager_kernel_saved(c, kv_w, rep)
        out_copy = eager_output_copy(c)
        out_saved_by_attn = False
    else:
        inner = fused_kernel_saved(c, roles, kv_w, impl)
        out_copy = 0
        out_saved_by_attn = attn_saves_output(c)
    att += n_att * inner
    already = out_saved_by_attn or (impl == "eager" and c.full and not c.mixed)  # eager: the copy is in inner
    out_saved = consumers_saved(c, T, ab, roles.attn_out, already_saved=already)
    if impl == "eager" and c.full and c.mixed:
        out_saved += n_att * ab * T * qd  # o_proj saves the bf16 output copy (autocast cast is a no-op on bf16)
    att += out_saved
    return AttentionSaves(att, out_saved, out_copy, kv_w, rep, impl)


def fused_experts_saved(c: Ctx, roles: LayerRoles) -> tuple[float, float]:
    """(all, freed before the attention's backward) bytes transformers 5.x fused MoE experts save per block
    (Mixtral): router = raw Parameter (F.linear on the normed hidden states), experts = fused 3-D Parameters looped
    per expert: gathered tokens -> gate_up (2I, its chunks saved by act and product) -> act * up -> down -> *
    routing weight -> index_add_. Each token visits experts_per_token experts. Weights train only in full
    fine-tuning or under a peft ``ParamWrapper`` (peft all-linear does not adapt raw Parameters otherwise)."""
    spec, T, ab, rb = c.spec, c.T, c.ab, c.rb
    h, I, E = spec.hidden_size, spec.intermediate_size, spec.num_experts
    ktok = roles.mlp_tokens
    mlp = 0.0
    pw = param_wrapped(c)
    if c.full or "gate" in pw:
        mlp += (2 if c.mixed and rb == 4 else rb) * T * h  # router input
    if c.full or "gate_up_proj" in pw:
        mlp += rb * T * h * ktok  # gathered tokens (input of gate_up)
    if c.full or "down_proj" in pw:
        mlp += ab * T * I * ktok  # product (input of down)
    mlp += ab * T * h * ktok  # expert outputs, saved by the routing-weight product (which requires grad)
    mlp += param_wrapper_weights(c)
    moe_saved = mlp
    mlp += 3 * ab * T * I * ktok  # gate_up output (act input + up view) + act output
    mlp += T * E * (4 + ab)  # router logits + fp32 routing softmax
    # routing bookkeeping (grouped_mm_experts_forward): int64 top-k indices, sort permutation and token index
    # (perm // k), the reordered routing weights; a normalized top-k (Mixtral, norm_topk_prob) divides fp32
    # values by their sum, both saved. Measured with the simulate engine (tiny Qwen3-MoE / Mixtral).
    sb = routing_weight_bytes(c)
    if experts_implementation(c.plan) == "eager":
        # eager experts (MixtralExperts.forward): ``index_add_`` keeps its source, the routing-weighted output,
        # for its backward (``expand_as(source)``); per slot the int64 (top-k slot, token) pair ``nonzero``
        # made. Measured block by block with the replay under a balanced router (engines/routing).
        mlp += ab * T * h * ktok + T * ktok * (2 * 8 + sb)
    else:
        mlp += T * ktok * (3 * 8 + sb)
    if spec.model_type in FP32_ROUTING_WEIGHTS or spec.config.get("norm_topk_prob"):
        mlp += 8 * T * ktok
    return mlp, moe_saved


def linear_experts_saved(c: Ctx, roles: LayerRoles) -> tuple[float, float]:
    """(all, down's) bytes an MoE block whose experts are linear modules saves: the router's input, the gathered
    tokens (full) or the experts' adapters' inputs, the expert outputs, router logits and fp32 softmax, the
    intermediates, and the down projections' saves."""
    spec, T, ab, rb = c.spec, c.T, c.ab, c.rb
    h, I, E = spec.hidden_size, spec.intermediate_size, spec.num_experts
    ktok = roles.mlp_tokens
    mlp = consumers_saved(c, T, rb, roles.router)
    if c.full:
        mlp += (2 if c.mixed and rb == 4 else rb) * T * h * ktok
    else:
        mlp += consumers_saved(c, T, rb, roles.mlp_in, already_saved=True)
    mlp += ktok * ab * T * h + T * E * (4 + ab)
    mlp += 3 * ab * T * I * ktok
    down = consumers_saved(c, T, ab, roles.mlp_out)
    mlp += down
    return mlp, down


def dense_mlp_saved(c: Ctx, roles: LayerRoles) -> tuple[float, float, float]:
    """(all, down's, after the input linears) bytes a dense MLP saves: its input linears' saves (a parallel block's
    attention and MLP read the same norm output: saved once when the attention's linears save it as it is — a full
    fine-tune, LoRA adapters reading their input itself), the intermediates (gated: gate output, activation output,
    up output; plain: fc1 output), the extra tensors of composite activations, and down's saves."""
    spec, T, rb = c.spec, c.T, c.rb
    I = spec.intermediate_size
    gated = spec.mlp_kind == "gated"
    shared_norm_saved = spec.parallel_attn and (c.full or saves_input_itself(c, rb, roles.attn_in))
    mlp = consumers_saved(c, T, rb, roles.mlp_in, already_saved=shared_norm_saved)
    mlp_after = -mlp  # + the total below: what the MLP saves after its input linears
    # bitsandbytes under autocast: fp32 MLP intermediates (measured by the simulate engine: +6·T·I per layer)
    mab = mab_global(c, roles)
    mlp += (3 if gated else 1) * mab * T * I  # gate (act input), act out, up  |  fc1 out (act input)
    mlp += act_extra_tensors(spec) * mab * T * I  # activations composed of several pointwise ops
    if c.autocast and mab == 2 and activation_name(spec) in POW_ACTS:
        # autocast: pow saves the fp32 cast of its input (not the bf16 input), and tanh's output, 1 + tanh are
        # fp32 (0.5·x stays bf16): 4 + 4 + 4 + 2 bytes per element, not 4 x 2 (measured on Phi-2 with the
        # simulated engine: -8 % for a full bf16-mixed fine-tune before)
        mlp += 6 * T * I
    down = consumers_saved(c, T, mab, roles.mlp_out)
    mlp += down
    mlp_after += mlp
    return mlp, down, mlp_after


def mlp_saved(c: Ctx, roles: LayerRoles) -> MlpSaves:
    """What one block's MLP saves: fused experts (:func:`fused_experts_saved`), experts as linear modules
    (:func:`linear_experts_saved`) or a dense MLP (:func:`dense_mlp_saved`)."""
    if c.spec.num_experts and not roles.mlp_in:
        mlp, moe_saved = fused_experts_saved(c, roles)
        return MlpSaves(mlp, 0, 0.0, moe_saved)
    if c.spec.num_experts:
        mlp, down = linear_experts_saved(c, roles)
        return MlpSaves(mlp, down, 0.0, 0.0)
    mlp, down, mlp_after = dense_mlp_saved(c, roles)
    return MlpSaves(mlp, down, mlp_after, 0.0)


def hidden_dropout_saved(c: Ctx) -> int:
    """Hidden dropout (BERT/T5/GPT-2 style configs): a bool mask per dropout on the residual branch, two per block."""
    p_hid = config_float(c.spec, "hidden_dropout_prob", "hidden_dropout", "resid_pdrop", "dropout_rate", "dropout")
    return 2 * c.mask_b * c.T * c.spec.hidden_size if p_hid > 0 else 0


def first_block_discount(c: Ctx, roles: LayerRoles) -> int:
    """LoRA: block 0's input does not require grad (frozen embedding): its first norm saves nothing and the dropout
    masks of the modules reading it are not kept."""
    if c.full:
        return 0
    discount = norm_saved(c, c.spec.hidden_size, c.T, c.rb)
    if c.plan.lora_dropout > 0:
        discount += sum(c.mask_b * c.T * i for n, i, _o, m in roles.attn_in if c.is_adapted(n))
    return discount


def block_input_alias(c: Ctx) -> int:
    """Bytes of a block's saves that are its input itself: the first norm saves it (LayerNorm, or an fp32 RMSNorm)."""
    if c.spec.norm_kind != "rms" or c.rb == 4:
        return c.rb * c.T * c.spec.hidden_size
    return 0


def int8_checkpoint_extra(c: Ctx, roles: LayerRoles) -> int:
    """LLM.int8() under checkpointing: the forward's distinct inputs of the quantized linears, in their own dtype,
    but the kept block input (measured by the simulate engine; OLMo 3 / EXAONE 4 +7 % before the post-norm case)."""
    if c.quant != "int8":
        return 0
    return sum(x_bytes * c.T * width for x_bytes, width, _consumers in int8_inputs(c, roles, gc_kept=True))


def layer_activations(c: Ctx) -> LayerActs:
    """One block's activations from the formulas, term by term: what it saves (norms, attention, MLP, LLM.int8()'s
    kept inputs, hidden dropout masks), its forward and backward transients, and what checkpointing keeps and
    recomputes."""
    spec, plan = c.spec, c.plan
    roles = layer_roles(spec)
    T, rb, h = c.T, c.rb, spec.hidden_size
    norms = norms_saved(c)
    attn = attention_saved(c, roles)
    mlp = mlp_saved(c, roles)
    # LLM.int8(): MatMul8bitLt keeps its input as a ``ctx.tensors`` attribute (bitsandbytes
    # autograd/_functions.py; its fp16 cast only feeds the quantization): a distinct input the block's saves do not
    # already keep is alive until the graph is freed. Under checkpointing the recompute's ctx attributes go with its
    # graph; the forward's are ``gc_extra``.
    int8_in = int8_held_only(c) if not plan.gradient_checkpointing else 0
    saved = int(norms + attn.total + mlp.total + hidden_dropout_saved(c) + int8_in)
    discount = first_block_discount(c, roles)
    adapter_recompute, adapter_forward = mlp_adapter_forward(c, roles, mlp)
    fwd_t = forward_transient(c, roles, adapter_recompute, adapter_forward, attn.impl)
    gc_recompute = int(adapter_recompute + 2 * rb * T * h + 4 * T * h + discount) if adapter_recompute else 0
    L = max(spec.num_layers, 1)
    return LayerActs(
        saved,
        L * saved - int(discount),
        saved - int(discount),
        rb * T * h,
        int(fwd_t),
        backward_extra(c, roles, attn, mlp),
        int(mlp.down),
        int(block_input_alias(c)),
        int(int8_checkpoint_extra(c, roles)),
        gc_recompute,
    )


def measured_layer_activations(c: Ctx, measured: BlockSaves) -> LayerActs:
    """The formulas' :class:`LayerActs` with what the blocks save and their forward/backward transients taken from a
    replay of their real code (at the plan's tokens: :meth:`BlockSaves.at`). Under gradient checkpointing the kept
    block inputs stay the formulas' and a block's recompute is part of its measured backward transient."""
    from dataclasses import replace

    la = layer_activations(c)
    m = measured.at(c)
    per = m.per_block
    # a block's backward starts with the gradient of its output alive (made by the block above or the head): the
    # measurement's baseline, not its transient
    grad = c.rb * c.T * c.spec.hidden_size
    fwd, bwd = m.forward_transient, m.backward_transient + grad
    net = m.backward_over_gradients + grad
    if measured.checkpointed:
        # the backward transient of a checkpointed block includes its recompute: nothing else is recomputed
        return replace(
            la,
            saved=0,
            stack=sum(per),
            bottom=0,
            gc_alias=0,
            fwd_transient=fwd,
            bwd_extra=bwd,
            gc_recompute=0,
            bwd_over_gradients=net,
        )
    return replace(
        la, stack=sum(per), bottom=per[0], fwd_transient=fwd, bwd_extra=bwd, gc_recompute=0, bwd_over_gradients=net
    )


def embedding_leaf_bytes(c: Ctx) -> int:
    """Under checkpointing, transformers makes a frozen embedding's output require grad: a leaf its
    ``AccumulateGrad`` node keeps all step. Where the model scales it in its forward, block 0's input (a kept
    checkpoint input) is another tensor, so the leaf is one more T x h (traced with the simulated engine on a tiny
    Granite, LoRA + GC: -2 … -4 % before). Offloaded, the leaf is what stays on the device already."""
    spec = c.spec
    if (
        not c.plan.gradient_checkpointing
        or c.full
        or c.plan.offload_activations
        or spec.model_type not in EMBEDDINGS_SCALED_IN_FORWARD
    ):
        return 0
    return c.rb * c.T * spec.hidden_size


def final_saved(c: Ctx, measured: BlockSaves | None = None) -> int:
    """Final norm (measured with the blocks when given) + what the head saves of its input (full: the normed hidden
    states; LoRA on the head: the adapter's input copies; the chunked loss: the normed hidden states, which its
    checkpointed chunks keep). Encoder classifiers read the first token only."""
    spec = c.spec
    h = spec.hidden_size
    tokens = c.T if spec.arch_kind != "encoder" else c.B
    if measured is not None:
        total = measured.at(c).final
    elif spec.arch_kind != "encoder" or spec.norm_kind == "rms":
        total = norm_saved(c, h, c.T, c.rb)
    else:
        total = 0
    head = [(g.name, g.in_features, g.out_features, 1.0) for g in spec.groups if g.name in HEAD_NAMES]
    if fused_head(c.plan) and spec.arch_kind == "decoder":
        pass  # a fused head saves what it needs itself (logits.trl_fused_head, logits.liger_fused_linear_ce)
    elif c.plan.loss == "chunked" and spec.arch_kind == "decoder":
        # oomdoctor.execute.loss: each checkpointed chunk keeps its slice of the final hidden states (a view) as
        # its input, so the whole tensor lives until the last chunk's backward (on the host under
        # offload_activations, which packs the checkpoints' inputs too); the head saves nothing itself
        total += 0 if c.plan.offload_activations else c.rb * c.T * h
    elif head:
        total += consumers_saved(c, tokens, c.rb, head)
    elif spec.tie_word_embeddings and c.full:
        total += consumers_saved(c, tokens, c.rb, [("lm_head", h, spec.vocab_size, 1.0)])
    return int(total)
