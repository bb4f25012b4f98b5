"""Read an out-of-memory message (a log, a traceback) and say why it happened and what to change.

Pure text processing and arithmetic: no torch, no rich. ``explain(text)`` is the entry point; the CLI
(``oomdoctor/cli/explain.py``) only prints what it returns.

Formats understood (wordings as printed by PyTorch's ``c10/cuda/CUDACachingAllocator.cpp``, whose ``format_size``
prints ``N bytes`` up to 1 KiB, then KiB/MiB/GiB with two decimals; larger units are accepted too):

* torch >= 2.2: ``CUDA out of memory. Tried to allocate X. GPU 0 has a total capacity of T of which F is free.
  [Process P has Y memory in use. ...] Including non-PyTorch memory, this process has Y memory in use. Of the allocated
  memory A is allocated by PyTorch, [with Z allocated in private pools (e.g., CUDA Graphs), ]and U is reserved by
  PyTorch but unallocated.`` (the hint names ``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` in newer torch);
* torch 2.1: the same with the ``total capacty`` typo and a ``max_split_size_mb`` hint;
* torch <= 2.0: ``CUDA out of memory. Tried to allocate X (GPU 0; T total capacity; A already allocated; F free;
  [M allowed; ]R reserved in total by PyTorch)`` (torch < 1.5 printed ``R cached`` instead);
* ``HIP``/``XPU out of memory`` (same layout), ``MPS backend out of memory (...)``;
* FSDP's ``UserWarning: Failed to clone() tensor with name ... Error: CUDA out of memory...`` (an OOM that only
  warns, during ``state_dict()`` at checkpoint time);
* ``CUDA error: out of memory`` / ``CUBLAS_STATUS_ALLOC_FAILED`` (allocations outside the caching allocator:
  CUDA context creation, cuBLAS/NCCL workspaces);
* CPU: ``DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes`` (and the older
  ``not enough memory`` wording);
* the Linux OOM killer (``Out of memory: Killed process N (python) total-vm:...kB, anon-rss:...kB``);
* accelerate's ``No executable batch size found, reached zero.`` (``auto_find_batch_size`` after OOMs at every size);
* transformers/accelerate refusing a bitsandbytes-quantized model that ``device_map="auto"`` spilled to CPU/disk
  (``Some modules are dispatched on the CPU or the disk. Make sure you have enough GPU RAM to fit the quantized
  model...``, ``You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload``).

Lines may carry ``[rank3]:`` / ``[default0]:`` prefixes (torchrun) and messages may be wrapped over several lines.
Values NVML cannot know are printed by torch as ``2**64 - 1`` bytes (``17179869184.00 GiB``, seen under WSL and in
some containers) or as ``0 bytes``; such values are reported as unknown (``None``), never used as numbers.
"""

from __future__ import annotations

import re

from oomdoctor.explain.parse import parse_oom
from oomdoctor.explain.phase import detect_phase
from oomdoctor.explain.report import CAUSE_IDS, PHASES, Cause, Diagnosis, Fix, OomReport, ProcessUse
from oomdoctor.units import format_bytes

GiB = 2**30
MiB = 2**20


# ---------------------------------------------------------------------------------------------- diagnosis

# Common vocabulary sizes (for "this request is the logits"), most used first: Llama-3 128256, Llama-2/Mistral 32000,
# Qwen2 151936/152064, Gemma 256000, Gemma-3 262144, GPT-2 50257, Pythia 50304, Phi-2 51200, Phi-3 32064. Power-of-two
# vocabularies (Mistral-Nemo 131072, Gemma-3 262144) are left out: they match every power-of-two sized tensor.
COMMON_VOCABS: tuple[int, ...] = (
    128256, 32000, 151936, 152064, 256000, 50257, 50304, 51200, 32064)


