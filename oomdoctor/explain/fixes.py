"""The fixes ``explain`` proposes, as constants, and which of them fit a cause, a phase and a message kind."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from oomdoctor.explain.report import Fix, OomReport
from oomdoctor.memory.runtime import ALLOC_CONF
from oomdoctor.plan.changes import CHANGES

if TYPE_CHECKING:
    from oomdoctor.plan import Plan


def _said(change_id: str) -> str:
    """A plan change as advice words it (``oomdoctor.plan.changes``), as a sentence."""
    text = CHANGES[change_id]
    return text[0].upper() + text[1:]


MAX_SPLIT_SIZE = Fix(
    "max-split-size",
    "Stop the caching allocator from splitting large blocks (this torch predates expandable segments; "
    "torch >= 2.1 has the better fix below).",
    "export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128",
)
CONSTANT_SHAPES = Fix(
    "constant-shapes",
    "Variable-length batches request differently sized blocks and strand reserved memory; pad to a constant or "
    "bucketed length so every step reuses the same blocks (and the worst case shows up at step 1).",
    "DataCollatorWithPadding(pad_to_multiple_of=64) or padding='max_length'; axolotl: pad_to_sequence_len: true; "
    "or sample packing",
)
EMPTY_CACHE_STEPS = Fix(
    "empty-cache-steps",
    "Release cached blocks periodically (about 10% slower).",
    "TrainingArguments(torch_empty_cache_steps=50)",
)
PICK_FREE_GPU = Fix(
    "pick-free-gpu", "Run on a GPU nobody else uses.", "CUDA_VISIBLE_DEVICES=<free gpu index> python train.py"
)
CHUNKED_LOSS = Fix(
    "loss:chunked",
    _said("loss:chunked") + ". The logits of a 128k-256k vocabulary and their fp32 upcast are often the largest single "
    "tensor. TRL 1.x's SFTTrainer already computes its loss this way (loss_type='nll'); older TRL had "
    "loss_type='chunked_nll'.",
    "oomdoctor train YAML: loss: chunked; TrainingArguments(use_liger_kernel=True) (pip install liger-kernel)",
)
ATTENTION_KERNEL = Fix(
    "attn:sdpa",
    _said("attn:sdpa") + ".",
    "from_pretrained(..., attn_implementation='sdpa')  (or 'flash_attention_2'); oomdoctor: --attn sdpa",
)
CHECK_SHAPES = Fix(
    "check-shapes",
    "A request this size for one tensor often comes from an unexpected shape: an untruncated sample, a packing "
    "bug, a collator padding to the longest raw sequence. Print input_ids.shape of the failing batch.",
    "tokenizer(..., truncation=True, max_length=N); SFTConfig(max_length=N); check the collator",
)
EVAL_FIXES: tuple[Fix, ...] = (
    Fix(
        "eval-batch-size",
        "Evaluation runs at its own batch size (HF default 8, often larger than the train micro-batch); set it "
        "to at most the train micro-batch.",
        "TrainingArguments(per_device_eval_batch_size=1)",
    ),
    Fix(
        "eval-logits",
        "By default the Trainer gathers every eval batch's logits on the GPU (N x seq x vocab x 2|4 bytes, growing "
        "until evaluation ends); keep only what the metric needs, or move them to the CPU every few steps.",
        "Trainer(preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1)); "
        "TrainingArguments(eval_accumulation_steps=4) or prediction_loss_only=True; "
        "Lightning / plain PyTorch: keep logits.argmax(-1).cpu() per batch, or update a torchmetrics metric",
    ),
    Fix("eval-half-precision", "Evaluate in bf16/fp16 instead of upcasting.", "TrainingArguments(bf16_full_eval=True)"),
)
SAVE_FIXES: tuple[Fix, ...] = (
    Fix(
        "fsdp-state-dict-offload",
        "Gathering the full state dict on the GPU needs the whole model (fp32) at once; gather to the CPU on "
        "rank 0 only, or save sharded.",
        "FSDP1: FullStateDictConfig(offload_to_cpu=True, rank0_only=True); FSDP2/DCP: "
        "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)); "
        "accelerate: fsdp_state_dict_type: SHARDED_STATE_DICT",
    ),
    Fix(
        "deepspeed-save-sharded",
        "ZeRO-3 gathers every 16-bit weight to save a consolidated model; save the sharded checkpoint and "
        "consolidate it offline on the CPU.",
        "DeepSpeed config: zero_optimization.stage3_gather_16bit_weights_on_model_save: false; then "
        "python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR",
    ),
    Fix(
        "save-only-model",
        "Leave the optimizer state out of periodic checkpoints (gathering it needs two fp32 values per trainable "
        "parameter on top of the model).",
        "TrainingArguments(save_only_model=True)",
    ),
    Fix(
        "save-adapter-only",
        "Save only the LoRA adapter; merge (merge_and_unload) on the CPU or in a separate process, never with a "
        "deepcopy of the model on the GPU.",
        "model.save_pretrained(dir)  # a PeftModel saves the adapter only; merge later with device_map='cpu'",
    ),
)
SMALLER_MODEL = Fix(
    "smaller-model",
    "Use a smaller model of the same family, or 4-bit instead of 8-bit.",
    "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'); `oomdoctor tune MODEL --gpu-mem SIZE`",
)
LOAD_FIXES: tuple[Fix, ...] = (
    Fix(
        "load-quantized",
        "Quantize the weights as they load: 4-bit NF4 keeps about half a byte per parameter (plus small "
        "quantization constants) instead of 2 (bf16) or 4 (fp32); train adapters on top (QLoRA).",
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')); "
        "oomdoctor: --method qlora",
    ),
    Fix(
        "load-dtype",
        "Load the weights in the dtype you train in: fp32 weights take twice the bytes of bf16 (transformers 5 "
        "loads the checkpoint's dtype by default; an explicit float32, or transformers 4 without torch_dtype, "
        "loads fp32).",
        "from_pretrained(..., dtype=torch.bfloat16)  # torch_dtype= in transformers 4",
    ),
    Fix(
        "free-before-load",
        "Memory held before the load (an earlier model in the notebook, a previous trainer, another process) "
        "counts against the new one; free it first.",
        "del model, trainer; import gc; gc.collect(); torch.cuda.empty_cache()  # or restart the kernel",
    ),
    Fix(
        "load-sharded",
        "Spread the weights over every GPU instead of loading a full copy on each: FSDP/ZeRO-3 shard them as they "
        "load (device_map='auto' splits them across GPUs for inference).",
        "accelerate: fsdp_cpu_ram_efficient_loading: true with FSDP, or DeepSpeed zero_stage: 3; inference: "
        "from_pretrained(..., device_map='auto', max_memory={0: '20GiB', 1: '20GiB'})",
    ),
)
OPTIMIZER_8BIT = Fix(
    "optimizer:paged-adamw-8bit",
    _said("optimizer:paged-adamw-8bit") + ". The optimizer state is created at the first optimizer.step() (after "
    "forward/backward), 2 fp32 values per trainable parameter for AdamW; 8-bit AdamW needs about a quarter.",
    "TrainingArguments(optim='paged_adamw_8bit'); oomdoctor: --optimizer paged-adamw-8bit",
)
FUSED_OPTIMIZER = Fix(
    "optimizer:fused",
    _said("optimizer:fused") + ": the default foreach AdamW allocates them during step().",
    "TrainingArguments(optim='adamw_torch_fused'); oomdoctor: --optimizer-impl fused",
)
OPTIMIZER_FIXES: tuple[Fix, ...] = (OPTIMIZER_8BIT, FUSED_OPTIMIZER)
GRADIENT_CHECKPOINTING = Fix(
    "gradient-checkpointing",
    _said("gradient-checkpointing") + ".",
    "TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={'use_reentrant': False}); "
    "oomdoctor: --gradient-checkpointing",
)
MICRO_BATCH = Fix(
    "micro-batch",
    "Halve the micro-batch and double gradient accumulation: " + CHANGES["micro-batch"] + ".",
    "TrainingArguments(per_device_train_batch_size=B/2, gradient_accumulation_steps=2*G); oomdoctor: --micro-batch",
)
SEQ_LEN = Fix(
    "seq-len",
    _said("seq-len") + ".",
    "SFTConfig(max_length=N) / tokenizer(truncation=True, max_length=N); oomdoctor: --seq-len",
)
LORA = Fix(
    "method:qlora",
    _said("method:qlora") + ".",
    "peft LoraConfig(r=16, target_modules='all-linear') + BitsAndBytesConfig(load_in_4bit=True); "
    "oomdoctor: --method qlora",
)
#: Plan changes for any phase, biggest activation savers first.
GENERIC_CAPACITY_FIXES: tuple[Fix, ...] = (GRADIENT_CHECKPOINTING, MICRO_BATCH, SEQ_LEN, LORA) + OPTIMIZER_FIXES
#: Generic fixes that are plan changes (replaced by the priced ``oomdoctor.diagnose.advice`` changes when a plan is
#: known).
PLAN_FIX_IDS = tuple(f.id for f in GENERIC_CAPACITY_FIXES)
QUANT_OFFLOAD_FIXES: tuple[Fix, ...] = (
    Fix(
        "load-on-one-gpu",
        "Load the whole quantized model on the GPU (training cannot use CPU/disk-offloaded bitsandbytes modules); "
        "free the GPU first: device_map='auto' only uses the memory free at load time.",
        "from_pretrained(..., device_map={'': 0}) and check nvidia-smi before loading",
    ),
    Fix(
        "fp32-cpu-offload",
        "For inference only: keep the offloaded modules unquantized on the CPU.",
        "BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True) with a custom device_map",
    ),
    SMALLER_MODEL,
)
CPU_FIXES: tuple[Fix, ...] = (
    Fix(
        "host-ram",
        "Host RAM ran out: load weights lazily and in the target dtype, and do not offload more than the host "
        "can hold.",
        "from_pretrained(..., dtype=torch.bfloat16, low_cpu_mem_usage=True); drop --offload-optimizer / "
        "--offload-params or add swap",
    ),
    Fix(
        "dataloader-workers",
        "Each DataLoader worker copies the dataset; use fewer workers or a memory-mapped dataset (datasets/Arrow).",
        "TrainingArguments(dataloader_num_workers=0)",
    ),
)
CONTAINER_LIMIT = Fix(
    "container-memory-limit",
    "The container's memory limit, not the machine's RAM, was reached: raise the limit, or keep what the process "
    "holds on the host under it.",
    "docker run --memory=64g ...; Kubernetes: resources.limits.memory: 64Gi; systemd: MemoryMax=",
)
NON_PYTORCH_MEMORY = Fix(
    "non-pytorch-memory",
    "Stop other GPU users inside this process: TensorFlow and JAX grab most of the card at import; bitsandbytes "
    "paged optimizers hold unified memory outside PyTorch.",
    "TF_FORCE_GPU_ALLOW_GROWTH=true XLA_PYTHON_CLIENT_PREALLOCATE=false python train.py (or do not import them)",
)
MEMORY_FRACTION = Fix(
    "memory-fraction",
    "Raise or drop the per-process memory cap this process set.",
    "torch.cuda.set_per_process_memory_fraction(0.95)  # or remove the call",
)


#: Phases whose memory the memory model does not price (it prices the training step): their own fixes come first.
UNPRICED_PHASES = ("evaluation", "checkpoint-save", "model-load")
#: A failing frame that piles up outputs batch after batch (Trainer's nested_concat, torch.cat of a list, a gather).
_ACCUMULATES_RE = re.compile(r"concat|torch\.cat\(|gather_for_metrics|_nested_gather|all_gather")


def expandable_segments(alloc_conf_var: str) -> Fix:
    """Expandable segments, under the allocator variable name this torch reads."""
    return Fix(
        "expandable-segments",
        "Let the allocator grow segments instead of caching fixed-size blocks, so reserved-but-unallocated memory can "
        "serve big requests. Set it before the first CUDA allocation (before `import torch`); if it was already set, "
        "fragmentation is not the cause (torch prints this hint regardless, pytorch#173049)."
        + (
            " Newer torch also reads the name PYTORCH_ALLOC_CONF."
            if alloc_conf_var == "PYTORCH_CUDA_ALLOC_CONF"
            else ""
        ),
        f"export {alloc_conf_var}={ALLOC_CONF}",
    )


def fragmentation_fixes(r: OomReport) -> tuple[Fix, ...]:
    """Allocator settings first (``max_split_size_mb`` only for torch that predates expandable segments)."""
    old = (MAX_SPLIT_SIZE,) if r.format in ("torch<=2.0", "torch<1.5") else ()
    return old + (expandable_segments(r.alloc_conf_var), CONSTANT_SHAPES, EMPTY_CACHE_STEPS)


def other_process_fixes(r: OomReport) -> tuple[Fix, ...]:
    """Free the card (naming the PIDs the message lists) or move to another one."""
    pids = [str(p.pid) for p in r.processes if not p.is_self and p.pid is not None]
    dev = r.device.split(":")[-1] if ":" in r.device else "0"
    free_them = Fix(
        "free-other-processes",
        "Other processes hold memory on this GPU (a leftover notebook kernel, a previous run, an inference "
        "server); stop them or wait for them" + (f": PIDs {', '.join(pids)}" if pids else "") + ".",
        f"nvidia-smi --query-compute-apps=pid,used_memory --format=csv -i {dev}"
        + (f"; kill {' '.join(pids)}" if pids else ""),
    )
    return free_them, PICK_FREE_GPU


def eval_fixes(r: OomReport) -> tuple[Fix, ...]:
    """The evaluation fixes, keeping the logits off the GPU first when the failing frame concatenates or gathers
    outputs (they pile up batch after batch, whatever the batch size)."""
    if _ACCUMULATES_RE.search(r.failing_frame or ""):
        return (EVAL_FIXES[1], EVAL_FIXES[0]) + EVAL_FIXES[2:]
    return EVAL_FIXES


def huge_allocation_fixes(r: OomReport) -> tuple[Fix, ...]:
    """Fixes that shrink one big tensor, for the phase it was asked in: the phase's own fixes (evaluation, saving,
    loading, the optimizer step) first; in a training step the logits' (chunked loss), then the batch and sequence
    that size every activation; the attention kernel first when the failing line computes attention."""
    phase = r.phase
    if phase == "model-load":
        return LOAD_FIXES + (SMALLER_MODEL,)
    if phase == "checkpoint-save":
        return SAVE_FIXES
    if phase == "optimizer-step":
        return OPTIMIZER_FIXES + (CHECK_SHAPES,)
    if phase == "evaluation":
        return eval_fixes(r) + (CHUNKED_LOSS, SEQ_LEN, CHECK_SHAPES)
    step = (CHUNKED_LOSS, MICRO_BATCH, SEQ_LEN, ATTENTION_KERNEL, CHECK_SHAPES)
    if phase is None:  # it may have been an evaluation
        step = step[:1] + EVAL_FIXES[:1] + step[1:]
    if re.search(r"attn|attention|softmax", (r.failing_frame or "").split(": ", 1)[-1]):
        step = (ATTENTION_KERNEL,) + tuple(f for f in step if f is not ATTENTION_KERNEL)
    return step


def phase_capacity_fixes(r: OomReport) -> tuple[Fix, ...]:
    """Plan fixes for an OOM in ``r.phase``. Under no_grad (evaluation), while saving and while loading nothing is
    saved for backward: gradient checkpointing and the train micro-batch do not matter there; weights and optimizer
    state do."""
    phase = r.phase
    if phase == "evaluation":
        return eval_fixes(r) + (SEQ_LEN, LORA, OPTIMIZER_8BIT)
    if phase == "checkpoint-save":
        return SAVE_FIXES + (LORA, OPTIMIZER_8BIT)
    if phase == "model-load":
        return LOAD_FIXES + (SMALLER_MODEL,)
    if phase == "optimizer-step":
        return OPTIMIZER_FIXES + (LORA, GRADIENT_CHECKPOINTING, MICRO_BATCH, SEQ_LEN)
    if phase == "loss":
        return (CHUNKED_LOSS, MICRO_BATCH, SEQ_LEN, GRADIENT_CHECKPOINTING, LORA) + OPTIMIZER_FIXES
    return GENERIC_CAPACITY_FIXES


def kind_capacity_fixes(r: OomReport) -> tuple[Fix, ...] | None:
    """Fixes that replace the phase's for message kinds that are not a training step on a GPU (``None``: keep)."""
    kind = r.kind
    if r.format == "linux-oom-killer-cgroup":
        return (CONTAINER_LIMIT,) + CPU_FIXES
    if kind in ("cpu-allocator", "cpu-oom-killer"):
        return CPU_FIXES
    if kind == "batch-size-exhausted":
        return tuple(f for f in GENERIC_CAPACITY_FIXES if f is not MICRO_BATCH) + EVAL_FIXES[:1]
    if kind == "quantized-offload":
        return QUANT_OFFLOAD_FIXES
    return None


