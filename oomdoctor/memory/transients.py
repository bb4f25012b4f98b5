"""A block's transients: the peak bytes its forward and its backward hold beyond what it saves for backward (the
gated product, LoRA's branch outputs, eager scores, the gradients of each sublayer's backward), and LoRA's moment in
block 0's recompute under checkpointing. Each term cites the trace it was measured on.
"""

from __future__ import annotations

from oomdoctor.memory import parameters as prm
from oomdoctor.memory.context import Ctx
from oomdoctor.memory.experts import eager_expert_grads, param_wrapped, routing_weight_bytes
from oomdoctor.memory.offloaded import offloaded_mlp_forward, trl_offload_down_moment
from oomdoctor.memory.saves import (
    RMS_BACKWARD_TEMPS,
    AttentionSaves,
    MlpSaves,
    adapted_mlp_inputs,
    adapter_out_bytes,
    bnb_skips_input_cast,
    hidden_norm_count,
    int8_inputs,
    mab_global,
    norm_saved,
    saves_input_itself,
)
from oomdoctor.model.execution import experts_implementation
from oomdoctor.model.lora_targets import PARAM_WRAPPER
from oomdoctor.model.quirks import POW_ACTS, activation_name
from oomdoctor.model.roles import LayerRoles


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


def mlp_input_adapter_forward(c: Ctx, roles: LayerRoles, mlp: MlpSaves) -> int:
    """LoRA: the forward of an MLP-input adapter (base output + lora_B output + its scaled copy: fp32 unless under
    autocast) runs before the MLP's later saved tensors exist, while the residual and the norm output are held by
    the running forward (and, pure bf16 with dropout, peft's fp32 cast of the input). The first MLP input (gate, or
    a fused gate_up) runs before every MLP save (``mlp.after_inputs``); a second one (up) after the first's output
    and activation are saved: only its own output and down's saves are still to come. Bytes beyond the block's
    saves; measured tensor by tensor with the simulated engine on Phi-3 shapes (fused gate_up, 2I wide) and on
    Llama-3.2-1B blocks at 16k tokens (up's adapter in the top block's recompute: -6 % before)."""
    T, rb, h = c.T, c.rb, c.spec.hidden_size
    worst = 0
    for w_in, w, first in adapted_mlp_inputs(c, roles):
        later = mlp.after_inputs if first else mab_global(c, roles) * T * w + mlp.down
        moment = int(adapter_out_bytes(c) * T * w - later + 2 * rb * T * h)
        if not c.mixed and rb != 4 and c.plan.lora_dropout > 0 and c.adapter_b == 4:
            moment += 4 * T * w_in
        worst = max(worst, moment)
    return worst


def down_adapter_copies(c: Ctx, roles: LayerRoles) -> tuple[int, int]:
    """(fp32 copies of the MLP product that are not saved, down's adapted input width) in the down adapter's
    forward: peft's cast of a 16-bit product to the fp32 adapter (autocast saves its 16-bit recast, made after; in
    pure 16-bit with dropout the dropout output is saved, and the product is alive next to it), and under autocast
    with dropout the fp32 dropout output (autocast saves lora_A's 16-bit cast of it; a bitsandbytes MLP's product is
    fp32 already). A bitsandbytes down under CUDA autocast: peft makes no copy of the product; the dropout output is
    in the product's dtype, a transient only when fp32 (a 16-bit one is what lora_A saves)."""
    w_down = max((i for n, i, _o, _m in roles.mlp_out if c.is_adapted(n)), default=0)
    mab, dropout = mab_global(c, roles), c.plan.lora_dropout > 0
    copies = (1 if mab == 2 and (c.autocast or dropout) else 0) + (1 if c.autocast and dropout else 0)
    if c.autocast and any(c.is_adapted(n) and bnb_skips_input_cast(c, n) for n, *_x in roles.mlp_out):
        copies = 1 if dropout and mab == 4 else 0
    return copies, w_down


