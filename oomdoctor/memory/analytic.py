"""Analytic memory model: formulas only, no torch import, sub-millisecond per plan.

``estimate_analytic(spec, plan)`` sums the component modules (``parameters``, ``lora``, ``gradients``,
``optimizer``, ``activations``, ``logits``, ``runtime``) over a timeline of the steady-state training step (step >= 2,
so the optimizer states exist) as the real Hugging Face step allocates it:

* ``forward``: weights + optimizer states (+ gradients when ``grad_accum > 1``) + AMP weight copies + every saved
  activation + the loss's logits (logits, fp32 upcast, log-probabilities) at the end of forward;
* ``backward``: the largest of (a) the loss backward (log-probabilities, their gradient and the logits' gradient),
  (b) the top block's backward (all activations still saved, head gradient allocated), (c) the bottom block's
  backward (nearly every gradient allocated, one block's activations left; under gradient checkpointing the block
  is recomputed), (d) the end of backward (all gradients);
* ``optimizer-step``: weights + gradients + states + the step's temporaries (activations are freed).

Peaks: ``peak_allocated`` = the largest phase (tensor bytes, what a TorchDispatchMode / ``max_memory_allocated``
counts, minus the cuBLAS workspace); ``peak_reserved`` = allocated + allocator slack + cuBLAS workspace (allocator
blocks); ``peak_device`` (nvidia-smi) = reserved + CUDA context + bitsandbytes paged optimizer state (unified memory
outside the allocator, counted as resident: it only pages out under memory pressure).

Per rank (``plan.world_size`` > 1 or a strategy other than ``single``): ``sharding.py`` turns the single-GPU terms
into one rank's (shards, gathered units, buckets), adds a ``load`` phase (the weights while the model loads) and
NCCL's buffers at the device level; the activations are those of the per-rank micro-batch.
"""

from __future__ import annotations

from oomdoctor.memory import activations as act
from oomdoctor.memory import gradients as grads
from oomdoctor.memory import logits as lgt
from oomdoctor.memory import optimizer as optm
from oomdoctor.memory import parameters as prm
from oomdoctor.memory import runtime as rt
from oomdoctor.memory import sharding as shd
from oomdoctor.memory.breakdown import TENSOR_COMPONENTS, MemoryBreakdown
from oomdoctor.memory.context import Ctx, make_ctx
from oomdoctor.memory.lora import adapter_bytes
from oomdoctor.memory.masks import released_mask_bytes, shared_forward_bytes
from oomdoctor.memory.measured import BlockSaves
from oomdoctor.memory.offloaded import offload_repacks, trl_offload_final_kept, trl_offload_kept
from oomdoctor.memory.saves import int8_held_only, norm_saved
from oomdoctor.model.execution import upcast_to_fp32
from oomdoctor.model.quirks import effective_attn
from oomdoctor.model.roles import layer_roles
from oomdoctor.model.spec import HEAD_NAMES, ModelSpec
from oomdoctor.plan import Plan


def _persistent_tensors(c: Ctx, opt: optm.OptimizerMemory) -> list[tuple[int, int]]:
    """(bytes, count) of the long-lived tensors, for the allocator's per-block rounding."""
    out: list[tuple[int, int]] = []
    n_states = 0
    if opt.device:
        n_states = 2 if c.plan.optimizer in ("adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit") else 1
    for g in c.spec.groups:
        w = g.weight_numel * c.wb
        if c.quant is not None and prm.is_quantized(g):
            w = prm.nf4_weight_bytes(g.weight_numel) if c.quant != "int8" else g.weight_numel
        k = g.count * ((1 + 1 + n_states) if c.full and not g.tower else 1)
        out.append((w, k))
        if g.bias_numel:
            out.append((g.bias_numel * c.wb, k))
    if not c.full:
        r = c.plan.lora_r
        for g in c.lora_groups:
            out.append((r * g.in_features * 4, g.count * (2 + n_states)))
            out.append((r * g.out_features * 4, g.count * (2 + n_states)))
    return out


