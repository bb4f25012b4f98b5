"""Activations: tensors saved for backward by the transformer blocks, per block and in total, with and without
gradient checkpointing, by attention implementation, for full fine-tuning and (Q)LoRA.

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
from functools import lru_cache

from oomdoctor.memory import parameters as prm
from oomdoctor.memory.logits import fused_head
from oomdoctor.memory.context import HEAD_NAMES, PARAM_WRAPPER, Ctx, experts_implementation
from oomdoctor.model.spec import ModelSpec

#: Per-token fp32 statistics an RMSNorm saves (rsqrt of the variance).
RMS_STATS_BYTES = 4
#: fp32 T x dim temporaries an RMSNorm's backward holds at its peak (the simulated engine: the weight's and the
#: normalization's gradients, mean's expand, pow's backward and its scaling).
RMS_BACKWARD_TEMPS = 5
#: Per-token fp32 statistics a LayerNorm saves (mean and rstd).
LN_STATS_BYTES = 8


@dataclass(frozen=True)
class LayerRoles:
    """Per-layer linear groups of a spec sorted by role, with instances per layer (count / num_layers)."""

    attn_in: tuple[tuple[str, int, int, float], ...]
    """(name, in, out, per-layer multiplicity) of linears reading the attention norm output (q/k/v or fused qkv)."""
    attn_out: tuple[tuple[str, int, int, float], ...]
    mlp_in: tuple[tuple[str, int, int, float], ...]
    mlp_out: tuple[tuple[str, int, int, float], ...]
    router: tuple[tuple[str, int, int, float], ...]
    attn_blocks: float
    """Attention blocks per layer (2 for a T5 decoder layer with cross-attention, averaged over all layers)."""
    mlp_tokens: float
    """Tokens through the MLP per token (experts_per_token for MoE, else 1)."""
    fused_up: bool
    """gate and up are one linear of 2*intermediate (Phi-3)."""


#: Attention input projections by module name (separate or fused q/k/v), classified before the shape rules.
ATTN_IN_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack",
                           "query", "key", "value", "q", "k", "v"})
#: Models whose rotary embedding concatenates q's rotated and passed parts (``apply_rotary_pos_emb`` with
#: ``torch.cat``): a contiguous (B, heads, S, hd) query.
CONCATENATED_QUERY = frozenset({"phi", "phi3", "gpt_neox", "stablelm", "persimmon"})
#: MLP projections by module name: classify them when the intermediate size equals the hidden size, where their
#: shapes look like the attention's.
MLP_IN_NAMES = frozenset({"gate_proj", "up_proj", "gate_up_proj", "fc1", "w1", "w3", "c_fc", "dense_h_to_4h",
                          "wi", "wi_0", "wi_1"})
MLP_OUT_NAMES = frozenset({"down_proj", "fc2", "w2", "dense_4h_to_h", "wo"})


@lru_cache(maxsize=256)
def layer_roles(spec: ModelSpec) -> LayerRoles:
    """Classify per-layer linears by shape: MLP up (h -> I or 2I), MLP down (I -> h), router (h -> experts),
    attention output (-> h), attention input (h -> ...)."""
    h, inter = spec.hidden_size, spec.intermediate_size
    L = max(spec.num_layers, 1)
    E, k = spec.num_experts, spec.experts_per_token
    attn_in, attn_out, mlp_in, mlp_out, router = [], [], [], [], []
    fused_up = False
    for g in spec.groups:
        if g.kind != "linear" or not g.per_layer or g.name in HEAD_NAMES:
            continue
        mult = g.count / L
        item = (g.name, g.in_features, g.out_features, mult)
        if E and g.out_features == E and g.in_features == h:
            router.append(item)
        elif g.name in ATTN_IN_NAMES:
            attn_in.append(item)  # by name first: a fused qkv of 3h outputs looks like an MLP input when I == 3h
        elif g.in_features == h and g.out_features in (inter, 2 * inter) and inter != h:
            fused_up = fused_up or g.out_features == 2 * inter
            mlp_in.append(item)
        elif g.in_features == inter and g.out_features == h and inter != h:
            mlp_out.append(item)
        elif inter == h and g.name in MLP_IN_NAMES:
            mlp_in.append(item)
        elif inter == h and g.name in MLP_OUT_NAMES:
            mlp_out.append(item)
        elif g.out_features == h and g.in_features != h:
            attn_out.append(item)
        elif g.in_features == h and g.out_features != h:
            attn_in.append(item)
        elif g.name.endswith(("o_proj", "o", "out_proj", "dense", "c_proj", "wo")) and not g.name.startswith(("mlp", "fc")):
            attn_out.append(item)
        else:
            attn_in.append(item)
    n_attn = sum(m for *_x, m in attn_out) or 1.0
    if E:
        # Expert groups repeat E times per layer; each token visits k of them.
        mlp_in = [(n, i, o, m * k / E if m >= E - 1e-9 else m) for n, i, o, m in mlp_in]
        mlp_out = [(n, i, o, m * k / E if m >= E - 1e-9 else m) for n, i, o, m in mlp_out]
    mlp_tokens = float(k) if E else 1.0
    return LayerRoles(
        tuple(attn_in), tuple(attn_out), tuple(mlp_in), tuple(mlp_out), tuple(router), n_attn, mlp_tokens, fused_up
    )


#: Extra intermediate-sized tensors saved by activation functions that transformers composes from pointwise ops
#: (``activations.py``): NewGELU ``0.5*x*(1+tanh(c*(x+0.044715*x^3)))`` keeps tanh's output, ``0.5*x`` and
#: ``1+tanh`` besides its input; FastGELU one more (``0.044715*x`` times x); QuickGELU keeps ``sigmoid(1.702x)``.
#: Fused ones (silu, gelu, gelu_pytorch_tanh, relu) keep only their input.
ACT_EXTRA_TENSORS = {"gelu_new": 3, "gelu_fast": 4, "gelu_accurate": 3, "quick_gelu": 1, "gelu_python": 2}


#: transformers' config defaults when config.json omits the activation.
DEFAULT_ACT = {"gpt2": "gelu_new", "phi": "gelu_new", "falcon": "gelu", "gemma": "gelu_pytorch_tanh",
               "gemma2": "gelu_pytorch_tanh", "bert": "gelu", "t5": "relu"}


#: Composite activations that cube their input with ``torch.pow`` (transformers ``NewGELUActivation``,
#: ``GELUActivation`` accurate): under CUDA autocast ``pow`` runs in fp32, so the tanh branch is fp32 throughout.
POW_ACTS = frozenset({"gelu_new", "gelu_accurate"})


def activation_name(spec: ModelSpec) -> str:
    for key in ("hidden_act", "activation_function", "hidden_activation", "feed_forward_proj"):
        v = spec.config.get(key)
        if isinstance(v, str):
            return v.replace("gated-", "")
    return DEFAULT_ACT.get(spec.model_type, "")


def act_extra_tensors(spec: ModelSpec) -> int:
    return ACT_EXTRA_TENSORS.get(activation_name(spec), 0)


def effective_attn(spec: ModelSpec, attn: str) -> str:
    """Attention implementation the model really runs: transformers refuses SDPA for models that soft-cap attention
    logits (Gemma-2: ``_supports_sdpa = False``), so they run eager unless flash-attention is requested."""
    if attn == "sdpa" and spec.config.get("attn_logit_softcapping") is not None and spec.model_type == "gemma2":
        return "eager"
    if (attn == "sdpa" and spec.model_type == "falcon" and not spec.config.get("new_decoder_architecture")
            and spec.num_kv_heads != spec.num_heads):
        # Falcon-7B multi-query: FalconAttention passes 1-head k/v to SDPA without enable_gqa, so SDPA falls back
        # to its math kernel, which materializes the B x heads x S x S probabilities like eager attention.
        return "eager"
    return attn


def mab_global(c: Ctx, roles: LayerRoles) -> int:
    """Bytes per element of the MLP intermediates (fp32 when bitsandbytes layers run under autocast)."""
    return 4 if bnb_outputs_fp32(c, roles.mlp_in) else c.ab


def bnb_outputs_fp32(c: Ctx, linears) -> bool:
    """bitsandbytes ``Linear4bit``/``Linear8bitLt`` return ``out.to(input dtype)``: under autocast their inputs are
    fp32 norm outputs, so a quantized one among ``linears`` (role tuples) outputs fp32."""
    return c.quant is not None and c.mixed and any(_quantized(c.spec, n) for n, *_x in linears)


def _quantized(spec: ModelSpec, name: str) -> bool:
    for g in spec.groups:
        if g.name == name and g.kind == "linear" and g.per_layer:
            return g.quantizable
    return False


def _config_float(spec: ModelSpec, *keys: str) -> float:
    for key in keys:
        v = spec.config.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 0.0


#: RMSNorms that multiply their weight into the fp32 normalized input and cast the product back (Gemma 1-3 and
#: Qwen3-Next: ``output * (1.0 + self.weight.float())``; OLMo 2/3: ``(self.weight * hidden_states).to(input_dtype)``):
#: with a trainable weight the product saves that fp32 ``y``, where Llama's (and OLMoE's) saves ``y`` cast back to
#: the input dtype.
FP32_PRODUCT_NORMS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "olmo2", "olmo3", "qwen3_next"})


def norm_saved(c: Ctx, dim: int, tokens: int, x_bytes: int) -> int:
    """Bytes one norm over ``dim`` saves for backward when its input requires grad."""
    trainable = c.full
    if c.spec.norm_kind == "rms":
        # LlamaRMSNorm: x.to(fp32) (saved by pow and mul) + rsqrt + (weight * y saves y when the weight trains).
        y_bytes = 4 if c.spec.model_type in FP32_PRODUCT_NORMS else x_bytes
        extra = 0
        if c.spec.model_type == "t5" and x_bytes != 4:
            # T5LayerNorm multiplies the 16-bit input itself by the fp32 rsqrt (the product saves that input) and
            # keeps its 16-bit cast of the result (measured tensor by tensor on a real CPU T5 step; with a trainable
            # weight that cast is the ``y`` counted below).
            extra = x_bytes * dim + (0 if trainable else c.ab * dim)
        return tokens * (4 * dim + RMS_STATS_BYTES + (y_bytes * dim if trainable else 0) + extra)
    # native_layer_norm saves input, mean, rstd (CUDA autocast runs layer_norm in fp32: input fp32 in mixed).
    return tokens * (x_bytes * dim + LN_STATS_BYTES)


def consumers_saved(c: Ctx, tokens: float, x_bytes: int, consumers, already_saved: bool = False) -> float:
    """Bytes saved by the linears in ``consumers`` that read the same (tokens x in) tensor X of ``x_bytes``."""
    if not consumers:
        return 0.0
    total = 0.0
    if c.full:
        if c.mixed and x_bytes == 4:
            # autocast: each linear casts X to bf16 and saves its own copy
            total += sum(2 * tokens * m_tok(c, m) * i for _n, i, _o, m in consumers)
        elif not already_saved:
            total += x_bytes * tokens * max(m_tok(c, m) * i for _n, i, _o, m in consumers)
        return total
    r = c.plan.lora_r
    p = c.plan.lora_dropout
    shared_x = False
    for name, i, _o, m in consumers:
        if not c.is_adapted(name):
            continue
        t = tokens * m_tok(c, m)
        a_bytes = 2 if c.autocast else c.adapter_b  # lora_A's output
        if p > 0:
            # the dropout output (in the adapter's dtype), re-cast to bf16 by autocast
            d_bytes = 2 if c.autocast else c.adapter_b
            total += t * i * (d_bytes + c.mask_b)
        elif adapter_reads_input(c, name, x_bytes):
            shared_x = True
        elif c.autocast:
            # per-module bf16 cast of the input that lora_A saves: autocast's cast of an fp32 input, or of peft's
            # fp32 copy of a 16-bit one (``_cast_input_dtype`` to the fp32 adapter's dtype)
            total += 2 * t * i
        else:
            total += c.adapter_b * t * i  # per-module copy to the adapter's dtype (_cast_input_dtype)
        total += a_bytes * t * r
    if shared_x and not already_saved:
        total += x_bytes * tokens * max(m_tok(c, m) * i for _n, i, _o, m in consumers)
    return total


def adapter_reads_input(c: Ctx, name: str, x_bytes: int) -> bool:
    """Whether module ``name``'s LoRA adapter saves its input X (of ``x_bytes``) itself, no copy made: no dropout,
    and neither peft nor autocast casts X — peft copies X to the adapter's dtype unless they match (or a
    bitsandbytes LoRA layer under CUDA autocast skips the copy), autocast casts an fp32 input to bf16; bf16 adapters
    reading a bf16 input (FSDP2 mixed precision, TRL's QLoRA) read it as it is."""
    if c.plan.lora_dropout > 0:
        return False
    if c.gathered_in_compute_dtype:
        return True
    if x_bytes != c.adapter_b and not (c.autocast and _bnb_skips_input_cast(c, name)):
        return False  # peft's copy to the adapter's dtype
    return not (c.autocast and x_bytes == 4)


def _bnb_skips_input_cast(c: Ctx, name: str) -> bool:
    """peft's bitsandbytes LoRA layers copy their input to the adapter's dtype only when
    ``torch.is_autocast_enabled()`` is false — a CUDA question, so under CUDA autocast they skip the copy (under CPU
    autocast they make it, as every non-bitsandbytes LoRA layer does: ``tuners/lora/bnb.py``)."""
    return c.quant is not None and _quantized(c.spec, name) and c.device == "cuda"


def int8_inputs(c: Ctx, roles: LayerRoles, *, gc_kept: bool = False) -> list[tuple[int, int, tuple]]:
    """(bytes per element, width, consumers) of the distinct inputs of a block's LLM.int8() linears: attention norm
    output (the block input itself in post-norm-only blocks), attention output, MLP norm output (unless parallel:
    the attention's), MLP intermediate. ``gc_kept``: without the block input, which checkpointing keeps anyway."""
    spec = c.spec
    h = spec.hidden_size
    qd = spec.num_heads * spec.head_dim
    out = [] if gc_kept and c.sums.post_norms_only else [(c.rb, h, roles.attn_in)]
    out.append((c.ab, qd, roles.attn_out))
    if not spec.parallel_attn:
        out.append((c.rb, h, roles.mlp_in))
    out.append((mab_global(c, roles), spec.intermediate_size, roles.mlp_out))
    return [(b, w, cons) for b, w, cons in out if any(_quantized(spec, n) for n, *_x in cons)]


def int8_held_only(c: Ctx) -> int:
    """Bytes of a block's LLM.int8() inputs only ``MatMul8bitLt``'s ctx keeps (no save holds that tensor): part of
    what the block keeps without checkpointing, on the device even with activations offloaded. The output
    projection's input is SDPA's saved output where :func:`attn_saves_output` (Llama blocks in pure bf16 without the
    k-bit upcast, or with LoRA dropout: +16 KiB per block of tiny Llama at 128 tokens over the replay before)."""
    if c.quant != "int8":
        return 0
    roles = layer_roles(c.spec)
    return sum(x_bytes * c.T * width for x_bytes, width, consumers in int8_inputs(c, roles)
               if not _saves_input_itself(c, x_bytes, consumers)
               and not (consumers == roles.attn_out and attn_saves_output(c)))


def attn_saves_output(c: Ctx) -> bool:
    """Whether the output projection's input is the very tensor SDPA/flash saved (its output, reshaped as a view).
    Partial rotary concatenates the rotated and passed parts of q: q reaches SDPA contiguous in (B, heads, S, hd),
    flash lays its output out like the query (CUDA ``mha_fwd``'s ``empty_like(q)``, the CPU kernel alike), and the
    ``transpose(1, 2).contiguous()`` before the output projection copies it (measured tensor by tensor on replayed
    Phi blocks; other models' q keeps the projection's (B, S, heads, hd) layout). Eager attention's output is a
    fresh contiguous copy."""
    return effective_attn(c.spec, c.plan.attn) != "eager" and c.spec.model_type not in CONCATENATED_QUERY


def _saves_input_itself(c: Ctx, x_bytes: int, consumers) -> bool:
    """Whether an adapted consumer of the tensor saves that very tensor (``adapter_reads_input``)."""
    return any(c.is_adapted(name) and adapter_reads_input(c, name, x_bytes) for name, *_x in consumers)


def offloaded_mlp_forward(c: Ctx, roles: LayerRoles) -> int:
    """Bytes a dense MLP's forward holds with every save on the host (activation offloading without
    checkpointing): save_on_cpu copies each saved tensor out, but the running code still references its inputs and
    outputs — the block input, the residual and the norm output, the activation's output waiting for the product;
    with LoRA the costliest adapter's base output, lora_B output and scaled copy (fp32 unless under autocast) and
    peft's copy of its input for an fp32 adapter in pure 16-bit (with dropout, the dropout output too). Traced on
    Llama-3.2-1B blocks at 4k tokens with the simulated engine (pure bf16 LoRA with the chunked loss: -17 % before)."""
    spec, T, h = c.spec, c.T, c.spec.hidden_size
    if spec.num_experts or not roles.mlp_in:
        return 0
    mab = mab_global(c, roles)
    gated = spec.mlp_kind == "gated"
    held = 3 * c.rb * T * h  # the block input (the caller's reference), the residual, the norm output
    moment = held + (3 if gated else 2) * mab * T * spec.intermediate_size  # act out + up out + product | fc1 + act
    if c.full:
        return int(moment)
    for w_in, w, first in adapted_mlp_inputs(c, roles):
        copy = 0
        if c.adapter_b == 4 and not c.mixed and mab != 4:
            copy = 4 * T * w_in * (2 if c.plan.lora_dropout > 0 else 1)  # fp32 input copy (+ its dropout output)
        earlier = 0 if first else mab * T * spec.intermediate_size  # the activation's output
        moment = max(moment, held + adapter_out_bytes(c) * T * w + earlier + copy)
    return int(moment)


def eager_forward_transient(c: Ctx) -> int:
    """Bytes per score element eager attention holds in forward beyond the block's saves (transformers
    ``eager_attention_forward``). Its saves (soft-capping's tanh, the fp32 softmax, the probabilities' cast — the
    same tensor in fp32) are in the block's saves already, and the masked scores stay alive until the softmax line
    ends: at the cast they are the one score tensor above the saves (at ``+ mask``, the scaled and the masked scores
    are two, but the softmax and its cast are not made yet). Checkpointed, the forward saves nothing: the masked
    scores, the softmax and its cast are alive together; so it is offloaded (``save_on_cpu`` copies the saves out,
    the block keeps none on the device). Traced with the simulated engine on tiny Llama and Gemma 2 blocks (+4 …
    +14 % before, which priced all three on top of the saves)."""
    ab = c.ab
    if c.plan.gradient_checkpointing or c.plan.offload_activations:
        return ab + 4 + (0 if ab == 4 else ab)
    return ab


def adapter_out_bytes(c: Ctx) -> int:
    """Bytes per output element a LoRA module's forward holds at once: the base output, lora_B's output and its
    scaled copy — in the compute dtype under autocast, else the latter two fp32."""
    return 3 * c.ab if c.autocast else c.ab + 2 * c.adapter_b


def adapted_mlp_inputs(c: Ctx, roles: LayerRoles) -> list[tuple[int, int, bool]]:
    """(in, out, runs first) of the adapted MLP-input linears, in the order the MLP runs them (gate, then up; a
    fused gate_up alone)."""
    first = roles.mlp_in[0][0] if roles.mlp_in else None
    return [(i, o, n == first) for n, i, o, _m in roles.mlp_in if c.is_adapted(n)]


def offload_repacks(c: Ctx) -> int:
    """Host bytes ``save_on_cpu`` packs per block beyond what the block keeps on the device without it: the hook packs
    once per save, so a tensor several ops save is copied out once each — an RMSNorm's fp32 input (saved by ``pow``
    and by ``mul``; the q/k norms' too), a norm output several linears save as it is (full fine-tuning's q/k/v and
    gate/up, LoRA adapters reading the input itself, eager attention's fp32 probabilities) — and the weight each
    non-quantized linear saves for its input gradient (its autocast cast under ``*-mixed``; a parameter, not an
    activation, on the device). Traced with the simulated engine on Llama-3.2-1B blocks at 4k tokens, offloaded
    without checkpointing (host bytes 5-39 % short before)."""
    spec, T, h = c.spec, c.T, c.spec.hidden_size
    roles = layer_roles(spec)
    qk = spec.num_heads * spec.head_dim + spec.num_kv_heads * spec.head_dim if c.sums.head_dim_norms_per_layer else 0
    total = 4 * T * (c.sums.hidden_norms_per_layer * h + qk) if spec.norm_kind == "rms" else 0
    for x_bytes, consumers in ((c.rb, roles.attn_in), (c.rb, roles.mlp_in)):
        if c.full:
            savers = 0 if c.mixed and x_bytes == 4 else len(consumers)  # autocast: each saves its own cast
        else:
            savers = sum(1 for n, *_x in consumers if c.is_adapted(n) and adapter_reads_input(c, n, x_bytes))
        total += max(savers - 1, 0) * x_bytes * T * h
    L = max(spec.num_layers, 1)
    weights = sum(g.weight_numel * g.count for g in spec.groups if g.kind == "linear" and g.per_layer
                  and not (c.quant is not None and _quantized(spec, g.name))) // L
    if effective_attn(spec, c.plan.attn) == "eager" and c.ab == 4:
        # in fp32 the probabilities' cast is the softmax output itself: saved by the softmax and by the PV matmul
        # (tiny Llama and Gemma 2 blocks, full fp32 offloaded: host 27 % and 17 % short before)
        total += 4 * c.B * spec.num_heads * c.S * c.S
    return int(total + weights * (2 if c.mixed else c.wb))


def trl_offload_kept(c: Ctx) -> int:
    """Bytes one block keeps on the device under TRL's activation offloading without checkpointing (trl 1.16
    ``models/activation_offloading.py`` ``OffloadActivations.pack_tensor``, lines 197-232): a tensor saved again
    while its first save is still in the forward stash (the last ``max_fwd_stash_size`` = 5 packs) is not copied
    again but kept — the device tensor itself, until backward unpacks it. That is every tensor a block saves twice in
    a row: an RMSNorm's fp32 input (saved by ``pow`` and by ``mul``) and its ``rsqrt`` (by ``rsqrt`` and ``mul``),
    and an input several linears save as it is (a full fine-tune's q/k/v and gate/up outside autocast; LoRA adapters
    reading the input itself). Parameters (and views of them) are never copied; everything else goes to the host
    once. Traced pack by pack on a replayed TRL step (``engines/trainers.py``)."""
    spec, T, h = c.spec, c.T, c.spec.hidden_size
    roles = layer_roles(spec)
    total = 0
    if spec.norm_kind == "rms":
        heads = spec.num_heads + spec.num_kv_heads if c.sums.head_dim_norms_per_layer else 0
        qk = heads * spec.head_dim
        total += 4 * T * (c.sums.hidden_norms_per_layer * h + qk) + RMS_STATS_BYTES * T * (
            c.sums.hidden_norms_per_layer + heads)
    for x_bytes, consumers in ((c.rb, roles.attn_in), (c.rb, roles.mlp_in)):
        if c.full:
            savers = 0 if c.mixed and x_bytes == 4 else len(consumers)  # autocast: each saves its own cast
        else:
            savers = sum(1 for n, *_x in consumers if c.is_adapted(n) and adapter_reads_input(c, n, x_bytes))
        total += x_bytes * T * h if savers >= 2 else 0
    return int(total)


def trl_offload_final_kept(c: Ctx) -> int:
    """The final norm's twice-saved tensors under TRL's offloading (:func:`trl_offload_kept`): its fp32 input and
    ``rsqrt`` stay on the device."""
    if c.spec.norm_kind != "rms":
        return 0
    return (4 * c.spec.hidden_size + RMS_STATS_BYTES) * c.T


def trl_offload_down_moment(c: Ctx, roles: LayerRoles) -> int:
    """What a dense gated MLP's forward holds at its down projection under TRL's offloading without checkpointing:
    the forward stash (the last 5 packs) still holds the activation's and up's outputs (saved by the product) and,
    with LoRA on down, its dropout mask and lora_A's saved input, on top of what the running code references — the
    product, the base output, the block input, the residual, the norm output and the embedding output; with LoRA
    on down, peft's fp32 copy of a 16-bit product and the fp32 dropout output. Traced op by op on a replayed TRL
    step (Llama-3.1-8B cut to 2 blocks, LoRA bf16 at 2k tokens)."""
    spec, T, h, I = c.spec, c.T, c.spec.hidden_size, c.spec.intermediate_size
    if spec.num_experts or spec.mlp_kind != "gated" or not roles.mlp_out:
        return 0
    mab = mab_global(c, roles)
    held = 4 * c.rb * T * h + c.ab * T * h + mab * T * I  # block input, residual, norm out, embeddings; base out
    stash = 2 * mab * T * I  # the activation's and up's outputs
    if c.full:
        return int(held + stash + mab * T * I)  # down saves the product itself: in the stash too
    if not any(c.is_adapted(n) for n, *_x in roles.mlp_out):
        return int(held + stash)
    dropout = c.plan.lora_dropout > 0
    copies = (1 if mab != c.adapter_b else 0) + (1 if dropout else 0)  # peft's copy, the dropout output
    saved_in = 2 if c.autocast else c.adapter_b  # lora_A's saved input (autocast recasts it)
    stash += (c.mask_b if dropout else 0) * T * I + saved_in * T * I
    return int(held + stash + copies * c.adapter_b * T * I)


def m_tok(c: Ctx, m: float) -> float:
    """Token multiplier of a group with ``m`` instances per layer: dense groups see every token once per instance."""
    return m


@dataclass(frozen=True)
class BlockBytes:
    """What the blocks of a model keep for backward and hold transiently at one token count (bytes)."""

    per_block: tuple[int, ...]
    """One entry per block, bottom first: the activation bytes autograd saves while the block runs."""
    final: int
    """The activation bytes saved between the last block and the output head (the final norm)."""
    forward_transient: int
    """The largest peak of a block's forward above what all blocks save (``engines/blocks.forward_over_saves``)."""
    backward_transient: int
    """The largest peak of a block's backward above the bytes alive when it starts, its weights' gradients included
    (under gradient checkpointing: with its recompute)."""
    backward_over_gradients: int
    """The largest peak of a block's backward above the bytes alive when it starts and the weight gradients it makes:
    what the bottom moment adds to gradients it counts as made already (a hybrid stack's MoE blocks make far more
    than the average block)."""


@dataclass(frozen=True)
class BlockSaves:
    """What each block of a model keeps for backward and holds transiently, measured by replaying the blocks' real
    code (``oomdoctor.engines.blocks``) at micro-batch 1 and 2 with the plan's gradient checkpointing: what the
    analytic engine uses for blocks its formulas do not know."""

    one: BlockBytes
    """Measured at micro-batch 1."""
    two: BlockBytes
    """Measured at micro-batch 2: the difference is what grows with the tokens; the rest is the same for any batch
    (weight-sized tensors: the gradients a block's backward makes, the merged W' of peft's ``ParamWrapper``)."""
    checkpointed: bool
    """Measured with gradient checkpointing: ``per_block`` is then empty of what checkpointed blocks save (each keeps
    its input, a formula) and the transients are those of checkpointed blocks."""
    seq_len: int
    """The sequence length measured at."""

    def scale(self, c: Ctx) -> float:
        """The plan's tokens in measured micro-batches: exact in the batch and in every term linear in the sequence;
        the measurement runs at the next power of two (``engines/blocks.measured_plan``), so a term quadratic in the
        sequence (eager scores, sliding-window masks) is over-priced by less than 2x between."""
        return c.B * c.S / self.seq_len

    def at(self, c: Ctx) -> BlockBytes:
        """The bytes at the plan's tokens: the weight-sized part as measured, the token part scaled (the line
        through the two measurements)."""
        k = self.scale(c)

        def line(a: int, b: int) -> int:
            return max(0, int(a + (b - a) * (k - 1)))

        one, two = self.one, self.two
        return BlockBytes(tuple(line(a, b) for a, b in zip(one.per_block, two.per_block)), line(one.final, two.final),
                          line(one.forward_transient, two.forward_transient),
                          line(one.backward_transient, two.backward_transient),
                          line(one.backward_over_gradients, two.backward_over_gradients))


@dataclass(frozen=True)
class LayerActs:
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


#: Model types whose router hands the experts fp32 routing weights (transformers ``MixtralTopKRouter.forward``:
#: ``softmax(logits.float())`` top-k, never cast back; Qwen2/3-MoE and most others cast to the logits' dtype): the
#: experts' weighted output, its reordering and the sum are fp32 then (``grouped_mm_experts_forward``).
FP32_ROUTING_WEIGHTS = ("mixtral",)


def routing_weight_bytes(c: Ctx) -> int:
    """Bytes per element of the routing weights the experts multiply their outputs by (FP32_ROUTING_WEIGHTS)."""
    return 4 if c.spec.model_type in FP32_ROUTING_WEIGHTS else c.ab


def param_wrapped(c: Ctx) -> dict[str, int]:
    """The MoE parameters of one block carrying a peft ``ParamWrapper`` adapter (``memory/context.lora_groups_of``):
    ``gate`` (router), ``gate_up_proj``, ``down_proj`` -> their base weight's elements in one block."""
    L = max(c.spec.num_layers, 1)
    out = {}
    for g in c.lora_groups:
        if g.module == PARAM_WRAPPER and g.per_layer:
            base = next(b for b in c.spec.groups if b.path == g.path and b.kind != "linear")
            out[g.name.split(".")[-1]] = base.numel_each * g.count // L
    return out


def eager_expert_grads(c: Ctx, w_gu: int, w_d: int) -> int:
    """Bytes of one block's expert-weight gradients in flight in the backward of transformers' eager experts, from
    the fused stacks' elements (``w_gu`` gate_up, ``w_d`` down). The eager loop indexes ``W[e]`` per expert
    (``MixtralExperts.forward``); each index backward makes a zero-filled full-size gradient that autograd sums into
    the parameter's running sum (``InputBuffer``): two full-size gate_up gradients alive at once besides its running
    sum, while down's sum is complete and waits (for its ``AccumulateGrad`` in a full fine-tune, for the
    parametrization backward of a ``ParamWrapper`` adapter). Measured with real_cpu_run (fp32 LoRA) and the simulated
    engine (full fine-tunes, balanced routing: engines/routing)."""
    return c.wb * (3 * w_gu + w_d)


def param_wrapper_weights(c: Ctx) -> int:
    """Bytes one block's forward materializes for its ``ParamWrapper`` adapters and saves for backward.

    peft 0.21 ``ParamWrapper._activate_lora`` (``tuners/lora/layer.py``) registers a ``torch.nn.utils.parametrize``
    parametrization on each adapted parameter: reading it inside the forward builds W' = W + scale·B@A for the whole
    stack of experts, which the expert matmuls (and the router's ``F.linear``) save for the input gradient, once per
    block (recomputed per block under gradient checkpointing). For an expert stack with one adapter
    (``_LoraFactorsProxy``) W' is one ``baddbmm`` in the parameter's dtype, whose factors — the fp32 adapter
    weights cast to a bf16/fp16 parameter's dtype (``get_delta_factors``) — it saves as well; the router (2-D,
    ``get_delta_weight``) adds its delta cast to the weight's dtype. Measured with the simulate engine on tiny
    Qwen3-MoE / Mixtral shapes (tests/test_moe.py)."""
    # under autocast the matmuls save their compute-dtype casts of W' (per expert slice, eager experts), not W'
    total = sum(param_wrapped(c).values()) * (c.ab if c.mixed else c.wb)
    if c.wb != 4:
        L = max(c.spec.num_layers, 1)
        total += sum(c.plan.lora_r * (g.in_features + g.out_features) * g.count // L * c.wb for g in c.lora_groups
                     if g.module == PARAM_WRAPPER and g.per_layer and not g.name.endswith(".gate"))
    return total


def layer_activations(c: Ctx) -> LayerActs:
    spec, plan = c.spec, c.plan
    roles = layer_roles(spec)
    T, B, S = c.T, c.B, c.S
    h, I = spec.hidden_size, spec.intermediate_size
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    qd, kvd = nh * hd, nkv * hd
    ab, rb = c.ab, c.rb
    n_att = roles.attn_blocks
    ktok = roles.mlp_tokens

    # --- norms over the hidden size (input: residual stream, rb bytes)
    n_hidden_norms = c.sums.hidden_norms_per_layer or (1 if spec.parallel_attn else 2)
    norms = n_hidden_norms * norm_saved(c, h, T, rb)
    # q/k norms over q (T x qd) and k (T x kvd), input in the compute dtype; per head (Qwen3) their statistics are
    # per head, over the whole projection (OLMo 2) per token
    if c.sums.head_dim_norms_per_layer:
        norms += norm_saved(c, qd, T, ab) + norm_saved(c, kvd, T, ab)
        if c.sums.qk_norms_per_head:
            norms += (nh + nkv - 2) * T * RMS_STATS_BYTES

    # --- attention
    att = consumers_saved(c, T, rb, roles.attn_in)
    qkv_out = sum(o * m for _n, _i, o, m in roles.attn_in) / max(n_att, 1e-9)  # q+k+v width per attention block
    kv_w = max(qkv_out - qd, 2 * kvd) if qkv_out else qd + 2 * kvd
    attn_impl = effective_attn(spec, plan.attn)
    if attn_impl == "eager":
        rep = qd / max(kvd, 1) if nkv and nkv != nh else 1.0
        inner = ab * T * (qd + kv_w * rep)  # q, repeated k/v (copies when GQA)
        inner += 4 * B * nh * S * S  # fp32 softmax output
        if ab != 4:
            inner += ab * B * nh * S * S  # probs cast back to the compute dtype (saved by matmul with v)
        if spec.config.get("attn_logit_softcapping") is not None:
            inner += ab * B * nh * S * S  # tanh soft-capping keeps its output (Gemma-2 eager_attention_forward)
        p_att = _config_float(spec, "attention_dropout", "attention_probs_dropout_prob", "attn_pdrop")
        if p_att > 0:
            inner += (c.mask_b + ab) * B * nh * S * S
        out_saved_by_attn = False
        out_copy = ab * T * qd if c.full and not c.mixed else 0  # contiguous output copy saved by a trainable o_proj
        inner += out_copy
    else:
        inner = ab * T * (qd + kv_w) + ab * T * qd + 4 * B * nh * S  # q,k,v + out + logsumexp
        if spec.model_type == "t5":
            # T5 hands its relative position bias (1 x heads x S x S) to SDPA as attn_mask: each self-attention
            # saves its own copy (cross-attention: one shared zero bias, in shared_forward_bytes)
            inner += ab * nh * S * S / max(n_att, 1e-9)
        if attn_impl == "sdpa":
            # sliding-window blocks hand SDPA a boolean mask, which it turns into an additive mask in the query's
            # dtype (aten/src/ATen/native/transformers/attention.cpp ``convert_boolean_attn_mask``) that the kernel
            # saves (CUDA: memory-efficient attention, flash takes no mask); with a mask (or head_dim > 256)
            # transformers repeats GQA's k/v to the query heads instead of passing enable_gqa
            # (integrations/sdpa_attention.py ``use_gqa_in_sdpa``): SDPA saves the repeated copies
            masked = sliding_fraction(c)
            inner += masked * ab * B * S * S
            if nkv and nkv < nh:
                inner += (1.0 if hd > 256 else masked) * ab * T * 2 * (qd - kvd)
        if (len(roles.attn_in) == 1 and spec.model_type not in ("gpt2", "falcon")
                and not bnb_outputs_fp32(c, roles.attn_in)):
            # fused qkv (Phi-3 qkv_proj): v is a view of the fused output, so SDPA's saved v keeps all of it alive
            # while rotary made new q/k — unless autocast casts v for SDPA: a bitsandbytes qkv under autocast
            # returns fp32 (traced on replayed Phi-3-mini blocks, QLoRA: 25 MB per block at 2k tokens over before)
            inner += ab * T * (qd + kv_w / 2)
        out_saved_by_attn = attn_saves_output(c)
    att += n_att * inner
    already = out_saved_by_attn or (attn_impl == "eager" and c.full and not c.mixed)  # eager: the copy is in inner
    out_saved = consumers_saved(c, T, ab, roles.attn_out, already_saved=already)
    if attn_impl == "eager" and c.full and c.mixed:
        out_saved += n_att * ab * T * qd  # o_proj saves the bf16 output copy (autocast cast is a no-op on bf16)
    att += out_saved

    # --- MLP
    gated = spec.mlp_kind == "gated"
    mlp_after = 0.0
    moe_saved = 0.0  # what fused experts save (freed before the attention's backward runs)
    if spec.num_experts and not roles.mlp_in:
        # transformers 5.x MoE (Mixtral): router = raw Parameter (F.linear on the normed hidden states), experts =
        # fused 3-D Parameters looped per expert: gathered tokens -> gate_up (2I, its chunks saved by act and
        # product) -> act * up -> down -> * routing weight -> index_add_. Each token visits experts_per_token
        # experts. Weights train only in full fine-tuning (peft all-linear does not adapt raw Parameters).
        E = spec.num_experts
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
        if experts_implementation(plan) == "eager":
            # eager experts (MixtralExperts.forward): ``index_add_`` keeps its source, the routing-weighted output,
            # for its backward (``expand_as(source)``); per slot the int64 (top-k slot, token) pair ``nonzero``
            # made. Measured block by block with the replay under a balanced router (engines/routing).
            mlp += ab * T * h * ktok + T * ktok * (2 * 8 + sb)
        else:
            mlp += T * ktok * (3 * 8 + sb)
        if spec.model_type in FP32_ROUTING_WEIGHTS or spec.config.get("norm_topk_prob"):
            mlp += 8 * T * ktok
        down = 0
    elif spec.num_experts:
        E = spec.num_experts
        mlp = consumers_saved(c, T, rb, roles.router)
        if c.full:
            mlp += (2 if c.mixed and rb == 4 else rb) * T * h * ktok
        else:
            mlp += consumers_saved(c, T, rb, roles.mlp_in, already_saved=True)
        mlp += ktok * ab * T * h + T * E * (4 + ab)
        mlp += 3 * ab * T * I * ktok
        down = consumers_saved(c, T, ab, roles.mlp_out)
        mlp += down
    else:
        # a parallel block's attention and MLP read the same norm output: saved once when the attention's linears
        # save it as it is (a full fine-tune; LoRA adapters reading their input itself)
        shared_norm_saved = spec.parallel_attn and (c.full or _saves_input_itself(c, rb, roles.attn_in))
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

    # --- LLM.int8(): MatMul8bitLt keeps its input as a ``ctx.tensors`` attribute (bitsandbytes
    # autograd/_functions.py; its fp16 cast only feeds the quantization): a distinct input the block's saves do not
    # already keep is alive until the graph is freed. Under checkpointing the recompute's ctx attributes go with its
    # graph; the forward's are ``gc_extra``.
    int8_in = int8_held_only(c) if not plan.gradient_checkpointing else 0

    # --- hidden dropout (BERT/T5/GPT-2 style configs): a bool mask per dropout on the residual branch
    p_hid = _config_float(spec, "hidden_dropout_prob", "hidden_dropout", "resid_pdrop", "dropout_rate", "dropout")
    drop = 2 * c.mask_b * T * h if p_hid > 0 else 0

    saved = int(norms + att + mlp + drop + int8_in)

    # LoRA: block 0's input does not require grad (frozen embedding): its first norm saves nothing and the
    # dropout masks of the modules reading it are not kept.
    discount = 0
    if not c.full:
        discount = norm_saved(c, h, T, rb)
        if plan.lora_dropout > 0:
            discount += sum(c.mask_b * T * i for n, i, _o, m in roles.attn_in if c.is_adapted(n))

    gc_saved = rb * T * h

    # LoRA: the forward of an MLP-input adapter (base output + lora_B output + its scaled copy: fp32 unless under
    # autocast) runs before the MLP's later saved tensors exist, while the residual and the norm output are held by
    # the running forward (and, pure bf16 with dropout, peft's fp32 cast of the input). The first MLP input (gate,
    # or a fused gate_up) runs before every MLP save (``mlp_after``); a second one (up) after the first's output and
    # activation are saved: only its own output and down's saves are still to come. Bytes beyond the block's
    # ``saved``; measured tensor by tensor with the simulated engine on Phi-3 shapes (fused gate_up, 2I wide) and on
    # Llama-3.2-1B blocks at 16k tokens (up's adapter in the top block's recompute: -6 % before).
    mlp_adapter_fwd = down_fwd = 0
    if not c.full and roles.mlp_in and not spec.num_experts:
        for w_in, w, first in adapted_mlp_inputs(c, roles):
            later = mlp_after if first else mab_global(c, roles) * T * w + down
            moment = int(adapter_out_bytes(c) * T * w - later + 2 * rb * T * h)
            if not c.mixed and rb != 4 and plan.lora_dropout > 0 and c.adapter_b == 4:
                moment += 4 * T * w_in
            mlp_adapter_fwd = max(mlp_adapter_fwd, moment)
        # the down adapter's forward in block 0's recompute, after every MLP save, next to the base output and the
        # residual and norm output the running forward holds: fp32 copies of the MLP product that are not saved —
        # peft's cast of a 16-bit product to the fp32 adapter (autocast saves its 16-bit recast, made after; in
        # pure 16-bit with dropout the dropout output is saved, and the product is alive next to it), and under
        # autocast with dropout the fp32 dropout output (autocast saves lora_A's 16-bit cast of it; a bitsandbytes
        # MLP's product is fp32 already). Traced op by op with the simulated engine: Llama-3.2-1B blocks at 16k
        # tokens (-4.0 % before under autocast, -3.9 % with dropout 0.05 in bf16), Phi-3 shapes with dropout 0.05
        # (QLoRA + GC -5.2 % once the fused qkv was priced right, LoRA under autocast -2.3 % before; scripts/
        # plans_vs_simulate.py --grid tests)
        w_down = max((i for n, i, _o, _m in roles.mlp_out if c.is_adapted(n)), default=0)
        mab, dropout = mab_global(c, roles), plan.lora_dropout > 0
        copies = (1 if mab == 2 and (c.autocast or dropout) else 0) + (1 if c.autocast and dropout else 0)
        if c.autocast and any(c.is_adapted(n) and _bnb_skips_input_cast(c, n) for n, *_x in roles.mlp_out):
            # a bitsandbytes down under CUDA autocast: peft makes no copy of the product; the dropout output is in
            # the product's dtype, a transient only when fp32 (a 16-bit one is what lora_A saves)
            copies = 1 if dropout and mab == 4 else 0
        if w_down and c.adapter_b == 4 and copies:
            product = 2 * T * w_down if mab == 2 and not c.autocast else 0
            mlp_adapter_fwd = max(mlp_adapter_fwd,
                                  int(copies * 4 * T * w_down + product + ab * T * h + 2 * rb * T * h))
            if c.autocast and not c.mixed and not plan.gradient_checkpointing:
                # bf16 weights under a foreign trainer's autocast (Ctx.autocast), in the forward: the 16-bit product
                # (down's input, which only lora_A's cast of peft's fp32 copy saves) is alive next to those copies,
                # and so are the block input (the decoder's reference), the residual, the norm output and the
                # embedding output (the model's ``inputs_embeds``). Traced op by op on a replayed TRL step
                # (Llama-3.1-8B cut to 2 blocks, LoRA bf16 at 2k tokens: -2.1 % before)
                down_fwd = int(copies * 4 * T * w_down + mab * T * w_down + ab * T * h + 4 * rb * T * h)

    # forward transients: gated product inputs + output, mixed-precision fp32 rotary copies, LoRA fp32 branch
    # outputs, eager scores.
    fwd_t = max(2 * rb * T * h + ab * T * I * ktok, down_fwd)
    if c.mixed:
        fwd_t = max(fwd_t, 4 * T * (qd + kvd))
    if not c.full and c.lora_groups:
        widest = max((g.out_features for g in c.lora_groups if g.per_layer and g.module != PARAM_WRAPPER), default=0)
        if mlp_adapter_fwd and widest == max(o for n, _i, o, _m in roles.mlp_in if c.is_adapted(n)):
            fwd_t = max(fwd_t, mlp_adapter_fwd)  # the widest adapter is an MLP input: net of the MLP's later tensors
        else:
            fwd_t = max(fwd_t, adapter_out_bytes(c) * T * widest)  # base output, lora_B output, its scaled copy
    if attn_impl == "eager":
        fwd_t = max(fwd_t, eager_forward_transient(c) * B * nh * S * S)
    if plan.offload_activations and not plan.gradient_checkpointing:
        fwd_t = max(fwd_t, offloaded_mlp_forward(c, roles))
        if plan.trainer == "trl":  # TRL's own offloading: its forward stash (trl_offload_down_moment)
            fwd_t = max(fwd_t, trl_offload_down_moment(c, roles))

    # backward extras: MLP grads (3 intermediate-sized grads at the product's backward, next to the residual's
    # grad, which is the MLP output's: one hidden-sized grad, not two — +2.5 % on QLoRA blocks at 16k tokens before)
    # and the residual grad flow elsewhere (2 x hidden); SDPA/flash: dq/dk/dv + fp32 dq accumulator; eager: grad of
    # probs + fp32 softmax grad.
    flow = 2 * rb * T * h
    mlp_b = ((3 if gated else 2) * mab_global(c, roles) * T * I * ktok) - down
    if c.quant == "int8" and not plan.gradient_checkpointing and any(
            cons == roles.mlp_out and _saves_input_itself(c, b, cons) for b, _w, cons in int8_inputs(c, roles)):
        # the MLP intermediate down's adapter saves is MatMul8bitLt's ctx input too: down's backward does not free it
        # (Llama-3.2-1B cut to 4 blocks, int8 QLoRA bf16 with the chunked loss at 4k tokens: -2.8 % before)
        mlp_b += mab_global(c, roles) * T * I
    if not gated and c.autocast and mab_global(c, roles) == 2 and activation_name(spec) in POW_ACTS:
        # autocast gelu_new: the backward of 0.5·x (bf16) times the fp32 tanh branch holds the incoming bf16
        # gradient, its fp32 cast, both fp32 products and the bf16 cast of one: 16 bytes per element (traced op by
        # op on a replayed Phi block), fc2's saved input already freed
        mlp_b = max(mlp_b, 16 * T * I - down)
    if spec.num_experts and not roles.mlp_in:
        if experts_implementation(plan) == "grouped_mm":
            # fused experts' output path backward (transformers integrations/moe.py grouped_mm_experts_forward:
            # ``(proj_out * weights)[inv_perm].view(T, k, h).sum(1)``): the index backward's zeros + index_put and
            # the grad copy, k·T·h each, in the routing weights' dtype (measured with the simulate engine on
            # Mixtral); the eager loop's ``index_add_`` backward selects one expert's rows at a time
            mlp_b = max(mlp_b, 3 * routing_weight_bytes(c) * T * h * ktok)
        pw = param_wrapped(c)
        if pw:
            # ParamWrapper experts: each grouped matmul's backward makes the full-size gradient of its W' (param
            # dtype) before peft's parametrization reduces it to lora_A/lora_B grads: down's first (gate_up's W' still
            # saved), then gate_up's once down's W' is freed; with the down output's and input's grads alive.
            # Measured with the simulate engine on wide-expert tiny Qwen3-MoE shapes (tests/test_moe.py).
            w_d, w_gu = pw.get("down_proj", 0), pw.get("gate_up_proj", 0)
            if experts_implementation(plan) == "grouped_mm":
                mlp_b = max(mlp_b, c.wb * max(w_d, w_gu - w_d) + ab * T * ktok * (h + I))
            else:
                mlp_b = max(mlp_b, eager_expert_grads(c, w_gu, w_d))
        elif c.full and experts_implementation(plan) == "eager":
            stacks = prm.expert_stacks(c)
            mlp_b = max(mlp_b, eager_expert_grads(c, stacks.get("gate_up_proj", 0), stacks.get("down_proj", 0)))
    att_b = flow + ab * T * (qd + kv_w) + 4 * T * qd
    if attn_impl == "eager":
        # at the softmax backward: the probabilities' gradient in fp32 and the softmax's input gradient (fp32),
        # the compute-dtype probabilities already freed by the PV matmul's backward: (ab + 4) bytes per score net;
        # the gradient of the (repeated) values and the residual's. Already freed: what the output projection
        # saved and the values the PV matmul saved, what the later norms (Gemma 2: three) and the MLP saved: their
        # backward ran first, in a parallel block too (Phi, GPT-NeoX: the MLP runs after the attention in forward;
        # there the MLP branch's gradient of the shared norm output waits for the attention's). Traced op by op
        # with the simulated engine (tiny Llama, Gemma 2 and Phi blocks checkpointed: +2 … +15 % before, which kept
        # the values, the output copy and the MLP of a parallel block, and added the keys' gradient, made only at
        # the next matmul's backward when the scores' gradients are smaller).
        after = out_saved + out_copy + ab * T * kv_w * rep / 2
        norms_after = n_hidden_norms - (0 if c.sums.post_norms_only else 1)  # all but the attention's pre-norm
        after += norms_after * norm_saved(c, h, T, rb) + mlp
        grads_in = (2 if spec.parallel_attn else 1) * rb * T * h
        att_b = grads_in + (ab + 4) * B * nh * S * S + ab * T * qd - after
        if plan.offload_activations and not plan.gradient_checkpointing:
            # offloaded, the block's saves are on the host: the device holds the fp32 softmax output its backward
            # unpacked next to the two fp32 gradients (the cast's, unpacked by the PV matmul's backward, is freed)
            # and nothing the block saved after (tiny Llama and Gemma 2 blocks, LoRA bf16: -44 % and -37 % before)
            att_b = grads_in + 12 * B * nh * S * S + ab * T * qd
    lora_b = 0
    if not c.full:
        # peft LoRA backward of one adapted module (in -> out), the module's saved tensors still alive: first the
        # output side — the output grad's fp32 cast (pure bf16) and its scaled copy (4·T·out each) — freed by
        # lora_B's backward before lora_A's makes the grad of its input (4·T·in; then lora_A's saved input goes),
        # so the larger side, not both (down_proj, in = 4·out: +3 % at the top block's backward before, traced on
        # Llama-3.2-1B blocks at 16k tokens); plus one more fp32 hidden-sized grad.
        dense_gated = gated and not spec.num_experts
        up_width = sum(o * m for _n, _i, o, m in roles.mlp_in)  # gate + up outputs (one fused 2I or two I)
        for _n, i, o, m in roles.attn_in + roles.attn_out + roles.mlp_in + roles.mlp_out:
            if c.is_adapted(_n):
                t = T * (m if m > 1 else 1)
                n_out_grads = 1 if ab == 4 and not c.autocast else 2  # an fp32 grad needs no cast copy
                out_b = 4 * n_out_grads
                if c.autocast:
                    # under autocast the adapter's matmuls run in ab: the output grad and its scaled copy are ab,
                    # not fp32 (measured with the simulated engine on Phi-3 shapes; no Llama grid cell moves)
                    out_b = 2 * ab
                b = t * max(out_b * o, 4 * i) + 4 * T * h
                if (_n, i, o, m) in roles.attn_in + roles.attn_out:
                    b -= moe_saved  # the fused experts' backward (after the attention's forward) freed their saves
                if dense_gated and (_n, i, o, m) in roles.mlp_in:
                    # gate/up (or fused gate_up, Phi-3): their backward runs after the product's and the
                    # activation's, whose saved tensors (and down's) are freed by then; the gradients of both
                    # outputs (the two halves) are alive. Measured with the simulated engine on Phi-3 and Llama
                    # shapes (tests/test_simulate_vs_analytic.py).
                    b += ab * T * up_width - mlp_after
                lora_b = max(lora_b, b)
    # a norm over the MLP output back-propagates first, with every save of the block alive: an RMSNorm's backward
    # holds five fp32 T x h temporaries at once (through the weight, rsqrt, mean and pow; OLMo 2 blocks, LoRA + GC
    # with the chunked loss: -3.3 % before)
    norm_b = flow + RMS_BACKWARD_TEMPS * 4 * T * h if c.sums.post_mlp_norm and spec.norm_kind == "rms" else 0
    bwd_extra = int(max(rb * T * h + mlp_b, att_b, flow + lora_b, norm_b))
    alias = 0
    if spec.norm_kind != "rms" or rb == 4:
        alias = rb * T * h  # the first norm saves the block input tensor itself
    gc_extra = 0
    if c.quant == "int8":
        # the forward's distinct inputs of the quantized linears, in their own dtype, but the kept block input
        # (measured by the simulate engine; OLMo 3 / EXAONE 4 +7 % before the post-norm case)
        gc_extra = sum(x_bytes * T * width for x_bytes, width, _consumers in int8_inputs(c, roles, gc_kept=True))
    gc_recompute = int(mlp_adapter_fwd + 2 * rb * T * h + 4 * T * h + discount) if mlp_adapter_fwd else 0
    L = max(spec.num_layers, 1)
    return LayerActs(saved, L * saved - int(discount), saved - int(discount), gc_saved, int(fwd_t), bwd_extra,
                     int(down), int(alias), int(gc_extra), gc_recompute)


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
        return replace(la, saved=0, stack=sum(per), bottom=0, gc_alias=0, fwd_transient=fwd, bwd_extra=bwd,
                       gc_recompute=0, bwd_over_gradients=net)
    return replace(la, stack=sum(per), bottom=per[0], fwd_transient=fwd, bwd_extra=bwd, gc_recompute=0,
                   bwd_over_gradients=net)


def sliding_fraction(c: Ctx) -> float:
    """Share of the blocks whose attention SDPA runs with a materialized sliding-window mask: blocks attending
    within ``spec.sliding_window`` (``layer_types`` entries ``sliding_attention``; Qwen2 with
    ``use_sliding_window``: blocks from ``max_window_layers`` on; else every block) when the sequence is longer than
    the window — shorter, transformers skips the mask (``masking_utils._ignore_causal_mask_sdpa``)."""
    spec, w = c.spec, c.spec.sliding_window
    if not w or c.S <= w:
        return 0.0
    L = max(spec.num_layers, 1)
    kinds = spec.config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return sum(k == "sliding_attention" for k in kinds) / len(kinds)
    if spec.model_type == "qwen2":
        first = spec.config.get("max_window_layers")
        return (L - min(first if isinstance(first, int) else L, L)) / L
    return 1.0


def shared_forward_bytes(c: Ctx) -> int:
    """Tensors shared by all blocks during forward: rotary cos/sin (positions of batch 1) and the attention masks
    (:func:`forward_mask_bytes`)."""
    spec = c.spec
    cos_sin = 2 * c.S * spec.head_dim * c.rb if spec.model_type not in ("gpt2", "bert", "t5") else 0
    return cos_sin + forward_mask_bytes(c)


def forward_mask_bytes(c: Ctx) -> int:
    """The masks the model makes before its blocks: for eager a 4-D float causal mask (B x 1 x S x S in the
    residual dtype) per attention kind in ``layer_types`` (Gemma 2's full and sliding blocks: two), for SDPA with
    sliding-window blocks their boolean mask (S x S expanded over the batch; full-attention blocks run
    ``is_causal`` without one). No op saves them (``scores + mask``; SDPA saves its own additive copy, priced per
    block), so they die when the model's forward returns, before the loss — unless checkpointed blocks hold them as
    recompute arguments until their backward (measured with the simulated engine on tiny Llama blocks, eager fp32:
    the mask was priced at the loss, +2 % before). T5's zero cross-attention bias is saved by every SDPA: counted
    here, never freed early."""
    spec = c.spec
    impl = effective_attn(spec, c.plan.attn)
    kinds = spec.config.get("layer_types")
    n_kinds = len({k for k in kinds if str(k).endswith("attention")}) if isinstance(kinds, list) else 0
    mask = max(n_kinds, 1) * c.rb * c.B * c.S * c.S if impl == "eager" else 0  # one per attention kind
    if impl == "sdpa" and sliding_fraction(c):
        mask += c.S * c.S  # one boolean S x S, expanded (not copied) over the batch
    if spec.model_type == "t5" and impl != "eager":
        mask += c.ab * spec.num_heads * c.S * c.S  # the decoder's zero cross-attention bias, saved by every SDPA
    return mask


#: Models that scale the input embeddings in the model's forward, outside the embedding module (Granite's
#: ``embedding_multiplier``; Gemma scales inside its embedding module).
EMBEDDINGS_SCALED_IN_FORWARD = frozenset({"granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "falcon_h1",
                                          "hyperclovax", "recurrent_gemma"})


def embedding_leaf_bytes(c: Ctx) -> int:
    """Under checkpointing, transformers makes a frozen embedding's output require grad: a leaf its
    ``AccumulateGrad`` node keeps all step. Where the model scales it in its forward, block 0's input (a kept
    checkpoint input) is another tensor, so the leaf is one more T x h (traced with the simulated engine on a tiny
    Granite, LoRA + GC: -2 … -4 % before). Offloaded, the leaf is what stays on the device already."""
    spec = c.spec
    if (not c.plan.gradient_checkpointing or c.full or c.plan.offload_activations
            or spec.model_type not in EMBEDDINGS_SCALED_IN_FORWARD):
        return 0
    return c.rb * c.T * spec.hidden_size


def released_mask_bytes(c: Ctx) -> int:
    """Mask bytes gone after the model's forward (:func:`forward_mask_bytes`): all of them without checkpointing
    (T5's bias excepted), none with it."""
    if c.plan.gradient_checkpointing or c.spec.model_type == "t5":
        return 0
    return forward_mask_bytes(c)


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