def _logits_match(requested: int, vocabs: tuple[int, ...], tokens_hint: int | None = None) -> str | None:
    """If ``requested`` is (within print rounding) tokens x vocab x 4|2 bytes, say so; else ``None``.

    torch prints sizes with two decimals, so a request is known to +-0.005 of its unit. To keep chance matches rare
    the token count must be the user's micro-batch x sequence length (``tokens_hint``) or a power of two >= 512
    (micro-batch and sequence length usually are); the result reads "consistent with", a heuristic, not proof.
    """
    unit = GiB if requested > GiB else (MiB if requested > MiB else 1024)
    tol = 0.005 * unit + 1
    candidates = ([tokens_hint] if tokens_hint else []) + [2**k for k in range(9, 21)]
    for v in vocabs:
        for nbytes, what in ((4, "fp32"), (2, "bf16/fp16")):
            for k in candidates:
                if abs(k * v * nbytes - requested) <= tol:
                    who = "your micro-batch x sequence length" if k == tokens_hint else "micro-batch x sequence length"
                    return (
                        f"{format_bytes(requested)} = {k} x vocab {v} x {nbytes} bytes ({what}): consistent with the "
                        f"logits of {who} = {k} tokens"
                        + (" (or with an embedding/lm_head weight of that vocabulary)" if k <= 16384 else "")
                    )
    return None


def _pct(part: int, whole: int | None) -> str:
    return f"{100 * part / whole:.0f}% of the card" if whole else ""


def _frag_fixes(r: OomReport) -> list[Fix]:
    var = r.alloc_conf_var
    fixes = []
    if r.format in ("torch<=2.0", "torch<1.5"):
        fixes.append(Fix(
            "max-split-size",
            "Stop the caching allocator from splitting large blocks (this torch predates expandable segments; "
            "torch >= 2.1 has the better fix below).",
            "export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128",
        ))
    fixes.append(Fix(
        "expandable-segments",
        "Let the allocator grow segments instead of caching fixed-size blocks, so reserved-but-unallocated memory can "
        "serve big requests. Set it before the first CUDA allocation (before `import torch`); if it was already set, "
        "fragmentation is not the cause (torch prints this hint regardless, pytorch#173049)."
        + (" Newer torch also reads the name PYTORCH_ALLOC_CONF." if var == "PYTORCH_CUDA_ALLOC_CONF" else ""),
        f"export {var}=expandable_segments:True",
    ))
    fixes.append(Fix(
        "constant-shapes",
        "Variable-length batches request differently sized blocks and strand reserved memory; pad to a constant or "
        "bucketed length so every step reuses the same blocks (and the worst case shows up at step 1).",
        "DataCollatorWithPadding(pad_to_multiple_of=64) or padding='max_length'; axolotl: pad_to_sequence_len: true; "
        "or sample packing",
    ))
    fixes.append(Fix(
        "empty-cache-steps",
        "Release cached blocks periodically (about 10% slower).",
        "TrainingArguments(torch_empty_cache_steps=50)",
    ))
    return fixes


def _other_fixes(r: OomReport) -> list[Fix]:
    pids = [str(p.pid) for p in r.processes if not p.is_self and p.pid is not None]
    dev = r.device.split(":")[-1] if ":" in r.device else "0"
    return [
        Fix(
            "free-other-processes",
            "Other processes hold memory on this GPU (a leftover notebook kernel, a previous run, an inference "
            "server); stop them or wait for them"
            + (f": PIDs {', '.join(pids)}" if pids else "") + ".",
            f"nvidia-smi --query-compute-apps=pid,used_memory --format=csv -i {dev}"
            + (f"; kill {' '.join(pids)}" if pids else ""),
        ),
        Fix(
            "pick-free-gpu",
            "Run on a GPU nobody else uses.",
            "CUDA_VISIBLE_DEVICES=<free gpu index> python train.py",
        ),
    ]


def _chunked_loss_fix() -> Fix:
    return Fix(
        "chunked-loss",
        "Do not materialise the full [batch, seq, vocab] logits and their fp32 upcast: use a fused/chunked "
        "linear-cross-entropy (the logits of a 128k-256k vocabulary are often the largest single tensor).",
        "TrainingArguments(use_liger_kernel=True) (pip install liger-kernel); TRL SFTConfig(loss_type='chunked_nll')",
    )


def _huge_fixes(r: OomReport) -> list[Fix]:
    fixes = []
    if r.phase == "evaluation":
        fixes += _eval_fixes()
    elif r.phase == "checkpoint-save":
        fixes += _save_fixes()
    fixes.append(_chunked_loss_fix())
    fixes.append(Fix(
        "attention-kernel",
        "Eager attention materialises batch x heads x seq x seq scores; use a memory-efficient kernel.",
        "from_pretrained(..., attn_implementation='sdpa')  (or 'flash_attention_2'); oomdoctor: --attn sdpa",
    ))
    fixes.append(Fix(
        "check-shapes",
        "A request this size for one tensor often comes from an unexpected shape: an untruncated sample, a packing "
        "bug, a collator padding to the longest raw sequence. Print input_ids.shape of the failing batch.",
        "tokenizer(..., truncation=True, max_length=N); SFTConfig(max_length=N); check the collator",
    ))
    return fixes