def _loss_packed(c: Ctx, lg: lgt.LogitsMemory, M_head: int) -> int:
    """Host bytes ``save_on_cpu`` packs outside the blocks: the final norm's saves (a 16-bit RMSNorm's fp32 input
    twice, by ``pow`` and by ``mul``); under the standard loss the log-probabilities, packed twice (saved by
    ``log_softmax`` and by ``nll_loss``: torch's hook packs each save), and the head's weight its matmul saves for
    the input gradient (its autocast cast under ``*-mixed``; fp32 when peft's k-bit preparation upcast it); the
    chunked loss packs its chunks' inputs, the normed hidden states. Traced with the simulated engine (Llama-3.2-1B
    blocks at 4k tokens: the host bytes were 4.6 GB short, then 5-7 % with the chunked loss)."""
    if c.spec.arch_kind != "decoder":
        return 0
    h = c.spec.hidden_size
    final = norm_saved(c, h, c.T, c.rb) + (4 * c.T * h if c.spec.norm_kind == "rms" else 0)
    if c.plan.loss == "chunked":
        return final + c.rb * c.T * h
    weight = M_head if c.mixed else prm.head_weight_numel(c) * c.wb
    return final + 2 * lg.saved + weight


def _components(**kw) -> dict[str, int]:
    d = {k: 0 for k in TENSOR_COMPONENTS}
    for k, v in kw.items():
        d[k] = int(max(v, 0))
    return d


