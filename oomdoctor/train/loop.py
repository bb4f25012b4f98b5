"""The training loop of ``oomdoctor train``: data -> model -> guarded micro-batches -> optimizer step -> checkpoint.

One optimizer step consumes ``effective_batch_size`` samples (the data position advances by that much), computes
the number of target tokens ``N`` of all of them, and runs them through :class:`oomdoctor.execute.oom.OOMGuard` in
micro-batches; each micro-batch's loss is ``sum(token losses) / N`` (transformers' ``num_items_in_batch``), so the
step's gradient does not depend on how the samples were split. Then: GradScaler unscale (fp16), clipping,
optimizer step, scheduler step.

Memory accounting: on CUDA ``torch.cuda.max_memory_allocated`` (``--gpu-mem`` also caps the process with
``torch.cuda.set_per_process_memory_fraction``); on CPU a :class:`oomdoctor.execute.tracking.LiveBytes` dispatch mode counts
live tensor bytes (weights, gradients, optimizer state, activations) and, with ``--gpu-mem``, raises torch's
``OutOfMemoryError`` past the cap — the OOM guard is then exercised for real.

Data parallel (under torchrun): ``strategy`` ddp replicates the model (``oomdoctor.execute.dist``); fsdp shards it
with FSDP2 (``oomdoctor.execute.shard``: built on the meta device, filled from rank 0's copy, sharded checkpoints
through ``torch.distributed.checkpoint``), and an OOM there restarts the job smaller (``oomdoctor.train.restart``);
zero2/zero3 run the same steps through a DeepSpeed engine (``oomdoctor.execute.zero``), with DeepSpeed's checkpoints
and the same restarts.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from oomdoctor.errors import BadInput, Interrupted, UnrecoverableOOM, WriteFailed
from oomdoctor.execute import dist
from oomdoctor.execute.step import StepHooks
from oomdoctor.files import write_file_atomic
from oomdoctor.gpu import detect_gpu
from oomdoctor.imports import cheap_imports
from oomdoctor.noise import quiet_third_party
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import DEFAULT_MICRO_LIMIT, choose_micro_batch, max_fitting
from oomdoctor.plan.plan import DEEPSPEED, SHARDED
from oomdoctor.plan.techniques import TORCH_OPTIMIZERS
from oomdoctor.plan.budget import Budget, resolve_budget
from oomdoctor.progress import report
from oomdoctor.train.config import TrainConfig
from oomdoctor.units import format_bytes

#: Uncapped CPU runs measure the peak over this many optimizer steps, then stop metering (optimizer state appears
#: at the first step; the second is the steady state).
METER_STEPS = 2
#: Testing aid: seconds to sleep after each optimizer step (lets a test SIGKILL a run mid-way deterministically).
STEP_DELAY_ENV = "OOMDOCTOR_STEP_DELAY_S"


def set_allocator_env() -> None:
    """``expandable_segments`` avoids fragmentation OOMs (torchtune #1185); setdefault: a user's value wins. Must run
    before CUDA is initialized (the allocator reads it once)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


@dataclass
class TrainResult:
    """What a run did (the ``--json`` summary; also written to ``<output_dir>/summary.json``)."""

    optimizer_steps: int
    """Optimizer steps completed (total, including those before a resume)."""
    effective_batch_size: int
    """Samples per optimizer step (unchanged by OOM recoveries)."""
    micro_batch_size: int
    """Micro-batch at the end (smaller than configured after an OOM recovery)."""
    gradient_accumulation_steps: int
    """Micro-batches per step at the end (ceil(effective / micro))."""
    oom_recoveries: int
    """OOMs recovered by splitting a micro-batch."""
    measured_peak_bytes: int
    """Peak live tensor bytes of this process's run (CUDA: max_memory_allocated; CPU: LiveBytes)."""
    memory: dict | None
    """Predicted breakdown (``oomdoctor.memory.estimate``; same keys as diagnose), None if it could not be priced."""
    final_loss: float | None
    """Loss of the last optimizer step (token-weighted mean)."""
    checkpoint: str | None
    """Path of the last checkpoint written."""
    first_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    """Tokens processed (incl. padding) in this process."""
    loss_tokens: int = 0
    """Of ``tokens``: those that count in the loss (not padding, not masked prompt tokens)."""
    output_dir: str = ""
    """Where the final model (``save_pretrained``), tokenizer, checkpoints and this summary are."""
    epoch: float = 0.0
    """Passes over the training data done (HF's ``epoch``)."""
    world_size: int = 1
    """Processes of the data-parallel job (torchrun ``--nproc-per-node`` x nodes)."""
    strategy: str = "single"
    """``single``, ``ddp``, ``fsdp``, ``zero2`` or ``zero3`` (the plan's, after normalization)."""
    restarts: int = 0
    """Restarts torchrun made (``--max-restarts``): under fsdp, each one an OOM that resumed with half the
    micro-batch (``recoveries`` entries with ``restart: true``)."""
    eval_loss: float | None = None
    """Token-weighted loss on the eval set at the end (None without ``dataset.eval_split`` / ``eval_path``)."""
    tokens_per_second: float = 0.0
    wall_seconds: float = 0.0
    device: str = "cpu"
    cap_bytes: int | None = None
    resumed_from: str | None = None
    recoveries: list[dict] = field(default_factory=list)
    num_params: int = 0
    num_trainable_params: int = 0
    plan: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


Event = Callable[[dict], None]


def predict_memory(cfg: TrainConfig, micro_batch: int, engine: str = "analytic", device: str = "cuda"):
    """(spec, plan, MemoryBreakdown or None, note) for the config at ``micro_batch`` on ``device``."""
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec

    spec = load_spec(cfg.model_ref)
    plan = cfg.to_plan(micro_batch=micro_batch)
    try:
        return spec, plan, estimate(spec, plan, engine, device), None
    except (ImportError, ModuleNotFoundError) as exc:
        return spec, plan, None, f"memory engine {engine!r} unavailable: {exc}"


def run_budget(cfg: TrainConfig, gpu_mem: int | None, *, on_cpu: bool) -> Budget | None:
    """The budget of a run and of its dry run (``oomdoctor.plan.budget``, the rule every verb uses): ``--gpu-mem``,
    else the config's ``gpu_mem``, else the GPU's free memory (NVML; not for a CPU run), else None. On the CPU the
    capacity caps live tensor bytes, so the rule counts ``peak_allocated``."""
    if gpu_mem is not None:
        return resolve_budget(gpu_mem, None, None, on_cpu=on_cpu)
    if cfg.gpu_mem is not None:
        return resolve_budget(cfg.gpu_mem, None, None, gpu_mem_source="config gpu_mem", on_cpu=on_cpu)
    return None if on_cpu else resolve_budget(None, None, detect_gpu())


def auto_micro_batch(cfg: TrainConfig, budget: Budget | None, engine: str = "analytic", device: str = "cuda") -> int:
    """``micro_batch_size: auto``: the largest micro-batch whose predicted memory on ``device`` fits ``budget``
    (``Budget.fits``, priced as the dry run prices the config: ``cfg.to_plan(micro_batch=b)``, accumulation
    included), by :func:`oomdoctor.plan.batch.max_fitting`; with a ``global_batch_size`` the largest divisor of it,
    so the effective batch stays exact."""
    from oomdoctor.errors import DoesNotFit
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec

    if budget is None:
        raise BadInput("micro_batch_size: auto needs a memory budget",
                       "pass --gpu-mem SIZE (or gpu_mem: in the config), or run on a GPU")
    spec = load_spec(cfg.model_ref)
    gbs = cfg.global_batch_size
    cache: dict[int, int] = {}

    def needed(b: int) -> int:
        if b not in cache:
            cache[b] = budget.needed(estimate(spec, cfg.to_plan(micro_batch=b), engine, device))
        return cache[b]

    upper = min(DEFAULT_MICRO_LIMIT, gbs) if gbs else DEFAULT_MICRO_LIMIT
    best = max_fitting(lambda b: needed(b) <= budget.limit_bytes, upper)
    if best < 1:
        cap = format_bytes(budget.capacity_bytes, binary=False).replace(" ", "")
        raise DoesNotFit(
            f"micro_batch_size: auto: not even micro-batch 1 fits {budget.describe()} (predicted "
            f"{format_bytes(needed(1))})",
            f"run `oomdoctor train CONFIG --dry-run --gpu-mem {cap}` for the changes that fit",
        )
    return choose_micro_batch(best, gbs).micro_batch


#: Config keys a resume may change: they alter how the run executes, not what it computes (the effective batch is
#: fingerprinted instead of micro-batch / accumulation; max_steps, as HF allows, only moves the end).
SAFE_TO_CHANGE = frozenset({
    "max_steps", "num_train_epochs", "eval_steps", "per_device_eval_batch_size", "report_to", "merge_adapter",
    "overwrite_output_dir", "dataset.eval_path", "micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "offload_activations",
    "output_dir", "save_steps", "save_total_limit", "logging_steps", "gpu_mem", "max_oom_retries", "device",
    "model.attn_implementation", "optim_impl", "reshard_after_forward", "shard_group",
})


def _flatten(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _fingerprint(cfg: TrainConfig) -> dict:
    """Every setting that must match for a resume to continue the same run (JSON values), i.e. all config keys but
    :data:`SAFE_TO_CHANGE`, plus the effective batch."""
    import json
    from dataclasses import asdict

    flat = {k: v for k, v in _flatten(asdict(cfg)).items() if k not in SAFE_TO_CHANGE}
    flat["effective_batch_size"] = cfg.effective_batch_size
    flat["model.shape"] = _model_shape(cfg)
    return json.loads(json.dumps(flat, default=str))


#: config.json keys that decide the shapes of the weights a checkpoint holds.
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "num_local_experts")


def _model_shape(cfg: TrainConfig) -> str:
    """The shape-deciding keys of the model's config.json (an edited config at the same path is a different run);
    ``?`` when there is no local config to read (a hub id)."""
    import json

    ref = Path(cfg.model_ref or "")
    f = ref / "config.json" if ref.is_dir() else ref
    try:
        c = json.loads(f.read_text())
    except (OSError, ValueError):
        return "?"
    return " ".join(f"{k}={c[k]}" for k in SHAPE_KEYS if k in c)


def fingerprint_changes(saved: dict, now: dict) -> list[str]:
    """``key: old -> new`` for every fingerprinted setting that differs. A key the saved fingerprint lacks (a setting
    oomdoctor added after the checkpoint was written, e.g. ``adapter_dtype``) was at its default then."""
    import json
    from dataclasses import asdict

    defaults = json.loads(json.dumps(_flatten(asdict(TrainConfig())), default=str))
    saved = {**{k: defaults[k] for k in now if k not in saved and k in defaults}, **saved}
    keys = sorted(set(saved) | set(now))
    return [f"{k}: {saved.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}" for k in keys if saved.get(k) != now.get(k)]


@dataclass
class RunState:
    """What a run has done so far: the part of a checkpoint that is not tensors (``trainer_state.json``)."""

    fingerprint: dict
    """Config keys that must match for a resume to continue the same run (:func:`_fingerprint`)."""
    configured_micro_batch: int
    """The micro-batch the run started with (a changed config value wins over what the OOM guard learned)."""
    micro_batch: int
    """The micro-batch now (smaller after an OOM recovery)."""
    step: int = 0
    """Optimizer steps completed."""
    samples_seen: int = 0
    """Samples consumed (the data position)."""
    oom_recoveries: int = 0
    """OOMs recovered by splitting a micro-batch."""
    losses: list[float] = field(default_factory=list)
    """Loss of every optimizer step."""
    recoveries: list[dict] = field(default_factory=list)
    """Each recovery (``oomdoctor.execute.oom.Recovery.to_dict``)."""

    def to_json(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    def resumed(self, saved: dict) -> "RunState":
        """This state continued from a checkpoint's ``trainer_state.json`` (``saved``)."""
        micro = self.micro_batch
        if saved.get("configured_micro_batch") == self.configured_micro_batch:
            micro = int(saved.get("micro_batch", micro))  # keep what the OOM guard learned
        return replace(self, step=int(saved["step"]), micro_batch=micro,
                       samples_seen=int(saved.get("samples_seen", 0)),
                       oom_recoveries=int(saved.get("oom_recoveries", 0)),
                       losses=[float(x) for x in saved.get("losses", [])],
                       recoveries=list(saved.get("recoveries", [])))


@dataclass
class Run:
    """Everything a run set up before its first step."""

    cfg: TrainConfig
    device: Any
    """torch device the run trains on."""
    cap: int | None
    """Capacity enforced on the process (``--gpu-mem`` / ``gpu_mem``), None when uncapped."""
    data: Any
    """Tokenized samples (``oomdoctor.train.data.TokenizedData``)."""
    effective_batch: int
    """Samples per optimizer step."""
    plan: Plan
    """The plan priced and run."""
    memory: dict | None
    """Predicted breakdown (diagnose's keys), None when it could not be priced."""
    loaded: Any
    """``oomdoctor.execute.load.LoadedModel``."""
    step: Any
    """``oomdoctor.execute.step.TrainStep`` (model, optimizer, scaler)."""
    scheduler: Any
    """LR scheduler."""
    order: Any
    """``oomdoctor.train.data.SampleOrder``: seeded, a function of the data position (a resume continues it)."""
    dist: Any = None
    """``oomdoctor.execute.dist.DistInfo``: this process's rank in a torchrun job (world size 1 alone)."""
    total_steps: int = 1
    """Optimizer steps of the run: ``max_steps``, else ``ceil(num_train_epochs x samples / effective batch)``."""
    eval_samples: list = field(default_factory=list)
    """Held-back / separate eval samples (empty: no eval)."""
    tokenizer: Any = None
    """The tokenizer (saved next to the final model)."""
    meter: Any = None
    """CPU: the LiveBytes meter — on for the whole run with a cap, else for the first :data:`METER_STEPS` steps;
    CUDA: None (the allocator's statistics)."""
    notes: list[str] = field(default_factory=list)
    command: str = "oomdoctor train CONFIG"
    """How the user started the run (named in hints)."""

    @property
    def sharded(self) -> bool:
        """FSDP2: sharded model, DCP checkpoints."""
        return self.plan.strategy == "fsdp"

    @property
    def zero(self) -> bool:
        """DeepSpeed ZeRO-2/3: ``step.model`` is the engine, ``oomdoctor.execute.zero``."""
        return self.plan.strategy in DEEPSPEED

    @property
    def averages_grads(self) -> bool:
        """FSDP2 and DeepSpeed average the gradients over the ranks in backward (DDP here sums them after it)."""
        return self.sharded or self.zero

    @property
    def restarts_on_oom(self) -> bool:
        """FSDP2 / ZeRO on several ranks: an OOM restarts the job (one rank alone splits the micro-batch in-process;
        a ZeRO rank alone cannot undo DeepSpeed's partial gradients, so its OOM is not recovered)."""
        return self.averages_grads and self.dist.enabled

    @property
    def rank_batch(self) -> int:
        """Samples each process runs per optimizer step (the effective batch over the world size)."""
        return self.effective_batch // self.dist.world_size if self.dist else self.effective_batch

    def peak_bytes(self) -> int:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self.meter.peak) if self.meter is not None else 0


class _GuardHooks(StepHooks):
    """The step's hooks for the OOM guard (did backward start?) and the CPU meter (optimizer state)."""

    def __init__(self, touch, meter):
        self.touch, self.meter = touch, meter

    def backward_start(self) -> None:
        self.touch.in_backward = True

    def optimizer_stepped(self, optimizer, step_index: int) -> None:
        from oomdoctor.execute.optim import CPUOffloadOptimizer

        if self.meter is not None and step_index == 0 and not isinstance(optimizer, CPUOffloadOptimizer):
            self.meter.track_optimizer(optimizer)


def _predict(cfg: TrainConfig, micro: int, engine: str, notes: list[str], device: str) -> tuple[Plan, dict | None]:
    """The plan at ``micro`` and its predicted breakdown on ``device`` (never stops a run: failures become notes)."""
    plan = cfg.to_plan(micro_batch=micro)
    try:
        _, _, mem, note = predict_memory(cfg, micro, engine, device)
        if note:
            notes.append(note)
        return plan, (mem.to_dict() if mem is not None else None)
    except Exception as exc:  # noqa: BLE001 - the prediction must never stop a training run
        notes.append(f"memory prediction failed: {type(exc).__name__}: {exc}")
        return plan, None


def resolve_topology(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """The config as a job of ``world_size`` processes runs it, or BadInput (one message) for what train cannot run.

    ``world_size: 1`` (the default) follows the launcher; a larger value must equal the processes launched.
    Strategies: ``single``/``ddp`` (normalized by the plan from the world size), ``fsdp`` (FSDP2; also what
    ``offload_params`` normalizes to) and DeepSpeed's ``zero2``/``zero3`` (the optional ``deepspeed`` extra)."""
    if cfg.world_size not in (1, world_size):
        raise BadInput(f"world_size: {cfg.world_size} in the config, but this job has {world_size} process(es)",
                       f"run `oomdoctor train CONFIG --nproc-per-node {cfg.world_size}` (or N per node with --nnodes), "
                       "or remove world_size to follow the launcher")
    cfg = replace(cfg, world_size=world_size)
    plan = cfg.to_plan(micro_batch=cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 1)
    if plan.strategy in DEEPSPEED:
        from oomdoctor.execute.zero import require_deepspeed

        require_deepspeed()
    elif plan.strategy != "fsdp":
        return cfg
    problems = []
    if plan.quant is not None:
        problems.append("a bitsandbytes-quantized base (QLoRA) cannot be sharded by train; use strategy ddp")
    if plan.precision == "fp16-mixed":
        problems.append("fp16-mixed: " + ("GradScaler's inf/NaN check would see only this rank's gradient shards"
                                          if plan.strategy == "fsdp" else "DeepSpeed's fp16 runs a loss scaler of "
                                          "its own that train does not drive") + "; use bf16-mixed (or fp32)")
    if plan.optimizer not in TORCH_OPTIMIZERS:
        problems.append(f"optim {cfg.optim}: the sharded step runs torch optimizers only (adamw_torch, sgd)")
    if cfg.merge_adapter:
        problems.append("merge_adapter: merge the saved adapter after the run (the sharded run saves the adapter)")
    if problems:
        what = "DeepSpeed ZeRO" if plan.strategy != "fsdp" else "offload_params" if plan.offload_params else "FSDP2"
        raise BadInput(f"strategy {plan.strategy} ({what}): " + "; ".join(problems),
                       "change the config, or run it with strategy ddp")
    return cfg


def total_steps(cfg: TrainConfig, n_samples: int, effective_batch: int) -> int:
    """Optimizer steps of a run: ``max_steps`` when set (it overrides epochs, as in HF; -1 is HF's unset), else
    enough steps for ``num_train_epochs`` passes over ``n_samples`` (at least one)."""
    if cfg.max_steps not in (None, -1):
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * n_samples / effective_batch))