def _eval_fixes() -> list[Fix]:
    return [
        Fix(
            "eval-batch-size",
            "Evaluation runs at its own batch size (HF default 8, often larger than the train micro-batch); set it "
            "to at most the train micro-batch.",
            "TrainingArguments(per_device_eval_batch_size=1)",
        ),
        Fix(
            "eval-logits",
            "By default the Trainer gathers every eval batch's logits on the GPU (N x seq x vocab x 4 bytes); keep "
            "only what the metric needs, or move them to the CPU every few steps.",
            "Trainer(preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1)); "
            "TrainingArguments(eval_accumulation_steps=4) or prediction_loss_only=True",
        ),
        Fix(
            "eval-half-precision",
            "Evaluate in bf16/fp16 instead of upcasting.",
            "TrainingArguments(bf16_full_eval=True)",
        ),
    ]


def _save_fixes() -> list[Fix]:
    return [
        Fix(
            "fsdp-state-dict-offload",
            "Gathering the full state dict on the GPU needs the whole model (fp32) at once; gather to the CPU on "
            "rank 0 only, or save sharded.",
            "FullStateDictConfig(offload_to_cpu=True, rank0_only=True); accelerate: "
            "fsdp_state_dict_type: SHARDED_STATE_DICT",
        ),
        Fix(
            "save-adapter-only",
            "Save only the LoRA adapter; merge (merge_and_unload) on the CPU or in a separate process, never with a "
            "deepcopy of the model on the GPU.",
            "model.save_pretrained(dir)  # a PeftModel saves the adapter only; merge later with device_map='cpu'",
        ),
    ]


def _optimizer_fixes() -> list[Fix]:
    return [
        Fix(
            "optimizer-8bit",
            "The optimizer state is created at the first optimizer.step() (after forward/backward), 2 fp32 values "
            "per trainable parameter for AdamW; 8-bit/paged AdamW needs about a quarter.",
            "TrainingArguments(optim='paged_adamw_8bit'); oomdoctor: --optimizer paged-adamw-8bit",
        ),
        Fix(
            "fused-optimizer",
            "The default foreach AdamW allocates temporaries the size of a parameter group during step(); the fused "
            "kernel does not.",
            "TrainingArguments(optim='adamw_torch_fused'); oomdoctor: --optimizer-impl fused",
        ),
    ]


def _generic_capacity_fixes() -> list[Fix]:
    return [
        Fix(
            "gradient-checkpointing",
            "Keep only each layer's input in forward and recompute the rest in backward (the biggest activation "
            "saver, about a third more compute).",
            "TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={'use_reentrant': False}); "
            "oomdoctor: --gradient-checkpointing",
        ),
        Fix(
            "micro-batch",
            "Halve the micro-batch and double gradient accumulation: the same effective batch, half the activations.",
            "TrainingArguments(per_device_train_batch_size=B/2, gradient_accumulation_steps=2*G); "
            "oomdoctor: --micro-batch",
        ),
        Fix(
            "seq-len",
            "Shorter sequences shrink activations and logits linearly (truncate, or filter outliers).",
            "SFTConfig(max_length=N) / tokenizer(truncation=True, max_length=N); oomdoctor: --seq-len",
        ),
        Fix(
            "lora",
            "Train low-rank adapters on a frozen (optionally 4-bit) base instead of every weight: no gradients or "
            "optimizer state for the base.",
            "peft LoraConfig(r=16, target_modules='all-linear') + BitsAndBytesConfig(load_in_4bit=True); "
            "oomdoctor: --method qlora",
        ),
    ] + _optimizer_fixes()


def _quant_offload_fixes() -> list[Fix]:
    return [
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
        Fix(
            "smaller-model",
            "Use a smaller model of the same family, or 4-bit instead of 8-bit.",
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'); `oomdoctor tune MODEL --gpu-mem SIZE`",
        ),
    ]


def _cpu_fixes() -> list[Fix]:
    return [
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
    ]