def estimate_analytic(
    spec: ModelSpec, plan: Plan, *, device: str = "cuda", blocks: BlockSaves | None = None
) -> MemoryBreakdown:
    """Memory breakdown of one training step of ``spec`` under ``plan`` from formulas alone.

    ``blocks``: what each block saves for backward, measured by replaying the blocks (``engines/blocks.py``), for
    blocks the formulas do not know; every other term stays a formula.

    ``device="cpu"`` prices the same step as PyTorch runs it on the CPU (used by the CPU-vs-analytic tests): LoRA
    dropout keeps an fp32 noise tensor instead of CUDA's bool mask, and there is no CUDA context/workspace.
    """
    c = make_ctx(spec, plan, device)
    L = max(spec.num_layers, 1)
    gc = plan.gradient_checkpointing
    ga = plan.grad_accum > 1

    # ---- model states
    P = prm.parameter_bytes(c)
    A = adapter_bytes(c)
    G = grads.gradient_bytes(c)
    opt = optm.optimizer_memory(c)
    O = opt.device

    # ---- AMP weight copies (see parameters.amp_weight_copy_bytes)
    M_all = prm.amp_weight_copy_bytes(c)
    M_layer = prm.amp_weight_copy_bytes(c, layers=1)
    M_head = M_all - prm.amp_weight_copy_bytes(c, layers=L)
    if gc:
        # Non-reentrant checkpointing drops the saved casts; the autocast cache keeps the trainable ones for the
        # forward only. Forward end: trainable casts (cached) + the head's; backward: one block's + the head's.
        trainable_casts = (c.cast_lora_numel * 2) if not c.full else M_all
        M_fwd = min(M_all, trainable_casts + M_head) if c.autocast else 0
        M_top = M_layer
    else:
        M_fwd = M_all
        M_top = M_all - M_head  # the head's copy dies with the head's backward, before the top block's
    M_bottom = M_layer
    if blocks is not None and blocks.checkpointed:
        M_top = M_bottom = 0  # a measured checkpointed block's backward transient holds its recompute's casts
    M_loss = M_head if gc else M_fwd
    unpack_tmp = 0
    if plan.offload_activations:
        # save_on_cpu packs EVERY tensor saved for backward to the host, the low-precision weight casts that matmuls
        # save included (torch/autograd/graph.py ``save_on_cpu``; oomdoctor train uses it as is on CUDA; checked
        # against the simulated engine, tests/test_simulate_vs_analytic.py). On the device stay only the autocast
        # cache's casts of trainable leaf weights, until the autocast region exits at the end of the forward.
        # In backward each node unpacks its own saved tensors: one weight (cast or frozen parameter) copied back at a
        # time, a transient — without checkpointing: a checkpointed block packs only its input, and its recompute
        # (outside save_on_cpu) keeps its saves on the device (Llama-3.2-1B blocks at 16k tokens: +1 % before).
        trainable_casts = (c.cast_lora_numel * 2) if not c.full else M_all
        M_fwd = min(M_all, trainable_casts) if c.autocast else 0
        M_loss = 0
        if not gc:  # a checkpointed block's recompute runs in backward, outside save_on_cpu: its casts stay
            M_top = M_bottom = 0
        unpack_tmp = (
            0
            if gc
            else max(
                (
                    g.weight_numel
                    for g in spec.groups
                    if g.kind == "linear" and g.per_layer and not (c.quant is not None and prm.is_quantized(g))
                ),
                default=0,
            )
            * (2 if c.mixed else c.wb)
        )

    # ---- activations
    la = act.measured_layer_activations(c, blocks) if blocks else act.layer_activations(c)
    released = released_mask_bytes(c)  # masks alive in the blocks' forward, gone from the loss on
    shared = shared_forward_bytes(c) - released + act.embedding_leaf_bytes(c)
    fin = act.final_saved(c, blocks)
    lg = lgt.logits_memory(c)
    if gc:
        layers_saved = L * (la.gc_saved + la.gc_extra)
        recompute = la.saved - la.gc_alias
    else:
        layers_saved = la.stack
        recompute = 0
    cpu_act = unpack_top = unpack_bottom = 0
    if plan.offload_activations:
        # save_on_cpu: packed tensors go to pinned host memory; one block's tensors are on the device while it
        # runs (forward) or is back-propagated (unpacked copies).
        # The device holds what the running node unpacks, not a whole block: price the block's backward transients.
        # Under checkpointing a frozen embedding's output is made to require grad (transformers'
        # enable_input_require_grads): a leaf, which its AccumulateGrad node keeps on the device all step (block 0's
        # input; traced with the simulated engine).
        kept = la.gc_saved if gc and not c.full else 0
        # LLM.int8() keeps its layers' inputs as ctx attributes, which the saved-tensor hooks never see: on the device
        # (and, without checkpointing, on the host too where an adapter saves the same tensor)
        kept += L * la.gc_extra
        if gc:  # each checkpointed block packs its input alone, the leaf embedding output too (LoRA: also kept)
            cpu_act = layers_saved - L * la.gc_extra
            cpu_act += _loss_packed(c, lg, M_head)
        elif plan.trainer == "trl":
            # TRL's own offloading: every save but parameters goes to the host once (the final norm's and the fused
            # head's too: ``fin``, ``lg.saved``); a tensor saved again while its first save is in the forward stash
            # stays on the device as well (offloaded.trl_offload_kept: 0 for block 0's first norm under LoRA)
            kept += L * trl_offload_kept(c) - (trl_offload_final_kept(c) if not c.full else 0)
            kept += trl_offload_final_kept(c)
            cpu_act = (
                layers_saved
                - L * int8_held_only(c)
                + fin
                + lg.saved
                + (L * prm.amp_weight_copy_bytes(c, 1) if c.mixed else 0)
            )
            unpack_tmp = unpack_tmp if c.mixed else 0  # frozen 16-bit weights are parameters: never unpacked
        else:  # every save, once per save (offload_repacks), but LLM.int8()'s inputs only its ctx holds
            cpu_act = layers_saved - L * int8_held_only(c) + L * offload_repacks(c)
            cpu_act += _loss_packed(c, lg, M_head)
        layers_saved = kept  # a checkpointed block's recompute (in backward, outside save_on_cpu) stays on the device
        if gc and (spec.norm_kind != "rms" or c.rb == 4):
            # offloaded, a block's input comes back from the host for its recompute and stays through the block's
            # backward when its first norm saves that tensor itself (an fp32 RMSNorm input, a LayerNorm; a 16-bit
            # RMSNorm saves an fp32 copy): the formulas' recompute leaves it out (``gc_alias``: kept with the
            # inputs), and a measured block's backward starts with its input alive (the measurement does not
            # offload) — next to the embedding output kept above (LoRA); in a full fine-tune block 0's unpacked
            # input is the bottom moment's kept input itself, as it is for the formulas' bottom moment
            unpack_top = la.gc_saved
            unpack_bottom = la.gc_saved if not c.full and blocks is not None and blocks.checkpointed else 0
    A_end = layers_saved + fin + shared

    # ---- gradients along backward
    G_emb = grads.embedding_gradient_bytes(c)
    G_head = grads.head_gradient_bytes(c)
    G_layer = grads.per_layer_gradient_bytes(c)
    G_pre = G if ga else 0
    bwd_bottom = la.bwd_extra  # the bottom moment's transient (below: a measured block's, net of its gradients)
    if plan.optimizer_in_backward:
        # each gradient is stepped and freed in its post-accumulate-grad hook: one parameter's gradient (and the
        # step's temporary of its size) at a time, nothing left at the end of backward (torchtune optimizer_in_bwd)
        g_one = max((n for n, _r, _k in optm.trainable_tensors(c)), default=0) * grads.param_bytes_per_trainable(c)
        g_top = g_bottom = 2 * g_one
        g_end = 0
    elif ga:
        # accumulation: grads exist from the first micro-batch; each new grad is a transient added in place.
        g_end = 0
        g_new = max((n for n, _r, _k in optm.trainable_tensors(c)), default=0) * grads.param_bytes_per_trainable(c)
        g_top = g_bottom = g_new
    else:
        g_top = G_head
        roles = layer_roles(spec)
        down_frac = 0.0
        if c.full and c.sums.per_layer_numel:
            down_frac = sum(i * o * m for _n, i, o, m in roles.mlp_out) / c.sums.per_layer_numel
        g_bottom = max(0, G - G_emb - int(G_layer * (1 - down_frac))) + grads.tied_weight_gradient_bytes(c)
        g_end = G
        if la.bwd_over_gradients is not None:
            # a measured transient holds its block's own gradients, which ``g_bottom`` counts as made but block 0's
            # average share: the worst block's share instead (Jamba's MoE blocks make far more than the average;
            # full fine-tune + GC: +3.2 % before)
            bwd_bottom = min(la.bwd_extra, la.bwd_over_gradients + int(G_layer * (1 - down_frac)))

    phases: dict[str, tuple[int, dict[str, int]]] = {}
    # ---- per rank: the strategy's shards, gathered units and buckets on top of the single-GPU terms (sharding.py)
    rs = shd.rank_states(c, shd.single_terms(c))

    def rank(moment: str, d: dict[str, int]) -> dict[str, int]:
        return d if plan.strategy == "single" else _per_rank(moment, d, rs)

    # forward: end of forward (loss) or the last block's working set
    fwd_extra_logits, M_at_loss = lg.forward_peak, M_fwd
    if plan.loss == "chunked" and spec.arch_kind == "decoder" and c.mixed and not c.full and not lgt.fused_head(plan):
        # the frozen head's cast is neither cached by autocast nor saved by a checkpointed chunk: it lives through
        # one chunk's matmul, in forward and in each chunk's recompute, which runs on the device even when the
        # saved activations are offloaded (traced with the simulated engine)
        fwd_extra_logits = max(lg.forward_peak, M_head + lg.head_output)
        if plan.offload_activations:
            M_loss = M_head
        else:
            M_at_loss = max(0, M_fwd - M_head)
    fwd_tmp = la.fwd_transient
    at_head = A_end
    if plan.offload_activations and plan.trainer == "trl" and gc:
        # TRL's offloading, checkpointed: at the head its forward stash still holds the last block's input (packed
        # by the checkpoint, copied to the host, kept until 5 more packs) and the final norm's twice-saved tensors
        # stay on the device (offloaded.trl_offload_kept)
        at_head += c.rb * c.T * spec.hidden_size + trl_offload_final_kept(c) - 4 * c.T * spec.hidden_size
    fwd_at_loss = _components(
        parameters=P,
        master_weights=M_at_loss,
        gradients=G_pre,
        optimizer_states=O,
        activations=at_head,
        logits=fwd_extra_logits,
    )
    in_block = A_end - fin + released
    if plan.offload_activations and plan.trainer == "trl" and not gc:
        in_block -= trl_offload_final_kept(c)  # the final norm has not run yet
    fwd_in_block = _components(
        parameters=P,
        master_weights=M_fwd,
        gradients=G_pre,
        optimizer_states=O,
        activations=in_block,
        temporaries=fwd_tmp,
    )
    fwd = max(
        rank("forward" + shd.LOSS_MOMENT, fwd_at_loss), rank("forward", fwd_in_block), key=lambda d: sum(d.values())
    )
    phases["forward"] = (sum(fwd.values()), fwd)

    # backward candidates
    cands = []
    # (a) loss backward: under GC the forward's autocast cache is gone (cleared when the autocast region exits)
    # and checkpointed blocks saved no casts: only the head's copy is left.
    # offloaded, the final norm's saves are on the host once the forward has returned (the head's backward
    # unpacks its input later: tiny Llama, Qwen3, Granite blocks, LoRA bf16 offloaded: +2.4 … +2.9 % before)
    at_loss = _components(
        parameters=P,
        master_weights=M_loss,
        gradients=G_pre,
        optimizer_states=O,
        activations=A_end - (fin if plan.offload_activations else 0),
        logits=lg.backward_peak,
    )
    top_acts = layers_saved + shared + (recompute if (gc or plan.offload_activations) else 0)
    at_top = _components(
        parameters=P,
        master_weights=M_top,
        gradients=G_pre + g_top,
        optimizer_states=O,
        activations=top_acts,
        temporaries=la.bwd_extra + unpack_tmp + unpack_top,
    )
    if gc:
        # block 0 recomputed: its first norm's save is either the kept input (full) or absent (LoRA discount).
        # Offloaded, a full fine-tune's block 0 input is on the host: its unpacked copy feeds the recompute and dies
        # with it unless the first norm saves it (then it is in ``bottom``); LoRA's is the embedding output kept on
        # the device (Llama-3.1-8B cut to 2 blocks, full bf16 offloaded at 128k tokens: +5.0 % before)
        kept_input = 0 if c.full and plan.offload_activations else la.gc_saved - (la.gc_alias if c.full else 0)
        bottom_acts = kept_input + la.gc_extra + la.bottom + shared
    elif plan.offload_activations:
        bottom_acts = shared
    else:
        bottom_acts = la.bottom + shared
    cands.append(
        _components(
            parameters=P,
            master_weights=M_bottom,
            gradients=G_pre + g_bottom,
            optimizer_states=O,
            activations=bottom_acts,
            temporaries=bwd_bottom + unpack_tmp + unpack_bottom,
        )
    )
    if gc and la.gc_recompute:
        # (c') block 0's recompute at its costliest MLP adapter (see LayerActs.gc_recompute), and the top block's
        # (the first recomputed: every block's kept input alive, block 0's first-norm saves made as in any block;
        # offloaded, the top block's input is back from the host for its recompute)
        cands.append(
            _components(
                parameters=P,
                master_weights=M_bottom,
                gradients=G_pre + g_bottom,
                optimizer_states=O,
                activations=bottom_acts + la.gc_recompute,
            )
        )
        unpacked_input = la.gc_saved if plan.offload_activations else 0
        cands.append(
            _components(
                parameters=P,
                master_weights=M_top,
                gradients=G_pre + g_top,
                optimizer_states=O,
                activations=top_acts + unpacked_input + la.gc_recompute - (la.saved - la.bottom),
            )
        )
    # (d) end of backward; tied head/embedding: the shared weight's two gradients summed out of place (three
    # copies, the sum already the gradient unless accumulating or stepping in backward)
    E = grads.tied_weight_gradient_bytes(c)
    g_last = G_pre + (g_end if not ga else 0)
    cands.append(
        _components(
            parameters=P, gradients=g_last, optimizer_states=O, temporaries=(2 * E if g_last >= E and not ga else 3 * E)
        )
    )
    bwd = max(
        [rank("backward" + shd.LOSS_MOMENT, at_loss), rank("backward" + shd.TOP_MOMENT, at_top)]
        + [rank("backward", d) for d in cands],
        key=lambda d: sum(d.values()),
    )
    phases["backward"] = (sum(bwd.values()), bwd)

    # optimizer step
    if plan.optimizer_in_backward:
        step = _components(parameters=P, optimizer_states=O)  # the steps ran in backward
    elif plan.offload_optimizer:
        step = _components(parameters=P, gradients=G)
    else:
        step = _components(parameters=P, gradients=G, optimizer_states=O, temporaries=opt.temporaries)
    step = rank("optimizer-step", step)
    phases["optimizer-step"] = (sum(step.values()), step)
    if plan.strategy != "single":  # one GPU loads its weights only: below every training phase
        phases[shd.LOAD] = (rs.load, _components(parameters=rs.load))

    peak_phase = max(phases, key=lambda p: phases[p][0])
    peak_alloc, comps = phases[peak_phase]
    transient = comps["activations"] + comps["logits"] + comps["temporaries"] + comps["master_weights"]
    slack = rt.allocator_slack_bytes(c, _persistent_tensors(c, opt), transient)
    cublas = rt.cublas_workspace_bytes(c)
    ctx_bytes = rt.cuda_context_bytes(c)
    nccl = rt.nccl_buffer_bytes(c)
    reserved = peak_alloc + slack + cublas
    device_peak = reserved + ctx_bytes + nccl + opt.paged

    return MemoryBreakdown(
        **{c: comps[c] for c in TENSOR_COMPONENTS},
        adapters=A,
        allocator_slack=slack,
        cuda_context=ctx_bytes,
        cublas_workspace=cublas,
        paged_optimizer=opt.paged,
        cpu_offloaded=rs.host + cpu_act,
        comm_buffers=rs.comm_buffers(peak_phase) if plan.strategy != "single" else 0,
        nccl_buffers=nccl,
        host_per_node=shd.host_per_node(rs, plan.world_size) + cpu_act * plan.world_size,
        peak_allocated=peak_alloc,
        peak_reserved=reserved,
        peak_device=device_peak,
        peak_phase=peak_phase,
        phases={p: v[0] for p, v in phases.items()},
        engine="analytic",
        notes=tuple(_notes(c, blocks is not None)),
    )