def _setup(cfg: TrainConfig, gpu_mem: int | None, engine: str, emit: Event, tok, notes: list[str]) -> Run:
    """Budget, data (``tok``: the run's tokenizer), micro-batch, prediction, model, optimizer, schedule, step and
    meter of a run (each stage reported as progress); ``notes``: what the run already has to say."""
    import torch

    from oomdoctor.execute.load import load_model, resolve_device
    from oomdoctor.execute.optim import CPUOffloadOptimizer, OptimizerArgs, make_plan_optimizer, make_scheduler
    from oomdoctor.execute.step import TrainStep
    from oomdoctor.train.data import SampleOrder, tokenize
    from oomdoctor.train.evaluate import eval_samples
    from oomdoctor.train.preflight import model_source
    from oomdoctor.train.report import check_sinks

    check_sinks(cfg.report_to)
    info = dist.from_env()
    device = resolve_device(cfg.device)
    if info.enabled and device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if info.enabled and cfg.optimizer_in_backward:
        raise BadInput("optimizer_in_backward steps each rank's local gradients in backward, before the ranks sum "
                       "them: it cannot run data-parallel", "drop optimizer_in_backward, or train on one process")
    budget = run_budget(cfg, gpu_mem, on_cpu=device.type == "cpu")
    # the run cap enforces a capacity the user named (--gpu-mem / gpu_mem); NVML free memory needs no cap
    cap = budget.capacity_bytes if budget is not None and budget.source != "nvml free" else None
    if device.type == "cpu" and cfg.precision == "fp16-mixed":
        notes.append("fp16 autocast on CPU: GradScaler runs but CPU fp16 matmuls are slow")
    source = model_source(cfg)
    report("train", "setting up: tokenizing the dataset")
    data = tokenize(cfg.dataset, tok, cfg.seq_len)
    notes += data.notes
    data, held = eval_samples(cfg.dataset, tok, cfg.seq_len, data, cfg.seed)
    if data.truncated:
        notes.append(f"{data.truncated} samples truncated to seq_len {cfg.seq_len}")
    micro = cfg.micro_batch_size
    if micro == "auto":
        micro = auto_micro_batch(cfg, budget, engine, device.type)
        emit({"type": "info", "message": f"micro_batch_size auto -> {micro}"})
    # effective batch = micro x accumulation x world size (HF); global_batch_size fixes it across the ranks
    eff = cfg.global_batch_size or int(micro) * cfg.gradient_accumulation_steps * info.world_size
    if eff % info.world_size:
        raise BadInput(f"global_batch_size {eff} is not divisible by the {info.world_size} processes",
                       f"use a multiple of {info.world_size}")
    total = total_steps(cfg, len(data), eff)
    report("train", f"setting up: pricing the plan ({engine} engine)")
    plan, memory = _predict(cfg, int(micro), engine, notes, device.type)

    # the process group only now: the prediction may run the simulate engine, which makes a fake group of its own
    sharded = plan.strategy == "fsdp"
    zero = plan.strategy in DEEPSPEED
    dist.init(info, device.type, one_rank_group=plan.strategy in SHARDED, shared_dir=cfg.output_dir)
    torch.manual_seed(cfg.seed)
    args = OptimizerArgs(learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
                         adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_epsilon)
    target = "gpu" if device.type == "cuda" else "cpu"
    _check_host_ram(plan, memory, notes)
    report("train", "setting up: loading the model" + (" (weights from disk)" if cfg.model.path else ""))
    if sharded:
        from oomdoctor.execute.load import load_sharded_model
        from oomdoctor.execute.shard import device_mesh

        loaded = load_sharded_model(source, plan, device, device_mesh(plan, device.type), is_main=info.is_main,
                                    vocab_size=len(tok), seed=cfg.seed)
        _agree_rng(info)
    else:
        loaded = load_model(source, plan, device, vocab_size=len(tok), seed=cfg.seed,
                            compute_dtype=cfg.bnb_4bit_compute_dtype)
    report("train", "setting up: the optimizer and the training step")
    optimizer = make_plan_optimizer(loaded.trainable, plan, args, target=target)
    scheduler = make_scheduler(cfg.lr_scheduler_type, optimizer, warmup_steps=min(cfg.warmup_steps, total),
                               total_steps=total)
    engine = None
    if zero:
        from oomdoctor.execute import zero as ds

        config = ds.zero_config(plan, loaded.model.config.hidden_size, ds.ZeroRun(
            micro_batch=int(micro), grad_accum=max(1, eff // (int(micro) * info.world_size)),
            max_grad_norm=cfg.max_grad_norm, device_type=device.type))
        engine = ds.initialize(loaded.model, optimizer, config)
    meter = None
    if device.type == "cuda":
        if cap is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        from oomdoctor.execute.tracking import LiveBytes

        meter = LiveBytes(cap_bytes=cap, history=False)
        meter.track_module(loaded.model, None if isinstance(optimizer, CPUOffloadOptimizer) else optimizer,
                           grad_hooks=True)
    if engine is not None:  # clipping, the step and zeroing the gradients are engine.step()'s
        step = TrainStep(engine, ds.EngineOptimizer(engine), plan, device_type=device.type, max_grad_norm=None,
                         backward=lambda loss: engine.backward(loss, scale_wrt_gas=False))
    elif sharded:
        from oomdoctor.execute.shard import clip_grad_norm

        step = TrainStep(loaded.model, optimizer, plan, device_type=device.type, max_grad_norm=cfg.max_grad_norm,
                         clip=clip_grad_norm)
    else:
        step = TrainStep(dist.wrap(loaded.model, info, device), optimizer, plan, device_type=device.type,
                         max_grad_norm=cfg.max_grad_norm)
    return Run(cfg=cfg, device=device, cap=cap, data=data, effective_batch=eff, plan=plan, memory=memory,
               loaded=loaded, step=step, scheduler=scheduler, meter=meter, notes=notes, tokenizer=tok,
               order=SampleOrder(len(data), cfg.seed, cfg.dataset.shuffle), total_steps=total, eval_samples=held,
               dist=info)


def _check_host_ram(plan: Plan, memory: dict | None, notes: list[str]) -> None:
    """Offloaded states and activations (FSDP2 ``offload_params``, ZeRO offload, ``save_on_cpu``): this node's host
    RAM must hold what its ranks
    (``LOCAL_WORLD_SIZE``) offload, by the rule tune applies (``memory.sharding.node_host_bytes``); checked before
    the model is loaded."""
    from oomdoctor.errors import DoesNotFit
    from oomdoctor.gpu import host_ram_bytes
    from oomdoctor.memory.sharding import node_host_bytes

    if not (plan.offload_params or plan.offload_optimizer or plan.offload_activations):
        return
    per_node = int((memory or {}).get("host_per_node_bytes") or 0)
    ram = host_ram_bytes()
    if not per_node or ram is None:
        notes.append("offload: host RAM not checked (no prediction of the offloaded bytes)")
        return
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    need = node_host_bytes(per_node, plan, ranks)
    if need > ram:
        raise DoesNotFit(f"offload: {ranks} rank(s) on this node offload {format_bytes(need)} > this host's "
                         f"{format_bytes(ram)} of RAM", "shard over more ranks/nodes, use LoRA, or a host with more "
                         "memory")


def _agree_rng(info) -> None:
    """Every rank continues with rank 0's RNG state (only rank 0 drew the initial weights of a sharded load)."""
    import torch
    import torch.distributed as tdist

    if info.enabled:
        state = [torch.get_rng_state()]
        tdist.broadcast_object_list(state, src=0)
        torch.set_rng_state(state[0])


def _start_state(run: Run, resume: bool, emit: Event) -> tuple[RunState, str | None]:
    """A fresh state, or the state of the newest readable checkpoint (weights, optimizer, scheduler, scaler and RNG
    restored; an unreadable checkpoint is reported and the one before it used). Settings are compared before any
    tensor is loaded: a change outside :data:`SAFE_TO_CHANGE` is refused, listing every difference.
    Returns (state, checkpoint resumed from)."""
    from oomdoctor.train import checkpoint as ckpt

    cfg, micro = run.cfg, run.plan.micro_batch
    state = RunState(fingerprint=_fingerprint(cfg), configured_micro_batch=micro, micro_batch=micro)
    if not resume:
        return state, None
    out_dir = Path(cfg.output_dir)
    candidates = list(reversed(ckpt.list_checkpoints(out_dir)))
    if not candidates:
        raise BadInput(f"--resume: no checkpoint in {out_dir}", "run without --resume to start fresh")
    for _, path in candidates:
        try:
            saved_state = ckpt.read_state(path)
        except ckpt.CorruptCheckpoint as exc:
            emit({"type": "info", "message": f"{path} is unreadable ({exc}); trying the one before"})
            continue
        changes = fingerprint_changes(saved_state.get("fingerprint", {}), state.fingerprint)
        if changes:
            raise BadInput(
                f"--resume: {path} was written by a different run; changed settings:\n  " + "\n  ".join(changes),
                "resume with the original settings (safe to change: " + ", ".join(sorted(SAFE_TO_CHANGE)) + "), "
                "or start over with --overwrite or another output_dir")
        try:
            if run.averages_grads:
                saved = ckpt.load_sharded_checkpoint(path, model=run.loaded.model, is_peft=run.loaded.is_peft,
                                                     optimizer=run.step.optimizer, scheduler=run.scheduler,
                                                     rank=run.dist.rank, engine=_engine(run))
            else:
                saved = ckpt.load_checkpoint(path, model=run.loaded.model, is_peft=run.loaded.is_peft,
                                             optimizer=run.step.optimizer, scheduler=run.scheduler,
                                             scaler=run.step.scaler)
            failed = None
        except ckpt.CorruptCheckpoint as exc:
            failed = exc
        if run.averages_grads and _any_rank(failed is not None, run.dist):  # fall back together
            failed = failed or ckpt.CorruptCheckpoint("another rank could not read its part")
        if failed is not None:
            emit({"type": "info", "message": f"{path} is unreadable ({failed}); trying the one before"})
            continue
        resumed = state.resumed(saved)
        if saved.get("configured_micro_batch") != micro:  # the user changed micro_batch_size (e.g. to fix an OOM)
            emit({"type": "info", "message": f"micro_batch_size changed since the checkpoint: using {micro}"})
        emit({"type": "info", "message": f"resumed from {path} at step {resumed.step}"})
        return resumed, str(path)
    raise BadInput(f"--resume: no readable checkpoint in {out_dir} (every one is damaged)",
                   "start over with --overwrite, or restore a checkpoint from a backup")


def _any_rank(flag: bool, info) -> bool:
    """Whether ``flag`` holds on any rank (a tiny all-reduce; the flag itself alone)."""
    import torch

    return int(dist.all_reduce_sum(torch.tensor(int(flag)), info)) > 0


def _save(run: Run, state: RunState, guard, emit: Event) -> str:
    """A checkpoint of the step just completed (rank 0 writes it; the other ranks wait for it; sharded: every rank
    writes its shards). A disk that fills stops the run with WriteFailed (the previous checkpoint intact), whose hint
    says how much room one checkpoint needs and how to continue."""
    from oomdoctor.train import checkpoint as ckpt

    state.micro_batch = guard.micro_batch
    try:
        path = _write_checkpoint(run, state)
    except WriteFailed as exc:
        raise WriteFailed(exc.message, f"one checkpoint needs about {format_bytes(_checkpoint_bytes(run))} free there: "
                                       f"free space or move output_dir, then continue with `{run.command} --resume`"
                          ) from None
    if path is None:  # a rank of a replicated run: rank 0 wrote it
        return str(ckpt.checkpoint_dir(run.cfg.output_dir, state.step))
    emit({"type": "checkpoint", "step": state.step, "path": str(path)})
    if not run.averages_grads:
        dist.barrier(run.dist)
    return str(path)


def _write_checkpoint(run: Run, state: RunState) -> Path | None:
    """Write ``checkpoint-<step>``: collectively when the ranks hold shards, else on rank 0 (None on the others,
    after waiting for it)."""
    from oomdoctor.train import checkpoint as ckpt
    from oomdoctor.train.restart import job

    if run.averages_grads:
        return ckpt.save_sharded_checkpoint(run.cfg.output_dir, state.step, model=run.loaded.model,
                                            is_peft=run.loaded.is_peft, optimizer=run.step.optimizer,
                                            scheduler=run.scheduler, state=state.to_json(), rank=run.dist.rank,
                                            tag=job().run_id or "job", save_total_limit=run.cfg.save_total_limit,
                                            engine=_engine(run))
    if not run.dist.is_main:
        dist.barrier(run.dist)
        return None
    return ckpt.save_checkpoint(run.cfg.output_dir, state.step, model=run.loaded.model, is_peft=run.loaded.is_peft,
                                optimizer=run.step.optimizer, scheduler=run.scheduler, scaler=run.step.scaler,
                                state=state.to_json(), save_total_limit=run.cfg.save_total_limit)


def _engine(run: Run) -> Any:
    """The DeepSpeed engine of a ZeRO run (None otherwise)."""
    return run.step.model if run.zero else None


def _diagnosis(run: Run, state: RunState, phase: str, reason: str, message: str, micro: int = 1) -> str:
    """What an unrecoverable OOM says: where, the budget, what the prediction holds."""
    lines = [f"out of memory at step {state.step + 1} in {phase} with micro-batch {micro} x seq_len "
             f"{run.cfg.seq_len} ({reason})"]
    if run.cap is not None:
        held = format_bytes(run.meter.current) if run.meter else "?"
        lines.append(f"budget {format_bytes(run.cap)}; held outside the failed micro-batch (weights, gradients, "
                     f"optimizer state): {held}: too little is left for one sample's activations")
    if run.memory:
        comps = {k[:-6]: v for k, v in run.memory.items() if k.endswith("_bytes") and not k.startswith("peak") and v}
        top = sorted(comps.items(), key=lambda kv: -kv[1])[:4]
        lines.append("predicted (micro-batch %d): " % run.plan.micro_batch
                     + ", ".join(f"{k} {format_bytes(v)}" for k, v in top))
    lines.append(f"OOM message: {message.splitlines()[0][:200]}")
    return "\n".join(lines)


def _warn_if_nothing_trains(run: Run, emit: Event) -> None:
    """Field notes 1.4: with GC + PEFT a missing input-grad hook trains nothing, silently."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    def local(g):  # a sharded gradient: this rank's shard (the ranks then agree)
        return g.to_local() if hasattr(g, "to_local") else g

    with torch.no_grad(), _disable_current_modes():  # a check, not part of the budget
        live = any(p.grad is not None and bool(local(p.grad).abs().sum() > 0) for p in run.loaded.trainable)
    if run.sharded:
        live = _any_rank(live, run.dist)
    if not live:
        msg = "no gradient reached the trainable parameters in the first step: nothing trains"
        run.notes.append(msg)
        emit({"type": "info", "message": "warning: " + msg})


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    loss: float
    """Token-weighted loss of the step's samples."""
    tokens: int
    """Tokens run (padding included)."""
    loss_tokens: int
    """Tokens that count in the loss."""
    applied: bool
    """False when the fp16 scaler skipped the update (inf/NaN gradients)."""


def _one_step(run: Run, state: RunState, guard, touch, emit: Event, last_ckpt: str | None,
              check_grads: bool) -> StepOutcome:
    """One optimizer step over ``effective_batch`` samples through the OOM guard (one host sync: the loss)."""
    import torch

    from oomdoctor.execute.oom import OOMAtMicroBatchOne, free_memory, is_oom
    from oomdoctor.train.data import collate, count_targets, flattens
    from oomdoctor.train.restart import injected_oom, job

    cfg, data, info = run.cfg, run.data, run.dist
    idx = run.order.take(state.samples_seen, run.effective_batch)
    # data parallel: the step's samples are dealt to the ranks; every rank divides by the global target count
    samples = [data.samples[i] for i in idx[info.rank::info.world_size]]
    n_targets = count_targets(samples)
    if info.enabled:
        n_targets = int(dist.all_reduce_sum(torch.tensor(n_targets, dtype=torch.long), info))
    n_targets = max(1, n_targets)
    # FSDP2 and DeepSpeed average the reduce-scattered gradients over the ranks (gloo cannot sum with a custom
    # factor): each rank's loss is scaled up by the world size to keep the sum over ranks / global target count
    n_items = n_targets / info.world_size if run.averages_grads else n_targets
    tokens = [0]
    inject = injected_oom(state.step + 1, info.rank, job())

    def run_chunk(chunk: list):
        if inject:
            raise torch.OutOfMemoryError("out of memory (injected by OOMDOCTOR_INJECT_OOM)")
        batch = collate(chunk, data.pad_id, cfg.dataset.pad_to_multiple_of, data.reset_positions,
                        flattens(cfg.model.attn_implementation))
        batch = {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}
        tokens[0] += int(batch["input_ids"].numel())
        try:
            # DDP: gradients are summed over the ranks once, after the step's backward (DeepSpeed: in each backward)
            with contextlib.nullcontext() if run.zero else dist.no_sync(run.step.model):
                return run.step.forward_backward(batch, num_items_in_batch=n_items)  # a tensor: no sync here
        except BaseException:
            if run.sharded and not run.restarts_on_oom:  # one FSDP rank: the guard retries in-process
                from oomdoctor.execute.shard import reset_after_error

                reset_after_error(run.step.model)
                # FSDP sets the sharded gradients itself (no post-accumulate hook fires): any backward may have
                # left some, so the guard replays the step
                touch.touched = touch.touched or touch.in_backward
            raise

    def zero_grads() -> None:
        run.step.optimizer.zero_grad(set_to_none=True)

    try:
        loss, _ = guard.run_step(state.step + 1, samples, run_chunk, zero_grads, touch)
    except OOMAtMicroBatchOne as exc:
        if run.restarts_on_oom:
            _restart_smaller(run, state, guard.micro_batch, exc, last_ckpt)
        zero_grads()
        free_memory()
        where = _save(run, state, guard, emit)  # as of the start of this step: weights untouched, data not consumed
        reason, micro = _zero_alone(run, exc.reason, guard.micro_batch)
        raise UnrecoverableOOM(
            _diagnosis(run, state, exc.phase, reason, exc.message, micro) + f"\ncheckpoint saved: {where}",
            f"fix the plan (`{run.command} --dry-run --gpu-mem SIZE` lists changes that fit), "
            f"then `{run.command} --resume`",
        ) from None
    if not run.averages_grads:  # FSDP / DeepSpeed reduce-scattered the gradients in backward
        dist.all_reduce_grads(run.loaded.trainable, info)
    if info.enabled:
        loss = dist.all_reduce_sum(loss.detach().clone(), info)
    if run.averages_grads:
        loss = loss / info.world_size
    if check_grads:
        _warn_if_nothing_trains(run, emit)
    try:
        applied = run.step.optimizer_step()
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
        raise UnrecoverableOOM(
            f"out of memory in the optimizer step {state.step + 1} (the optimizer state is allocated at the "
            f"first step; a smaller micro-batch does not shrink it). The in-memory state may be "
            f"partially updated, so no checkpoint was written; last checkpoint: {last_ckpt or 'none'}",
            "use a leaner optimizer (optim: adamw_bnb_8bit / adafactor), offload_optimizer: true or "
            f"LoRA; check with `{run.command} --dry-run --gpu-mem SIZE`",
        ) from None
    if applied:  # fp16: a step the scaler skipped (inf/NaN gradients) does not advance the schedule
        run.scheduler.step()
    return StepOutcome(float(loss), tokens[0], n_targets, applied)


def _zero_alone(run: Run, reason: str, micro: int) -> tuple[str, int]:
    """(reason, micro-batch) of an unrecoverable OOM; one ZeRO process does not split (DeepSpeed's partial gradients
    cannot be undone in-process) and says so."""
    if run.zero and not run.restarts_on_oom and micro > 1:
        return (f"one DeepSpeed ZeRO process does not split a micro-batch after an OOM; set micro_batch_size "
                f"{micro // 2}", micro)
    return reason, 1


def _restart_smaller(run: Run, state: RunState, micro: int, exc, last_ckpt: str | None) -> None:
    """A sharded rank ran out of memory: no collective can agree on a split (the peers are inside FSDP's
    all-gathers), so write the OOM marker and exit for torchrun to restart every rank with half the micro-batch
    (``oomdoctor.train.restart``); exit 4 instead when the micro-batch is 1, the OOM budget or the restarts are
    spent."""
    from oomdoctor.errors import EXIT_OOM_RESTART
    from oomdoctor.train import restart

    current = restart.job()
    spent = state.oom_recoveries >= run.cfg.max_oom_retries or not current.restarts_left
    if micro <= 1 or spent:
        why = "micro-batch 1" if micro <= 1 else (
            f"torchrun has no restart left (--max-restarts {current.max_restarts})" if not current.restarts_left
            else f"max_oom_retries {run.cfg.max_oom_retries} reached")
        raise UnrecoverableOOM(
            _diagnosis(run, state, exc.phase, why, exc.message, micro)
            + f"\nlast checkpoint: {last_ckpt or 'none'} (a sharded rank cannot save after an OOM)",
            f"fix the plan (`{run.command} --dry-run --gpu-mem SIZE` lists changes that fit), then "
            f"`{run.command} --resume`" + ("" if micro <= 1 else ", or allow more with --max-restarts"))
    rec = restart.OOMRestart(step=state.step + 1, failed_micro_batch=micro, new_micro_batch=max(1, micro // 2),
                             phase=exc.phase, message=exc.message.splitlines()[0][:300], rank=run.dist.rank,
                             run_id=current.run_id, attempt=current.attempt)
    restart.write_marker(run.cfg.output_dir, rec)
    import sys

    print(f"rank {run.dist.rank}: out of memory at step {rec.step} ({rec.phase}) with micro-batch {micro}; "
          f"restarting every rank with micro-batch {rec.new_micro_batch}", file=sys.stderr, flush=True)
    os._exit(EXIT_OOM_RESTART)  # no teardown: a collective there would block on the peers


class _StopRequest:
    """Ctrl-C (SIGINT) during training: the first finishes the current step, saves and stops; a second aborts.
    Under torchrun the launcher turns Ctrl-C into SIGTERM for every rank: SIGTERM is handled the same way there,
    and the ranks agree on the step to stop after (:meth:`agreed`)."""

    def __init__(self, emit: Event, info: Any = None):
        self.requested = False
        self._emit = emit
        self._info = info
        self._previous: dict = {}

    def agreed(self) -> bool:
        """Whether to stop after this step: this process's request, or any rank's in a data-parallel job (one tiny
        all-reduce per step, so every rank stops after the same step)."""
        if self._info is None or not self._info.enabled:
            return self.requested
        import torch

        return int(dist.all_reduce_sum(torch.tensor(int(self.requested)), self._info)) > 0

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal protocol
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._emit({"type": "info", "message": "Ctrl-C: finishing this step, then saving a checkpoint "
                                               "(Ctrl-C again to stop at once without saving)"})

    def __enter__(self) -> "_StopRequest":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            sigs = [signal.SIGINT] + ([signal.SIGTERM] if self._info is not None and self._info.enabled else [])
            self._previous = {sig: signal.signal(sig, self._handler) for sig in sigs}
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _checkpoint_bytes(run: Run) -> int:
    """About one checkpoint on disk: the saved weights (all of them, or the adapters) and fp32 optimizer state."""
    trainable = sum(p.numel() for p in run.loaded.trainable)
    weights = trainable * 4 if run.loaded.is_peft else sum(
        p.numel() * p.element_size() for p in run.loaded.model.parameters())
    return weights + 2 * 4 * trainable


def _save_outputs(run: Run, tokenizer, out_dir: Path, emit: Event) -> None:
    """The final model in ``output_dir`` through ``save_pretrained`` (full: weights + config; LoRA: the adapter)
    and the tokenizer, loadable by ``from_pretrained``; written next to the checkpoints by rank 0 (sharded: the
    ranks first gather the whole state dict, on the CPU). ``merge_adapter``: the merged model too, in
    ``output_dir/merged``. Written aside first (``.tmp-final-<pid>``), moved in once complete: a failed write
    (disk full) leaves no partial model and raises WriteFailed naming the last checkpoint."""
    from torch.utils._python_dispatch import _disable_current_modes

    from oomdoctor.train.checkpoint import writing
    from oomdoctor.train.rundir import FINAL_TMP_PREFIX

    with _disable_current_modes():
        full = None
        if run.sharded:
            from oomdoctor.train.checkpoint import full_model_state

            full = full_model_state(run.loaded.model)
        elif run.zero:
            from oomdoctor.execute.zero import full_state_dict

            full = full_state_dict(run.step.model, 3 if run.plan.strategy == "zero3" else 2)
        if not run.dist.is_main:
            return
        tmp = out_dir / f"{FINAL_TMP_PREFIX}{os.getpid()}"
        with writing(tmp, "final model", out_dir, out_dir):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            run.loaded.model.save_pretrained(tmp, safe_serialization=True, state_dict=full)
            tokenizer.save_pretrained(tmp)
            if run.cfg.merge_adapter and run.loaded.is_peft:
                from oomdoctor.execute.build import save_merged

                save_merged(run.loaded.model, tmp / MERGED_DIR)
                tokenizer.save_pretrained(tmp / MERGED_DIR)
            for entry in sorted(tmp.iterdir()):
                dest = out_dir / entry.name
                if dest.is_dir():  # a resumed, finished run writes its outputs again
                    shutil.rmtree(dest)
                os.replace(entry, dest)
            tmp.rmdir()
        if run.cfg.merge_adapter and run.loaded.is_peft:
            emit({"type": "info", "message": f"merged model (base + adapter): {out_dir / MERGED_DIR}"})


#: Subdirectory of ``output_dir`` with the merged model (``merge_adapter: true``).
MERGED_DIR = "merged"


def train(cfg: TrainConfig, *, gpu_mem: int | None = None, max_steps: int | None = None, resume: bool = False,
          overwrite: bool = False, engine: str = "analytic", on_event: Event | None = None,
          command: str = "oomdoctor train CONFIG", source: str = "train config") -> TrainResult:
    """Run the training described by ``cfg``. Raises ConfigErrors (exit 2) for what the config cannot run
    (``train.preflight``, every problem of the config named ``source`` at once) before ``output_dir`` is touched,
    UnrecoverableOOM (exit 4) after saving a checkpoint when even micro-batch 1 runs out of memory, WriteFailed
    (exit 74) when a checkpoint cannot be written (the previous one intact), and
    :class:`oomdoctor.errors.Interrupted` (exit 130) after saving one on Ctrl-C. ``command`` is how the user started
    the run (named in resume hints)."""
    set_allocator_env()
    quiet_third_party()
    cheap_imports()
    from oomdoctor.execute.load import load_tokenizer, quiet_hf
    from oomdoctor.train.preflight import check, model_source
    from oomdoctor.train.rundir import check_space, open_run_dir

    from oomdoctor.train import checkpoint as ckpt
    from oomdoctor.train import restart

    info = dist.from_env()
    # under torchrun only rank 0 talks, owns the run directory (its lock, checks) and writes
    emit = (on_event or (lambda e: None)) if info.is_main else (lambda e: None)
    quiet_hf()
    # one spelling of the run directory for every reader and writer (lock, checkpoints, restart marker, outputs)
    cfg = replace(resolve_topology(cfg, info.world_size), output_dir=str(Path(cfg.output_dir).expanduser()))
    if max_steps is not None:
        cfg = replace(cfg, max_steps=max_steps, warmup_steps=min(cfg.warmup_steps, max_steps))
    tok = load_tokenizer(model_source(cfg))
    notes = check(cfg, source=source, tokenizer=tok)
    current = restart.job()
    out_dir = Path(cfg.output_dir)
    oom = restart.pending(out_dir, current)
    # torchrun restarted the job for an OOM of this launch: continue it (never refuse or wipe the directory again).
    # A restart without that marker continues nothing: it opens the directory as a first attempt would.
    resume = resume or (oom is not None and bool(ckpt.list_checkpoints(out_dir)))
    with contextlib.ExitStack() as scope:
        if info.is_main:
            out_dir = scope.enter_context(open_run_dir(
                cfg.output_dir, resume=resume or oom is not None,
                overwrite=(overwrite or cfg.overwrite_output_dir) and not current.attempt,
                emit=lambda m: emit({"type": "info", "message": m}), restarted=bool(current.attempt))).path
            if not current.attempt:
                restart.clear(out_dir)  # a marker of an earlier launch (a reused torchrun run id) is not this one's
        run = _setup(cfg, gpu_mem, engine, emit, tok, notes)
        run.command = command
        if info.is_main:
            check_space(out_dir, _checkpoint_bytes(run))
        dist.barrier(run.dist)  # the other ranks read checkpoints only once rank 0 has checked the directory
        state, resumed_from = _start_state(run, resume, emit)
        if oom is not None:
            _resume_smaller(state, oom, resumed_from, emit)
        res = _train_loop(run, state, resumed_from, out_dir, emit)
    dist.shutdown()  # not on errors: tearing a group down while a peer is gone can block
    return res


def _resume_smaller(state: RunState, oom, resumed_from: str | None, emit: Event) -> None:
    """After an OOM restart: every rank continues with the marker's micro-batch (the accumulation grows, the
    effective batch stays) and records the recovery."""
    state.micro_batch = min(state.micro_batch, oom.new_micro_batch)
    state.oom_recoveries += 1
    state.recoveries.append(oom.to_dict())
    emit({"type": "info", "message": f"restarted after rank {oom.rank} ran out of memory at step {oom.step} "
                                     f"({oom.phase}) with micro-batch {oom.failed_micro_batch}: every rank "
                                     f"continues from {resumed_from or 'the start'} with micro-batch "
                                     f"{state.micro_batch}, same effective batch"})


def _train_loop(run: Run, state: RunState, resumed_from: str | None, out_dir: Path, emit: Event) -> TrainResult:
    """The steps of a set-up run, then the final outputs and the summary."""
    import torch

    from oomdoctor.execute.oom import GradTouch, OOMGuard
    from oomdoctor.train.report import NullReporter, Reporter

    cfg = run.cfg
    first_step = state.step
    touch = GradTouch()
    run.step.hooks = _GuardHooks(touch, run.meter)  # type: ignore[assignment]
    hooks = [p.register_post_accumulate_grad_hook(lambda _p: setattr(touch, "touched", True))
             for p in run.loaded.trainable]
    # optimizer in backward: a split micro-batch would step every parameter twice, so an OOM is not recovered
    # sharded ranks do not split in-process (an OOM restarts the job: _restart_smaller)
    retries = 0 if run.plan.optimizer_in_backward or run.restarts_on_oom or run.zero else max(
        0, cfg.max_oom_retries - state.oom_recoveries)
    guard = OOMGuard(micro_batch=state.micro_batch, max_retries=retries)

    def on_recovery(rec) -> None:
        state.oom_recoveries += 1
        state.recoveries.append(rec.to_dict())
        emit({"type": "oom", **rec.to_dict(), "grad_accum": math.ceil(run.rank_batch / rec.new_micro_batch)})

    guard.on_recovery = on_recovery
    delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
    last_ckpt: str | None = resumed_from
    tokens_total, loss_tokens, last_loss, skipped, eval_loss = 0, 0, None, 0, None
    t0 = time.perf_counter()
    threads_before = torch.get_num_threads()
    if run.device.type == "cpu" and run.loaded.num_params < 5_000_000 and "OMP_NUM_THREADS" not in os.environ:
        # tiny models: thread fan-out costs more than the ops (measured 0.5 s vs 8 s for 4 steps on a loaded
        # 2-core box); real models keep torch's default. Restored when the run ends.
        torch.set_num_threads(1)
    reporter = Reporter(out_dir, cfg.report_to, run_name=out_dir.name, config=_flatten(asdict(cfg)),
                        resumed_at=state.step) if run.dist.is_main else NullReporter()
    emit({"type": "start", "max_steps": run.total_steps, "step": state.step, "micro_batch": guard.micro_batch,
          "effective_batch": run.effective_batch, "device": str(run.device), "cap": run.cap,
          "samples": len(run.data), "trainable": run.loaded.num_trainable, "params": run.loaded.num_params,
          "plan": run.plan.label()})
    interrupted = False
    try:
        with contextlib.ExitStack() as meter_scope, _StopRequest(emit, run.dist) as stop:
            if run.meter is not None:
                meter_scope.enter_context(run.meter)
            while state.step < run.total_steps:
                # ZeRO moves the gradients into its partitions: no .grad to check
                check = state.step == first_step and not run.plan.optimizer_in_backward and not run.zero
                out = _one_step(run, state, guard, touch, emit, last_ckpt, check_grads=check)
                state.samples_seen += run.effective_batch
                state.micro_batch = guard.micro_batch
                tokens_total += out.tokens
                loss_tokens += out.loss_tokens
                if not out.applied:
                    skipped += 1
                    emit({"type": "info", "message": f"fp16: inf/NaN gradients, update skipped (loss scale now "
                                                     f"{run.step.scaler.get_scale():g}); not counted as a step"})
                else:
                    state.step += 1
                    state.losses.append(out.loss)
                    last_loss = out.loss
                    _log_step(run, state, guard, emit, reporter, tokens_total, t0)
                    if run.eval_samples and (state.step == run.total_steps or (
                            cfg.eval_steps and state.step % cfg.eval_steps == 0)):
                        eval_loss = _evaluate(run, state, emit, reporter)
                    if state.step == run.total_steps or (cfg.save_steps and state.step % cfg.save_steps == 0):
                        last_ckpt = _save(run, state, guard, emit)
                if run.cap is None and state.step - first_step >= METER_STEPS:
                    meter_scope.close()  # uncapped: the peak is measured over the first steps only (no overhead)
                if stop.agreed():
                    interrupted = True
                    if last_ckpt is None or not last_ckpt.endswith(f"checkpoint-{state.step}"):
                        last_ckpt = _save(run, state, guard, emit)
                    break
                if delay:
                    time.sleep(delay)
    finally:
        for h in hooks:
            h.remove()
        torch.set_num_threads(threads_before)
        reporter.close()
    if interrupted:
        raise Interrupted(f"interrupted at step {state.step}/{run.total_steps}; checkpoint saved: {last_ckpt}",
                          f"continue with `{run.command} --resume`")
    _save_outputs(run, run.tokenizer, out_dir, emit)
    dist.barrier(run.dist)
    wall = time.perf_counter() - t0
    if skipped:
        run.notes.append(f"{skipped} fp16 update(s) skipped for inf/NaN gradients (not counted as steps)")
    res = TrainResult(
        optimizer_steps=state.step,
        effective_batch_size=run.effective_batch,
        micro_batch_size=guard.micro_batch,
        gradient_accumulation_steps=math.ceil(run.rank_batch / guard.micro_batch),
        oom_recoveries=state.oom_recoveries,
        measured_peak_bytes=run.peak_bytes(),
        memory=run.memory,
        final_loss=last_loss if last_loss is not None else (state.losses[-1] if state.losses else None),
        checkpoint=last_ckpt,
        first_loss=state.losses[0] if state.losses else None,
        losses=[float(x) for x in state.losses],
        tokens=tokens_total,
        loss_tokens=loss_tokens,
        tokens_per_second=tokens_total / wall if wall else 0.0,
        wall_seconds=wall,
        device=str(run.device),
        cap_bytes=run.cap,
        resumed_from=resumed_from,
        recoveries=list(state.recoveries),
        num_params=run.loaded.num_params,
        num_trainable_params=run.loaded.num_trainable,
        plan=run.plan.label(),
        output_dir=str(out_dir),
        epoch=_epoch(run, state),
        world_size=run.dist.world_size,
        strategy=run.plan.strategy,
        restarts=run.dist.restarts,
        eval_loss=eval_loss,
        notes=run.notes,
    )
    import json

    if run.dist.is_main:
        write_file_atomic(out_dir / "summary.json", json.dumps(res.to_dict(), indent=1, default=str),
                          what="summary", overwrite=True,
                          hint=f"the model and the last checkpoint are in place: free space, then "
                               f"`{run.command} --resume` writes the summary")
        from oomdoctor.train.restart import clear

        clear(out_dir)  # the restarts are recorded in summary.json and the checkpoints
    return res


def _epoch(run: Run, state: RunState) -> float:
    """Passes over the training data so far (HF's ``epoch``)."""
    return round(state.samples_seen / max(1, len(run.data)), 4)


def _log_step(run: Run, state: RunState, guard, emit: Event, reporter, tokens_total: int, t0: float) -> None:
    cfg = run.cfg
    if state.step % cfg.logging_steps and state.step != run.total_steps:
        return
    el = time.perf_counter() - t0
    lr = run.scheduler.get_last_lr()[0]
    tps = tokens_total / el if el else 0.0
    accum = math.ceil(run.rank_batch / guard.micro_batch)
    peak = run.peak_bytes()
    reporter.log(state.step, {"epoch": _epoch(run, state), "loss": state.losses[-1], "learning_rate": lr,
                              "tokens_per_second": round(tps, 1), "peak_bytes": peak,
                              "micro_batch": guard.micro_batch, "grad_accum": accum})
    emit({"type": "step", "step": state.step, "max_steps": run.total_steps, "loss": state.losses[-1],
          "lr": lr, "tokens_per_s": tps, "peak_bytes": peak, "micro_batch": guard.micro_batch,
          "grad_accum": accum, "epoch": _epoch(run, state)})


def _evaluate(run: Run, state: RunState, emit: Event, reporter) -> float:
    """The eval loss now (no gradients; its memory is checked by the same cap as training)."""
    from oomdoctor.train.evaluate import evaluate

    from oomdoctor.train.data import flattens

    loss = evaluate(run.step, run.eval_samples, pad_id=run.data.pad_id, batch_size=run.cfg.per_device_eval_batch_size,
                    device=run.device, pad_to_multiple_of=run.cfg.dataset.pad_to_multiple_of,
                    reset_positions=run.data.reset_positions, flatten=flattens(run.cfg.model.attn_implementation))
    reporter.log(state.step, {"epoch": _epoch(run, state), "eval_loss": loss})
    emit({"type": "eval", "step": state.step, "eval_loss": loss, "samples": len(run.eval_samples)})
    return loss


__all__ = ["train", "TrainResult", "RunState", "Run", "predict_memory", "run_budget", "auto_micro_batch", "set_allocator_env",
           "STEP_DELAY_ENV"]
