"""What one module of a block saves for backward, as Hugging Face's modeling code, peft and bitsandbytes run it: a
norm, the linears reading one tensor (and their LoRA adapters), LLM.int8()'s kept inputs, the attention output
the output projection reads. The building blocks of the per-block formulas (``memory/activations``) and of the
offloading terms (``memory/offloaded``); each cites the code it counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.memory.context import Ctx
from oomdoctor.model.quirks import CONCATENATED_QUERY, FP32_PRODUCT_NORMS, effective_attn
from oomdoctor.model.roles import LayerRoles, layer_roles
from oomdoctor.model.spec import ModelSpec

#: Per-token fp32 statistics an RMSNorm saves (rsqrt of the variance).
RMS_STATS_BYTES = 4


#: fp32 T x dim temporaries an RMSNorm's backward holds at its peak (the simulated engine: the weight's and the
#: normalization's gradients, mean's expand, pow's backward and its scaling).
RMS_BACKWARD_TEMPS = 5


#: Per-token fp32 statistics a LayerNorm saves (mean and rstd).
LN_STATS_BYTES = 8


def mab_global(c: Ctx, roles: LayerRoles) -> int:
    """Bytes per element of the MLP intermediates (fp32 when bitsandbytes layers run under autocast)."""
    return 4 if bnb_outputs_fp32(c, roles.mlp_in) else c.ab


def bnb_outputs_fp32(c: Ctx, linears) -> bool:
    """bitsandbytes ``Linear4bit``/``Linear8bitLt`` return ``out.to(input dtype)``: under autocast their inputs are
    fp32 norm outputs, so a quantized one among ``linears`` (role tuples) outputs fp32."""
    return c.quant is not None and c.mixed and any(quantized_linear(c.spec, n) for n, *_x in linears)


def quantized_linear(spec: ModelSpec, name: str) -> bool:
    for g in spec.groups:
        if g.name == name and g.kind == "linear" and g.per_layer:
            return g.quantizable
    return False


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
    if x_bytes != c.adapter_b and not (c.autocast and bnb_skips_input_cast(c, name)):
        return False  # peft's copy to the adapter's dtype
    return not (c.autocast and x_bytes == 4)


def bnb_skips_input_cast(c: Ctx, name: str) -> bool:
    """peft's bitsandbytes LoRA layers copy their input to the adapter's dtype only when
    ``torch.is_autocast_enabled()`` is false — a CUDA question, so under CUDA autocast they skip the copy (under CPU
    autocast they make it, as every non-bitsandbytes LoRA layer does: ``tuners/lora/bnb.py``)."""
    return c.quant is not None and quantized_linear(c.spec, name) and c.device == "cuda"


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
    return [(b, w, cons) for b, w, cons in out if any(quantized_linear(spec, n) for n, *_x in cons)]


def int8_held_only(c: Ctx) -> int:
    """Bytes of a block's LLM.int8() inputs only ``MatMul8bitLt``'s ctx keeps (no save holds that tensor): part of
    what the block keeps without checkpointing, on the device even with activations offloaded. The output
    projection's input is SDPA's saved output where :func:`attn_saves_output` (Llama blocks in pure bf16 without the
    k-bit upcast, or with LoRA dropout: +16 KiB per block of tiny Llama at 128 tokens over the replay before)."""
    if c.quant != "int8":
        return 0
    roles = layer_roles(c.spec)
    return sum(
        x_bytes * c.T * width
        for x_bytes, width, consumers in int8_inputs(c, roles)
        if not saves_input_itself(c, x_bytes, consumers) and not (consumers == roles.attn_out and attn_saves_output(c))
    )


def attn_saves_output(c: Ctx) -> bool:
    """Whether the output projection's input is the very tensor SDPA/flash saved (its output, reshaped as a view).
    Partial rotary concatenates the rotated and passed parts of q: q reaches SDPA contiguous in (B, heads, S, hd),
    flash lays its output out like the query (CUDA ``mha_fwd``'s ``empty_like(q)``, the CPU kernel alike), and the
    ``transpose(1, 2).contiguous()`` before the output projection copies it (measured tensor by tensor on replayed
    Phi blocks; other models' q keeps the projection's (B, S, heads, hd) layout). Eager attention's output is a
    fresh contiguous copy."""
    return effective_attn(c.spec, c.plan.attn) != "eager" and c.spec.model_type not in CONCATENATED_QUERY


def saves_input_itself(c: Ctx, x_bytes: int, consumers) -> bool:
    """Whether an adapted consumer of the tensor saves that very tensor (``adapter_reads_input``)."""
    return any(c.is_adapted(name) and adapter_reads_input(c, name, x_bytes) for name, *_x in consumers)


def adapter_out_bytes(c: Ctx) -> int:
    """Bytes per output element a LoRA module's forward holds at once: the base output, lora_B's output and its
    scaled copy — in the compute dtype under autocast, else the latter two fp32."""
    return 3 * c.ab if c.autocast else c.ab + 2 * c.adapter_b


def adapted_mlp_inputs(c: Ctx, roles: LayerRoles) -> list[tuple[int, int, bool]]:
    """(in, out, runs first) of the adapted MLP-input linears, in the order the MLP runs them (gate, then up; a
    fused gate_up alone)."""
    first = roles.mlp_in[0][0] if roles.mlp_in else None
    return [(i, o, n == first) for n, i, o, _m in roles.mlp_in if c.is_adapted(n)]


def m_tok(c: Ctx, m: float) -> float:
    """Token multiplier of a group with ``m`` instances per layer: dense groups see every token once per instance."""
    return m


@dataclass(frozen=True)
class AttentionSaves:
    """What one block's attention saves for backward, with the parts its backward formula reads."""

    total: float
    """Bytes saved: the input linears (and adapters), the kernel's saves per attention block, the output projection."""
    out_saved: float
    """Bytes the output projection (and its adapter) saves."""
    out_copy: int
    """Eager attention: the contiguous output copy a trainable output projection saves (0 otherwise)."""
    kv_width: float
    """Width of k and v together per token (a fused qkv's outputs beyond q)."""
    kv_repeat: float
    """Eager attention: how many times GQA repeats k/v to the query heads (1.0 without GQA or for fused kernels)."""
    impl: str
    """The attention implementation the model really runs (:func:`~oomdoctor.model.quirks.effective_attn`)."""


@dataclass(frozen=True)
class MlpSaves:
    """What one block's MLP (dense or experts) saves for backward, with the parts the other terms read."""

    total: float
    """Bytes saved by the MLP: its input linears, intermediates, output linear (experts: router and routing too)."""
    down: float
    """Bytes saved by the MLP output linear(s) (0 for fused experts)."""
    after_inputs: float
    """Dense MLPs: what the MLP saves after its input linears (0 for MoE)."""
    experts: float
    """Fused experts: what they save that is freed before the attention's backward runs (0 otherwise)."""


def hidden_norm_count(c: Ctx) -> int:
    """Norms over the hidden size in one block (a parallel block has one, Llama two, Gemma 2 four)."""
    return c.sums.hidden_norms_per_layer or (1 if c.spec.parallel_attn else 2)