def mlp_adapter_forward(c: Ctx, roles: LayerRoles, mlp: MlpSaves) -> tuple[int, int]:
    """(LoRA recompute moment, forward moment) of a dense MLP's adapters beyond the block's saves.

    The first is the costlier of :func:`mlp_input_adapter_forward` and the down adapter's forward in block 0's
    recompute, after every MLP save, next to the base output and the residual and norm output the running forward
    holds, with :func:`down_adapter_copies`. Traced op by op with the simulated engine: Llama-3.2-1B blocks at 16k
    tokens (-4.0 % before under autocast, -3.9 % with dropout 0.05 in bf16), Phi-3 shapes with dropout 0.05 (QLoRA
    + GC -5.2 % once the fused qkv was priced right, LoRA under autocast -2.3 % before; scripts/
    plans_vs_simulate.py --grid tests).

    The second: bf16 weights under a foreign trainer's autocast (Ctx.autocast), in the forward: the 16-bit product
    (down's input, which only lora_A's cast of peft's fp32 copy saves) is alive next to those copies, and so are the
    block input (the decoder's reference), the residual, the norm output and the embedding output (the model's
    ``inputs_embeds``). Traced op by op on a replayed TRL step (Llama-3.1-8B cut to 2 blocks, LoRA bf16 at 2k
    tokens: -2.1 % before)."""
    if c.full or not roles.mlp_in or c.spec.num_experts:
        return 0, 0
    T, rb, ab, h = c.T, c.rb, c.ab, c.spec.hidden_size
    recompute = mlp_input_adapter_forward(c, roles, mlp)
    forward = 0
    copies, w_down = down_adapter_copies(c, roles)
    if w_down and c.adapter_b == 4 and copies:
        mab = mab_global(c, roles)
        product = 2 * T * w_down if mab == 2 and not c.autocast else 0
        recompute = max(recompute, int(copies * 4 * T * w_down + product + ab * T * h + 2 * rb * T * h))
        if c.autocast and not c.mixed and not c.plan.gradient_checkpointing:
            forward = int(copies * 4 * T * w_down + mab * T * w_down + ab * T * h + 4 * rb * T * h)
    return recompute, forward


def forward_transient(c: Ctx, roles: LayerRoles, adapter_recompute: int, adapter_forward: int, attn_impl: str) -> float:
    """Peak bytes a block's forward holds beyond its saves: the gated product's inputs and output, the fp32 rotary
    copies under autocast, LoRA's branch outputs (the widest adapter; net of the MLP's later tensors when it is an
    MLP input), eager attention's scores (:func:`eager_forward_transient`), and with activations offloaded (no
    checkpointing) all a block's forward holds (``memory/offloaded``)."""
    spec, plan, T, rb, ab = c.spec, c.plan, c.T, c.rb, c.ab
    h, I = spec.hidden_size, spec.intermediate_size
    qd, kvd = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    fwd_t = max(2 * rb * T * h + ab * T * I * roles.mlp_tokens, adapter_forward)
    if c.mixed:
        fwd_t = max(fwd_t, 4 * T * (qd + kvd))
    if not c.full and c.lora_groups:
        widest = max((g.out_features for g in c.lora_groups if g.per_layer and g.module != PARAM_WRAPPER), default=0)
        if adapter_recompute and widest == max(o for n, _i, o, _m in roles.mlp_in if c.is_adapted(n)):
            fwd_t = max(fwd_t, adapter_recompute)  # the widest adapter is an MLP input: net of the MLP's later tensors
        else:
            fwd_t = max(fwd_t, adapter_out_bytes(c) * T * widest)  # base output, lora_B output, its scaled copy
    if attn_impl == "eager":
        fwd_t = max(fwd_t, eager_forward_transient(c) * c.B * spec.num_heads * c.S * c.S)
    if plan.offload_activations and not plan.gradient_checkpointing:
        fwd_t = max(fwd_t, offloaded_mlp_forward(c, roles))
        if plan.trainer == "trl":  # TRL's own offloading: its forward stash (trl_offload_down_moment)
            fwd_t = max(fwd_t, trl_offload_down_moment(c, roles))
    return fwd_t


def residual_flow(c: Ctx) -> int:
    """The residual gradient flowing past a block's backward: two hidden-sized tensors in the residual dtype."""
    return 2 * c.rb * c.T * c.spec.hidden_size