def _notes(c: Ctx, measured_blocks: bool) -> list[str]:
    spec, plan = c.spec, c.plan
    notes = []
    if plan.precision == "fp16-mixed":
        notes.append("fp16-mixed is priced like bf16-mixed (same 2-byte copies); GradScaler buffers are ignored")
    if c.mixed and not c.full and c.quant is None:
        notes.append(
            "LoRA on an fp32 base under autocast: every frozen linear's bf16 cast is saved for backward "
            "(counted as AMP weight copies); load the base in bf16 (precision bf16) to avoid it"
        )
    kept = c.quant is not None and sorted(
        {g.name for g in spec.groups if g.kind == "linear" and not g.quantizable and g.name not in HEAD_NAMES}
    )
    if kept:
        modules = sorted({g.module for g in spec.groups if g.kind == "linear" and g.name in kept})
        none = not any(prm.is_quantized(g) for g in spec.groups)
        notes.append(
            f"{spec.model_type}: transformers' bitsandbytes loading replaces exactly nn.Linear/Conv1D modules (not "
            f"the head, not _keep_in_fp32_modules), so {', '.join(kept)} ({', '.join(modules)}) stay unquantized in "
            f"{'fp32 (prepare_model_for_kbit_training upcasts them)' if c.wb == 4 else 'bf16'}"
            + ("; no linear is quantized: QLoRA costs more than LoRA on a bf16 base here" if none else "")
        )
    if upcast_to_fp32(plan):
        notes.append(
            "QLoRA in pure bf16: prepare_model_for_kbit_training upcasts embeddings, norms and the head to fp32, "
            "so activations run in fp32 (priced like fp32 QLoRA); --no-kbit-upcast keeps them bf16"
        )
    if measured_blocks:
        notes.append(
            f"{spec.model_type}: what its blocks save for backward is measured by replaying their code on "
            "fake tensors (cached); the other terms are formulas"
        )
    elif spec.inventory == "transformers":
        notes.append(
            f"{spec.model_type}: parameters read from the model transformers builds; activations priced "
            "with the generic transformer-block formulas (its blocks were not replayed for this plan)"
        )
    if spec.num_experts:
        notes.append("MoE: experts_per_token dense MLPs per token with perfect load balance (real routing varies)")
    if spec.arch_kind == "encoder-decoder":
        notes.append("encoder-decoder: decoder length taken equal to seq_len; cross-attention approximated")
    if effective_attn(spec, plan.attn) != plan.attn:
        notes.append(
            f"{spec.model_type}: transformers cannot use a memory-efficient SDPA kernel here (Gemma-2 soft-capping, "
            "Falcon multi-query without enable_gqa): attention priced as eager (seq^2 probabilities)"
        )
    if effective_attn(spec, plan.attn) == "eager":
        notes.append("eager attention saves fp32 B*heads*S^2 probabilities per layer (grows with seq_len^2)")
    if plan.grad_accum > 1:
        notes.append("grad_accum > 1: gradients stay allocated through every micro-batch's forward/backward")
    if plan.offload_activations:
        notes.append(
            "offload_activations: every saved tensor (weight casts included) goes to host memory (save_on_cpu); "
            "backward copies one node's tensors back at a time; checkpointed blocks recompute on the device, "
            "and LLM.int8() layers keep their inputs there (held outside the saved-tensor hooks)"
        )
    if plan.optimizer_is_paged:
        notes.append(
            "paged optimizer states live in CUDA unified memory: counted in peak_device, not peak_allocated; "
            "they page to host RAM under memory pressure"
        )
    if c.device == "cuda":
        notes.append(
            "cuBLAS workspace (2 x 32 MiB on Hopper) is an allocator block: counted in peak_reserved, "
            "not in peak_allocated"
        )
    notes.extend(shd.notes(c))
    return notes


def _per_rank(moment: str, d: dict[str, int], rs: shd.RankStates) -> dict[str, int]:
    """One moment's single-GPU components as one rank holds them under the strategy: the rank's weights plus the
    gathered units, its share of every gradient plus the gradient buffers, its optimizer states and step
    temporaries; no autocast weight casts where the gathered units / the bf16 model are the compute copies.
    ``moment``: a phase, or ``<phase>-loss`` for the head and loss (``sharding.LOSS_MOMENT``)."""
    d = dict(d)
    d["parameters"] = rs.parameters + rs.gathered_at(moment)
    d["gradients"] = int(d["gradients"] * rs.grad_scale) + rs.grad_buffers_at(moment)
    d["optimizer_states"] = rs.optimizer_states
    if moment == "optimizer-step":
        d["temporaries"] = rs.step_temporaries
    if not rs.amp_copies:
        d["master_weights"] = 0
    return d
