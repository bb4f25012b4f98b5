"""One-knob plan changes in words: the ids and texts that advice (``diagnose``, ``tune``) and ``explain`` share.

Advice (``oomdoctor.diagnose.advice``) prices each change for a plan and puts the plan's own numbers in front where
it has them (``micro-batch 8 -> 4 with gradient accumulation 4 -> 8: ...``); explain (``oomdoctor.explain.fixes``)
proposes the same change for an OOM message, with how to apply it in the user's tool. One id and one explanation per
change, so a fix reads the same wherever it is proposed. The texts teach the techniques as they are: LoRA is
Low-Rank Adaptation, AdamW keeps exactly Adam's two states.
"""

from __future__ import annotations

#: Change id -> what the change does and what it costs, in words.
CHANGES: dict[str, str] = {
    "micro-batch": "same effective batch, same math, activations scale with the micro-batch",
    "attn:sdpa": "use memory-efficient attention (sdpa/flash): eager attention materializes seq x seq scores per head",
    "optimizer:fused": "fused optimizer step (torch fused=True): no parameter-group-sized temporaries, same math",
    "loss:chunked": "chunked cross-entropy: the LM head and loss run over token chunks recomputed in backward, never "
    "the whole batch x seq x vocab logits (Liger / cut-cross-entropy memory; one more LM-head forward)",
    "gradient-checkpointing": "gradient checkpointing: keep only each layer's input and recompute the layer in "
    "backward (the biggest activation saver; about one third more compute)",
    "strategy:fsdp": "shard weights, gradients and optimizer states over the GPUs (torch FSDP2): each keeps its share "
    "plus the layers being gathered (communication 3 instead of 2 model sizes per step)",
    "strategy:zero3": "DeepSpeed ZeRO-3: partition the weights too (gathered layer by layer; more communication)",
    "reshard-after-forward": "free each layer's gathered weights after its forward and gather them again in backward",
    "tiled-mlp": "tiled MLP: each block's MLP runs over tiles of ~hidden_size tokens, each recomputed in backward, "
    "so its intermediates exist for one tile (one more MLP forward per step; one GPU)",
    "offload:activations": "offload activations saved for backward to pinned CPU memory (costs PCIe transfer time)",
    "offload:optimizer": "offload optimizer states and the optimizer step to the CPU (ZeRO-Offload style; costs "
    "PCIe + CPU time)",
    "optimizer-in-backward": "step each parameter's optimizer inside backward and free its gradient at once "
    "(torchtune's optimizer_in_bwd): no full set of gradients; gives up gradient clipping "
    "and accumulation",
    "precision:bf16-mixed": "bf16 mixed precision (AMP): fp32 master weights, bf16 activations and matmuls",
    "precision:bf16": "pure bf16: weights, gradients and optimizer states in bf16, no fp32 master copy (halves model "
    "states; small updates can be lost to bf16 rounding)",
    "kbit-upcast:off": "skip peft's k-bit upcast (as TRL's SFTTrainer, axolotl and unsloth run QLoRA): the quantized "
    "base's embeddings, norms, head and biases stay bf16 instead of fp32, and so does the residual "
    "stream (half their bytes and of the activations; norms computed from bf16 weights)",
    "optimizer:adamw-8bit": "8-bit AdamW (bitsandbytes): Adam's two states quantized blockwise to 8 bits. "
    "(Switching Adam to AdamW saves nothing: AdamW keeps exactly Adam's two states.)",
    "optimizer:paged-adamw-8bit": "paged 8-bit AdamW (bitsandbytes): 8-bit states in unified memory that pages to "
    "the CPU under pressure",
    "optimizer:adafactor": "Adafactor: factored second moment (row + column statistics), no first moment",
    "optimizer:lion": "Lion: one momentum state instead of Adam's two (needs a ~3-10x smaller learning rate)",
    "optimizer:sgd": "plain SGD: no optimizer state at all (converges slower on transformers)",
    "method:lora": "LoRA (Low-Rank Adaptation, peft): freeze the base, train rank-r adapters; gradients and optimizer "
    "states shrink to the adapters'",
    "method:qlora": "QLoRA: LoRA (Low-Rank Adaptation) on a frozen 4-bit NF4 base with double quantization "
    "(bitsandbytes), about 0.52 byte per weight; no gradients or optimizer state for the base",
    "quant:nf4": "4-bit NF4 base instead of int8 (QLoRA paper): half the weight bytes",
    "quant:double": "double quantization: quantize the 4-bit block constants again (~0.37 bit per weight)",
    "lora:no-head": "do not adapt the output head: its adapter input/grad spans the whole vocabulary projection",
    "seq-len": "shorter sequences shrink activations and logits linearly; changes the data the model sees "
    "(truncation) - a last resort",
}