def mlp_backward(c: Ctx, roles: LayerRoles, down: float) -> float:
    """Bytes beyond the block's saves at the MLP's backward: three intermediate-sized gradients at the product's
    backward (two for a plain MLP), down's saves freed; what LLM.int8() keeps, autocast ``gelu_new``'s fp32 branch,
    the fused experts' output path and the expert weights' gradients add."""
    spec, plan, T = c.spec, c.plan, c.T
    I, ktok = spec.intermediate_size, roles.mlp_tokens
    gated = spec.mlp_kind == "gated"
    mlp_b = ((3 if gated else 2) * mab_global(c, roles) * T * I * ktok) - down
    if (
        c.quant == "int8"
        and not plan.gradient_checkpointing
        and any(cons == roles.mlp_out and saves_input_itself(c, b, cons) for b, _w, cons in int8_inputs(c, roles))
    ):
        # the MLP intermediate down's adapter saves is MatMul8bitLt's ctx input too: down's backward does not free it
        # (Llama-3.2-1B cut to 4 blocks, int8 QLoRA bf16 with the chunked loss at 4k tokens: -2.8 % before)
        mlp_b += mab_global(c, roles) * T * I
    if not gated and c.autocast and mab_global(c, roles) == 2 and activation_name(spec) in POW_ACTS:
        # autocast gelu_new: the backward of 0.5·x (bf16) times the fp32 tanh branch holds the incoming bf16
        # gradient, its fp32 cast, both fp32 products and the bf16 cast of one: 16 bytes per element (traced op by
        # op on a replayed Phi block), fc2's saved input already freed
        mlp_b = max(mlp_b, 16 * T * I - down)
    if spec.num_experts and not roles.mlp_in:
        mlp_b = max(mlp_b, fused_experts_backward(c, roles))
    return mlp_b


def fused_experts_backward(c: Ctx, roles: LayerRoles) -> float:
    """Bytes the fused experts' backward holds (0 when nothing below applies)."""
    spec, plan, T, ab = c.spec, c.plan, c.T, c.ab
    h, I, ktok = spec.hidden_size, spec.intermediate_size, roles.mlp_tokens
    worst = 0.0
    if experts_implementation(plan) == "grouped_mm":
        # fused experts' output path backward (transformers integrations/moe.py grouped_mm_experts_forward:
        # ``(proj_out * weights)[inv_perm].view(T, k, h).sum(1)``): the index backward's zeros + index_put and
        # the grad copy, k·T·h each, in the routing weights' dtype (measured with the simulate engine on
        # Mixtral); the eager loop's ``index_add_`` backward selects one expert's rows at a time
        worst = max(worst, 3 * routing_weight_bytes(c) * T * h * ktok)
    pw = param_wrapped(c)
    if pw:
        # ParamWrapper experts: each grouped matmul's backward makes the full-size gradient of its W' (param
        # dtype) before peft's parametrization reduces it to lora_A/lora_B grads: down's first (gate_up's W' still
        # saved), then gate_up's once down's W' is freed; with the down output's and input's grads alive.
        # Measured with the simulate engine on wide-expert tiny Qwen3-MoE shapes (tests/test_moe.py).
        w_d, w_gu = pw.get("down_proj", 0), pw.get("gate_up_proj", 0)
        if experts_implementation(plan) == "grouped_mm":
            worst = max(worst, c.wb * max(w_d, w_gu - w_d) + ab * T * ktok * (h + I))
        else:
            worst = max(worst, eager_expert_grads(c, w_gu, w_d))
    elif c.full and experts_implementation(plan) == "eager":
        stacks = prm.expert_stacks(c)
        worst = max(worst, eager_expert_grads(c, stacks.get("gate_up_proj", 0), stacks.get("down_proj", 0)))
    return worst


