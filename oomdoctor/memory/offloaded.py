"""Activation offloading: what a block's forward still holds on the device when ``save_on_cpu`` moved its saves to
the host, the host bytes the hook packs beyond the block's saves, and what TRL's own offloading
(``OffloadActivations``) keeps on the device. Traced with the simulated engine; each term cites its measurement.
"""

from __future__ import annotations

from oomdoctor.memory.context import Ctx
from oomdoctor.memory.saves import (
    RMS_STATS_BYTES,
    adapted_mlp_inputs,
    adapter_out_bytes,
    adapter_reads_input,
    mab_global,
    quantized_linear,
)
from oomdoctor.model.quirks import effective_attn
from oomdoctor.model.roles import LayerRoles, layer_roles


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
    weights = (
        sum(
            g.weight_numel * g.count
            for g in spec.groups
            if g.kind == "linear" and g.per_layer and not (c.quant is not None and quantized_linear(spec, g.name))
        )
        // L
    )
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
            c.sums.hidden_norms_per_layer + heads
        )
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