def _phase_capacity_fixes(phase: str | None) -> list[Fix]:
    generic = _generic_capacity_fixes()
    by_id = {f.id: f for f in generic}
    # Under no_grad (evaluation) and while saving, nothing is saved for backward: gradient checkpointing and the
    # train micro-batch do not matter there; what sits on the card is weights and optimizer state.
    if phase == "evaluation":
        return _eval_fixes() + [by_id[i] for i in ("seq-len", "lora", "optimizer-8bit")]
    if phase == "checkpoint-save":
        return _save_fixes() + [by_id[i] for i in ("lora", "optimizer-8bit")]
    if phase == "optimizer-step":
        return _optimizer_fixes() + [by_id[i] for i in ("lora", "gradient-checkpointing", "micro-batch", "seq-len")]
    if phase == "loss":
        keep = ("micro-batch", "seq-len", "gradient-checkpointing", "lora")
        return [_chunked_loss_fix()] + [by_id[i] for i in keep] + _optimizer_fixes()
    return generic


def rank_plan_fixes(spec, plan, capacity: int | None, engine: str = "analytic",
                    capacity_label: str | None = None) -> tuple[int, str, list[Fix]]:
    """(device peak of ``plan``, its peak phase, single-knob fixes sorted by bytes saved, largest first).

    The candidate changes and their prices come from ``oomdoctor.diagnose.advice`` (one knob each, priced as
    ``estimate(plan).peak_device - estimate(plan.with_(change)).peak_device``); explain orders them by bytes saved,
    because after an OOM the user wants the biggest lever first.
    """
    from oomdoctor.diagnose.advice import advise
    from oomdoctor.engines import estimate
    from oomdoctor.plan.budget import resolve_budget

    base = estimate(spec, plan, engine)
    budget = resolve_budget(capacity, None, None, gpu_mem_source="explain") if capacity else None
    advice = advise(spec, plan, budget, estimator=lambda s, p: estimate(s, p, engine))
    fixes = [
        Fix(ch.id, ch.description, ch.how, saves_bytes=int(ch.saves_bytes),
            peak_after_bytes=int(base.peak_device - ch.saves_bytes), fits=ch.fits)
        for ch in advice.single
        if ch.saves_bytes > 0
    ]
    fixes.sort(key=lambda f: (-(f.saves_bytes or 0), f.id))
    if advice.path and len(advice.path) > 1 and not any(f.fits for f in fixes):
        # No single change fits: the advice module's cheapest path of changes, as one combined fix, first.
        end = advice.path[-1].plan
        after = estimate(spec, end, engine).peak_device
        steps = list(dict.fromkeys(ch.id for ch in advice.path))
        mem = capacity_label or (format_bytes(capacity).replace(" ", "") if capacity else "SIZE")
        fixes.insert(0, Fix(
            "combined",
            "No single change is enough; together (cheapest first): " + ", then ".join(steps) + ".",
            f"plan: {end.label()}, micro-batch {end.micro_batch} x gradient accumulation {end.grad_accum}"
            f" (`oomdoctor tune {spec.name} --gpu-mem {mem}` writes the YAML)",
            saves_bytes=int(base.peak_device - after), peak_after_bytes=int(after), fits=advice.path_fits,
        ))
    return int(base.peak_device), base.peak_phase, fixes