def already_applied(plan: Plan, fix_id: str) -> bool:
    """True when ``plan`` already has what the fix proposes."""
    return (
        (fix_id == "gradient-checkpointing" and plan.gradient_checkpointing)
        or (fix_id == "micro-batch" and plan.micro_batch == 1)
        or (fix_id == "method:qlora" and plan.method != "full" and plan.quant is not None)
        or (fix_id == "optimizer:paged-adamw-8bit" and plan.optimizer in ("adamw-8bit", "paged-adamw-8bit"))
        or (fix_id == "optimizer:fused" and plan.optimizer_impl == "fused")
    )


def capacity_fixes(r: OomReport, outside_pytorch: bool, priced: tuple[Fix, ...], plan: Plan | None) -> tuple[Fix, ...]:
    """Fixes for "the plan needs more than the card", best first.

    ``outside_pytorch``: this process holds much memory outside PyTorch's allocator. ``priced``: the plan changes
    priced by the memory model (``oomdoctor.explain.pricing``), which replace the generic plan fixes; without them,
    the generic fixes ``plan`` (when known) already applies are dropped.
    """
    fixes = phase_capacity_fixes(r)
    if outside_pytorch:
        fixes = (NON_PYTORCH_MEMORY,) + fixes
    if r.allowed_bytes is not None:
        fixes = (MEMORY_FRACTION,) + fixes
    fixes = kind_capacity_fixes(r) or fixes
    if priced:
        # Fixes the memory model cannot price (eval, save and load settings) stay first in their phases (it prices the
        # training step); elsewhere the priced fixes lead, largest saving first. Generic plan fixes give way to the
        # priced ones.
        replaced = set(PLAN_FIX_IDS) | {f.id for f in priced}
        unpriced = tuple(f for f in fixes if f.id not in replaced)
        return unpriced + priced if r.phase in UNPRICED_PHASES else priced + unpriced
    if plan is not None:
        return tuple(f for f in fixes if not already_applied(plan, f.id))
    return fixes