def attention_backward(c: Ctx, attn: AttentionSaves, mlp: MlpSaves) -> float:
    """Bytes beyond the block's saves at the attention's backward. SDPA/flash: the residual flow, dq/dk/dv and the
    fp32 dq accumulator.

    Eager, at the softmax backward: the probabilities' gradient in fp32 and the softmax's input gradient (fp32),
    the compute-dtype probabilities already freed by the PV matmul's backward: (ab + 4) bytes per score net; the
    gradient of the (repeated) values and the residual's. Already freed: what the output projection saved and the
    values the PV matmul saved, what the later norms (Gemma 2: three) and the MLP saved: their backward ran first,
    in a parallel block too (Phi, GPT-NeoX: the MLP runs after the attention in forward; there the MLP branch's
    gradient of the shared norm output waits for the attention's). Traced op by op with the simulated engine (tiny
    Llama, Gemma 2 and Phi blocks checkpointed: +2 … +15 % before, which kept the values, the output copy and the
    MLP of a parallel block, and added the keys' gradient, made only at the next matmul's backward when the scores'
    gradients are smaller). Offloaded without checkpointing, the block's saves are on the host: the device holds
    the fp32 softmax output its backward unpacked next to the two fp32 gradients (the cast's, unpacked by the PV
    matmul's backward, is freed) and nothing the block saved after (tiny Llama and Gemma 2 blocks, LoRA bf16: -44 %
    and -37 % before)."""
    spec, plan, T, B, S, ab, rb = c.spec, c.plan, c.T, c.B, c.S, c.ab, c.rb
    h, nh = spec.hidden_size, spec.num_heads
    qd = nh * spec.head_dim
    att_b = residual_flow(c) + ab * T * (qd + attn.kv_width) + 4 * T * qd
    if attn.impl != "eager":
        return att_b
    after = attn.out_saved + attn.out_copy + ab * T * attn.kv_width * attn.kv_repeat / 2
    norms_after = hidden_norm_count(c) - (0 if c.sums.post_norms_only else 1)  # all but the attention's pre-norm
    after += norms_after * norm_saved(c, h, T, rb) + mlp.total
    grads_in = (2 if spec.parallel_attn else 1) * rb * T * h
    att_b = grads_in + (ab + 4) * B * nh * S * S + ab * T * qd - after
    if plan.offload_activations and not plan.gradient_checkpointing:
        att_b = grads_in + 12 * B * nh * S * S + ab * T * qd
    return att_b


def lora_backward(c: Ctx, roles: LayerRoles, mlp: MlpSaves) -> float:
    """peft LoRA backward of one adapted module (in -> out), the module's saved tensors still alive: first the
    output side — the output grad's fp32 cast (pure bf16) and its scaled copy (4·T·out each) — freed by lora_B's
    backward before lora_A's makes the grad of its input (4·T·in; then lora_A's saved input goes), so the larger
    side, not both (down_proj, in = 4·out: +3 % at the top block's backward before, traced on Llama-3.2-1B blocks at
    16k tokens); plus one more fp32 hidden-sized grad. The costliest adapted module's, 0 for a full fine-tune."""
    if c.full:
        return 0
    spec, T, ab, h = c.spec, c.T, c.ab, c.spec.hidden_size
    dense_gated = spec.mlp_kind == "gated" and not spec.num_experts
    up_width = sum(o * m for _n, _i, o, m in roles.mlp_in)  # gate + up outputs (one fused 2I or two I)
    lora_b = 0
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
                b -= mlp.experts  # the fused experts' backward (after the attention's forward) freed their saves
            if dense_gated and (_n, i, o, m) in roles.mlp_in:
                # gate/up (or fused gate_up, Phi-3): their backward runs after the product's and the
                # activation's, whose saved tensors (and down's) are freed by then; the gradients of both
                # outputs (the two halves) are alive. Measured with the simulated engine on Phi-3 and Llama
                # shapes (tests/test_simulate_vs_analytic.py).
                b += ab * T * up_width - mlp.after_inputs
            lora_b = max(lora_b, b)
    return lora_b


def post_mlp_norm_backward(c: Ctx) -> int:
    """A norm over the MLP output back-propagates first, with every save of the block alive: an RMSNorm's backward
    holds five fp32 T x h temporaries at once (through the weight, rsqrt, mean and pow; OLMo 2 blocks, LoRA + GC
    with the chunked loss: -3.3 % before)."""
    if c.sums.post_mlp_norm and c.spec.norm_kind == "rms":
        return residual_flow(c) + RMS_BACKWARD_TEMPS * 4 * c.T * c.spec.hidden_size
    return 0


def backward_extra(c: Ctx, roles: LayerRoles, attn: AttentionSaves, mlp: MlpSaves) -> int:
    """Peak bytes a block's backward holds beyond its saves: the largest of the MLP's (next to the residual's
    gradient, which is the MLP output's: one hidden-sized grad, not two — +2.5 % on QLoRA blocks at 16k tokens
    before), the attention's, a LoRA adapter's and a post-MLP norm's."""
    rb, T, h = c.rb, c.T, c.spec.hidden_size
    return int(
        max(
            rb * T * h + mlp_backward(c, roles, mlp.down),
            attention_backward(c, attn, mlp),
            residual_flow(c) + lora_backward(c, roles, mlp),
            post_mlp_norm_backward(c),
        )
    )