def diagnose(report: OomReport, spec=None, plan=None, capacity_bytes: int | None = None) -> Diagnosis:
    """Order the likely causes of ``report``; with ``spec`` and ``plan``, price the plan fixes with the memory model."""
    r = report
    R, T, F = r.requested_bytes, r.total_bytes, r.free_bytes
    A, U, O, N = r.allocated_bytes, r.reserved_unallocated_bytes, r.other_processes_bytes, r.non_pytorch_bytes
    cap = capacity_bytes if capacity_bytes is not None else T
    fb = format_bytes
    causes: list[Cause] = []

    # Echo the card the way the user gave it (--gpu-mem 24GB: decimal), else as torch printed it (GiB).
    mem = format_bytes(cap, binary=capacity_bytes is None).replace(" ", "") if cap else "SIZE"
    plan_need = plan_phase = None
    plan_fixes: list[Fix] = []
    if spec is not None and plan is not None:
        plan_need, plan_phase, plan_fixes = rank_plan_fixes(spec, plan, cap, capacity_label=mem)

    # Free memory the process could actually use: a per-process cap (set_per_process_memory_fraction) can bind first.
    Feff = F
    if F is not None and r.allowed_bytes is not None and r.reserved_bytes is not None:
        Feff = max(0, min(F, r.allowed_bytes - r.reserved_bytes))

    # -- fragmentation: reserved-but-unallocated memory would have served the request. (Before raising, the caching
    # allocator already released every fully free cached segment and retried; what is left in U sits in partly used
    # segments, so U >= R means fragmentation proper.) Whether fixing it helps depends on the slack left after the
    # request: with < 5% of the card left the next allocations of the step fail anyway (then capacity leads).
    if U is not None and R is not None and r.kind in ("cuda-allocator", "fsdp-clone-warning"):
        ev, score = [], 0.0
        slack = U + (Feff or 0) - R
        roomy = slack >= 0.05 * T if T else slack >= 1 * GiB
        if U >= R:
            score = 0.9 if roomy else 0.6
            ev.append(f"PyTorch held {fb(U)} reserved but unallocated, more than the {fb(R)} requested: the memory "
                      "was there, but split into cached blocks none of which was big enough")
        elif Feff is not None and U + Feff >= R:
            score = 0.75 if roomy else 0.55
            ev.append(f"{fb(U)} reserved-but-unallocated + {fb(Feff)} free = {fb(U + Feff)} >= the {fb(R)} "
                      "requested: enough memory existed, only not in one piece")
        elif U >= max(0.05 * (T or 0), 512 * MiB):
            score = 0.3
            ev.append(f"{fb(U)} ({_pct(U, T) or 'of the card'}) is reserved by PyTorch but unallocated: "
                      "fragmentation adds to the shortage")
        if score and not roomy and score > 0.3:
            ev.append(f"but only {fb(max(0, slack))} would be left after serving it ({_pct(max(0, slack), T)}): "
                      "the rest of the step would likely fail next")
        if score:
            causes.append(Cause("fragmentation", score, tuple(ev), tuple(_frag_fixes(r))))

    # -- other processes
    ev, score = [], 0.0
    if O is not None and O > 0:
        listed = ", ".join(f"PID {p.pid}: {fb(p.bytes)}" for p in r.processes if not p.is_self and p.bytes)
        deficit = (R - F) if (R is not None and F is not None) else None
        big = O >= (0.05 * T if T else 1 * GiB)
        if deficit is not None and O >= deficit and big:
            score = 0.8
            ev.append(f"other processes hold {fb(O)}{' (' + _pct(O, T) + ')' if T else ''} ({listed}); without them "
                      f"the {fb(R)} request would have fit ({fb(F)} free + {fb(O)})")
        elif T and O >= 0.1 * T:
            score = 0.5
            ev.append(f"other processes hold {fb(O)} ({_pct(O, T)}): {listed}")
        elif O >= 256 * MiB:
            score = 0.15
            ev.append(f"other processes hold {fb(O)} ({listed})")
    elif O is None and N is not None and T and N >= max(2 * GiB, 0.1 * T):
        score = 0.45
        ev.append(f"total - free - reserved = {fb(N)} ({_pct(N, T)}) is held outside PyTorch's allocator; a CUDA "
                  "context takes ~0.3-1 GiB, so the rest is likely other processes or libraries (the message does "
                  "not list processes)")
    elif r.kind == "cuda-error":
        score = 0.6
        ev.append("'CUDA error: out of memory' is raised outside the caching allocator, typically when creating "
                  "the CUDA context or a cuBLAS/NCCL workspace on a card another process already fills")
    elif r.kind == "quantized-offload":
        score = 0.4
        ev.append("device_map='auto' sizes the GPU share by the memory free at load time: memory held by other "
                  "processes pushes modules to the CPU/disk")
    if score:
        causes.append(Cause("other-processes", score, tuple(ev), tuple(_other_fixes(r))))

    # -- huge allocation: one request is a large share of the card (or is recognisably the logits)
    ev, score = [], 0.0
    if R is not None:
        if r.kind == "cpu-allocator":
            if R >= 2**40:
                score = 0.95
                ev.append(f"one host allocation of {fb(R)}: more than any machine's RAM, a shape or size bug")
            elif R >= 8 * GiB:
                score = 0.6
                ev.append(f"one host allocation of {fb(R)}")
        elif T:
            frac = R / T
            if frac > 1:
                score = 0.95
                ev.append(f"{fb(R)} requested is more than the whole card ({fb(T)}): no allocator setting can serve "
                          "it; look for a shape bug (packing, missing truncation) or an enormous logits tensor")
            elif frac >= 0.25:
                score = 0.75
                ev.append(f"one request of {fb(R)} is {_pct(R, T)} ({fb(T)})")
            elif frac >= 0.10:
                score = 0.45
                ev.append(f"one request of {fb(R)} is {_pct(R, T)} ({fb(T)})")
        elif R >= 8 * GiB:
            score = 0.5
            ev.append(f"one request of {fb(R)}")
        lm = None
        if R >= 64 * MiB and r.kind != "cpu-allocator":
            vocabs = (spec.vocab_size,) if spec is not None else COMMON_VOCABS
            hint = plan.micro_batch * plan.seq_len if plan is not None else None
            lm = _logits_match(R, vocabs, hint)
        if lm:
            if not score:
                score = 0.3
                ev.append(f"one request of {fb(R)}" + (f" ({_pct(R, T)})" if T else ""))
            ev.append(lm)
            score += 0.15
        code = (r.failing_frame or "").split(": ", 1)[-1]
        if score and re.search(r"logits|lm_head|cross_entropy|loss_fct", code):
            ev.append(f"the failing line computes the logits/loss: {code}")
            score += 0.1
        if score and r.phase in ("loss", "evaluation"):
            ev.append(f"it happened in the {r.phase} phase, where the [batch, seq, vocab] logits (and their fp32 "
                      "copies) are the largest tensors")
            score += 0.1
        score = min(score, 0.97)
    if score:
        causes.append(Cause("huge-allocation", score, tuple(ev), tuple(_huge_fixes(r))))

    # -- capacity
    ev, score = [], 0.5
    if r.kind == "cpu-allocator":
        score = 0.7
        ev.append(f"the host could not provide {fb(R)} of RAM")
    elif r.kind == "cpu-oom-killer":
        score = 0.8
        ev.append("the Linux OOM killer ended the process: host RAM (plus swap) was exhausted"
                  + (f"; the process held {fb(r.this_process_bytes)} resident" if r.this_process_bytes else ""))
    elif r.kind == "quantized-offload":
        score = 0.8
        ev.append("the quantized model did not fit in the GPU memory that was free when it was loaded")
    elif r.kind == "cuda-error":
        ev.append("no numbers are printed; check the plan against the card with `oomdoctor diagnose`")
    elif r.kind == "batch-size-exhausted":
        score = 0.8
        ev.append("even a batch of 1 ran out of memory: the model and plan need more than the card at any batch size "
                  "(or the OOM came from evaluation: auto_find_batch_size shrinks the train batch for eval OOMs "
                  "too, transformers#32215)")
    if r.allowed_bytes is not None and R is not None and r.reserved_bytes is not None and F is not None \
            and r.reserved_bytes + R > r.allowed_bytes and F >= R:
        score = max(score, 0.9)
        ev.append(f"the process is capped at {fb(r.allowed_bytes)} (torch.cuda.set_per_process_memory_fraction) "
                  f"and had reserved {fb(r.reserved_bytes)}; the card itself still had {fb(F)} free")
    own_extra = None
    if r.this_process_bytes is not None and r.reserved_bytes is not None and T:
        own_extra = r.this_process_bytes - r.reserved_bytes
        if own_extra >= max(2 * GiB, 0.1 * T):
            score = max(score, 0.6)
            ev.append(f"this process holds {fb(own_extra)} outside PyTorch's allocator ({fb(r.this_process_bytes)} in "
                      f"use, {fb(r.reserved_bytes)} reserved by PyTorch): beyond the ~0.5 GiB CUDA context that is "
                      "bitsandbytes paged state, NCCL buffers, or another framework (TensorFlow/JAX) preallocating")
        else:
            own_extra = None
    if A is not None and T:
        share = A / T
        ev.append(f"PyTorch's live tensors held {fb(A)} ({_pct(A, T)}) when the {fb(R) if R else 'new'} request came")
        if share >= 0.9:
            score = max(score, 0.75)
        elif share >= 0.75:
            score = max(score, 0.65)
    if None not in (R, Feff, U) and R > Feff + U + (O or 0):
        score = max(score, 0.85)
        ev.append(f"even with no fragmentation and no other processes, only {fb(Feff + U + (O or 0))} could have "
                  f"served the {fb(R)} request: the plan needs more than this card")
    if plan_need is not None:
        if cap and plan_need > cap:
            score = max(score, 0.9)
            ev.append(f"the memory model puts your plan's peak at {fb(plan_need)} ({plan_phase}), more than the "
                      f"{fb(cap)} card")
        elif cap:
            score = min(score, 0.4)
            ev.append(f"the memory model puts your plan's peak at {fb(plan_need)} ({plan_phase}), within the "
                      f"{fb(cap)} card: look at the other causes and at phases it does not model (eval, save)")
    if any(c.score >= 0.8 for c in causes) and plan_need is None and score < 0.85:
        score = min(score, 0.4)
    fixes = _phase_capacity_fixes(r.phase)
    if own_extra is not None:
        fixes = [Fix("non-pytorch-memory", "Stop other GPU users inside this process: TensorFlow and JAX grab most of "
                     "the card at import; bitsandbytes paged optimizers hold unified memory outside PyTorch.",
                     "TF_FORCE_GPU_ALLOW_GROWTH=true XLA_PYTHON_CLIENT_PREALLOCATE=false python train.py "
                     "(or do not import them)")] + fixes
    if r.allowed_bytes is not None:
        fixes = [Fix("memory-fraction", "Raise or drop the per-process memory cap this process set.",
                     "torch.cuda.set_per_process_memory_fraction(0.95)  # or remove the call")] + fixes
    if r.kind in ("cpu-allocator", "cpu-oom-killer"):
        fixes = _cpu_fixes()
    elif r.kind == "batch-size-exhausted":
        fixes = [f for f in _generic_capacity_fixes() if f.id != "micro-batch"] + _eval_fixes()[:1]
    elif r.kind == "quantized-offload":
        fixes = _quant_offload_fixes()
    if plan_fixes:
        # Fixes the memory model cannot price (eval settings, save settings) stay first in their phases;
        # elsewhere the priced fixes lead, largest saving first. Generic plan fixes give way to the priced ones.
        unpriced = [f for f in fixes if f.id not in PLAN_FIX_IDS]
        fixes = unpriced + plan_fixes if r.phase in ("evaluation", "checkpoint-save") else plan_fixes + unpriced
    elif plan is not None:
        fixes = [f for f in fixes if not _already(plan, f.id)]
    causes.append(Cause("capacity", score, tuple(ev), tuple(fixes)))

    causes.sort(key=lambda c: -c.score)
    nxt = None
    if r.kind not in ("cpu-allocator", "cpu-oom-killer"):
        model = spec.name if spec is not None else "MODEL"
        nxt = f"oomdoctor tune {model} --gpu-mem {mem}"
    return Diagnosis(
        report=r,
        causes=tuple(causes),
        plan_label=plan.label() if plan is not None else None,
        plan_peak_bytes=plan_need,
        plan_peak_phase=plan_phase,
        capacity_bytes=cap,
        next_command=nxt,
    )


#: Generic fixes that are plan changes (replaced by the priced ``oomdoctor.diagnose.advice`` changes when a plan is known).
PLAN_FIX_IDS = ("gradient-checkpointing", "micro-batch", "seq-len", "lora", "optimizer-8bit", "fused-optimizer")


def _already(plan, fix_id: str) -> bool:
    """True when the plan already has what the fix proposes."""
    return (
        (fix_id == "gradient-checkpointing" and plan.gradient_checkpointing)
        or (fix_id == "micro-batch" and plan.micro_batch == 1)
        or (fix_id == "lora" and plan.method != "full" and plan.quant is not None)
        or (fix_id == "optimizer-8bit" and plan.optimizer in ("adamw-8bit", "paged-adamw-8bit"))
        or (fix_id == "fused-optimizer" and plan.optimizer_impl == "fused")
    )


def explain(text: str, spec=None, plan=None, capacity_bytes: int | None = None) -> Diagnosis:
    """Parse ``text`` and diagnose the OOM it holds (raises BadInput when it holds none)."""
    return diagnose(parse_oom(text), spec=spec, plan=plan, capacity_bytes=capacity_bytes)


__all__ = [
    "CAUSE_IDS", "PHASES", "ProcessUse", "OomReport", "Fix", "Cause", "Diagnosis",
    "parse_oom", "detect_phase", "diagnose", "explain", "rank_plan_fixes",
]
