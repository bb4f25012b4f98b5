"""Setting a run up (:func:`setup`): budget, data, micro-batch, prediction, model, optimizer, schedule, step and
meter, each a small function, into one :class:`oomdoctor.train.run.Run`; and the job's topology
(:func:`resolve_topology`), checked before anything is set up.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.execute import dist
from oomdoctor.plan import Plan
from oomdoctor.plan.plan import DEEPSPEED, SHARDED
from oomdoctor.plan.techniques import TORCH_OPTIMIZERS
from oomdoctor.progress import report
from oomdoctor.train.config import TrainConfig
from oomdoctor.train.run import Event, Run
from oomdoctor.train.sizing import auto_micro_batch, check_host_ram, predict_for_run, run_budget, total_steps


def resolve_topology(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """The config as a job of ``world_size`` processes runs it, or BadInput (one message) for what train cannot run.

    ``world_size: 1`` (the default) follows the launcher; a larger value must equal the processes launched.
    Strategies: ``single``/``ddp`` (normalized by the plan from the world size), ``fsdp`` (FSDP2; also what
    ``offload_params`` normalizes to) and DeepSpeed's ``zero2``/``zero3`` (the optional ``deepspeed`` extra)."""
    if cfg.world_size not in (1, world_size):
        raise BadInput(
            f"world_size: {cfg.world_size} in the config, but this job has {world_size} process(es)",
            f"run `oomdoctor train CONFIG --nproc-per-node {cfg.world_size}` (or N per node with --nnodes), "
            "or remove world_size to follow the launcher",
        )
    cfg = replace(cfg, world_size=world_size)
    plan = cfg.to_plan(micro_batch=cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 1)
    if plan.strategy in DEEPSPEED:
        from oomdoctor.execute.zero import require_deepspeed

        require_deepspeed()
    elif plan.strategy != "fsdp":
        return cfg
    problems = _sharding_problems(cfg, plan)
    if problems:
        what = "DeepSpeed ZeRO" if plan.strategy != "fsdp" else "offload_params" if plan.offload_params else "FSDP2"
        raise BadInput(
            f"strategy {plan.strategy} ({what}): " + "; ".join(problems),
            "change the config, or run it with strategy ddp",
        )
    return cfg


def _sharding_problems(cfg: TrainConfig, plan: Plan) -> list[str]:
    """What a sharded (FSDP2 / ZeRO) run of ``plan`` cannot do, one line each."""
    problems = []
    if plan.quant is not None:
        problems.append("a bitsandbytes-quantized base (QLoRA) cannot be sharded by train; use strategy ddp")
    if plan.precision == "fp16-mixed":
        problems.append(
            "fp16-mixed: "
            + (
                "GradScaler's inf/NaN check would see only this rank's gradient shards"
                if plan.strategy == "fsdp"
                else "DeepSpeed's fp16 runs a loss scaler of its own that train does not drive"
            )
            + "; use bf16-mixed (or fp32)"
        )
    if plan.optimizer not in TORCH_OPTIMIZERS:
        problems.append(f"optim {cfg.optim}: the sharded step runs torch optimizers only (adamw_torch, sgd)")
    if cfg.merge_adapter:
        problems.append("merge_adapter: merge the saved adapter after the run (the sharded run saves the adapter)")
    return problems


def setup(cfg: TrainConfig, gpu_mem: int | None, engine: str, emit: Event, tok, notes: list[str]) -> Run:
    """Budget, data (``tok``: the run's tokenizer), micro-batch, prediction, model, optimizer, schedule, step and
    meter of a run (each stage reported as progress); ``notes``: what the run already has to say."""
    import torch

    from oomdoctor.execute.optim import make_scheduler
    from oomdoctor.train.data import SampleOrder
    from oomdoctor.train.report import check_sinks

    check_sinks(cfg.report_to)
    info = dist.from_env()
    device = _device(cfg, info)
    budget = run_budget(cfg, gpu_mem, on_cpu=device.type == "cpu")
    # the run cap enforces a capacity the user named (--gpu-mem / gpu_mem); NVML free memory needs no cap
    cap = budget.capacity_bytes if budget is not None and budget.source != "nvml free" else None
    if device.type == "cpu" and cfg.precision == "fp16-mixed":
        notes.append("fp16 autocast on CPU: GradScaler runs but CPU fp16 matmuls are slow")
    data, held = _data(cfg, tok, notes)
    micro = cfg.micro_batch_size
    if micro == "auto":
        micro = auto_micro_batch(cfg, budget, engine, device.type)
        emit({"type": "info", "message": f"micro_batch_size auto -> {micro}"})
    micro = int(micro)
    eff = _effective_batch(cfg, micro, info.world_size)
    steps = total_steps(cfg, len(data), eff)
    report("train", f"setting up: pricing the plan ({engine} engine)")
    plan, memory = predict_for_run(cfg, micro, engine, notes, device.type)
    # the process group only now: the prediction may run the simulate engine, which makes a fake group of its own
    dist.init(info, device.type, one_rank_group=plan.strategy in SHARDED, shared_dir=cfg.output_dir)
    torch.manual_seed(cfg.seed)
    check_host_ram(plan, memory, notes)
    loaded = _load(cfg, plan, device, info, tok)
    report("train", "setting up: the optimizer and the training step")
    optimizer = _optimizer(cfg, plan, loaded, device)
    scheduler = make_scheduler(
        cfg.lr_scheduler_type, optimizer, warmup_steps=min(cfg.warmup_steps, steps), total_steps=steps
    )
    ds_engine = _zero_engine(cfg, plan, loaded, optimizer, device, info, micro, eff)
    # the meter after DeepSpeed partitioned the model, before DDP wraps it
    meter = _meter(device, cap, loaded, optimizer)
    step = _train_step(cfg, plan, loaded, optimizer, ds_engine, device, info)
    return Run(
        cfg=cfg,
        device=device,
        cap=cap,
        data=data,
        effective_batch=eff,
        plan=plan,
        memory=memory,
        loaded=loaded,
        step=step,
        scheduler=scheduler,
        meter=meter,
        notes=notes,
        tokenizer=tok,
        order=SampleOrder(len(data), cfg.seed, cfg.dataset.shuffle),
        total_steps=steps,
        eval_samples=held,
        dist=info,
    )


def _device(cfg: TrainConfig, info: Any) -> Any:
    """The torch device of this process (under torchrun on CUDA: its local rank's GPU)."""
    import torch

    from oomdoctor.execute.load import resolve_device

    device = resolve_device(cfg.device)
    if info.enabled and device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if info.enabled and cfg.optimizer_in_backward:
        raise BadInput(
            "optimizer_in_backward steps each rank's local gradients in backward, before the ranks sum "
            "them: it cannot run data-parallel",
            "drop optimizer_in_backward, or train on one process",
        )
    return device


def _data(cfg: TrainConfig, tok, notes: list[str]) -> tuple[Any, list]:
    """(training samples, eval samples) tokenized as the run encodes them; what they have to say goes to notes."""
    from oomdoctor.train.data import tokenize
    from oomdoctor.train.evaluate import eval_samples

    report("train", "setting up: tokenizing the dataset")
    data = tokenize(cfg.dataset, tok, cfg.seq_len)
    notes += data.notes
    data, held = eval_samples(cfg.dataset, tok, cfg.seq_len, data, cfg.seed)
    if data.truncated:
        notes.append(f"{data.truncated} samples truncated to seq_len {cfg.seq_len}")
    return data, held


def _effective_batch(cfg: TrainConfig, micro: int, world_size: int) -> int:
    """Samples per optimizer step: micro x accumulation x world size (HF); ``global_batch_size`` fixes it across
    the ranks and must divide among them."""
    eff = cfg.global_batch_size or micro * cfg.gradient_accumulation_steps * world_size
    if eff % world_size:
        raise BadInput(
            f"global_batch_size {eff} is not divisible by the {world_size} processes", f"use a multiple of {world_size}"
        )
    return eff


def _load(cfg: TrainConfig, plan: Plan, device: Any, info: Any, tok) -> Any:
    """The model as the plan builds it (``oomdoctor.execute.load``); FSDP2: built on the meta device, filled from
    rank 0's copy and sharded, every rank then continuing with rank 0's RNG state."""
    from oomdoctor.execute.load import load_model, load_sharded_model
    from oomdoctor.train.preflight import model_source

    report("train", "setting up: loading the model" + (" (weights from disk)" if cfg.model.path else ""))
    source = model_source(cfg)
    if plan.strategy != "fsdp":
        return load_model(
            source, plan, device, vocab_size=len(tok), seed=cfg.seed, compute_dtype=cfg.bnb_4bit_compute_dtype
        )
    from oomdoctor.execute.shard import device_mesh

    loaded = load_sharded_model(
        source, plan, device, device_mesh(plan, device.type), is_main=info.is_main, vocab_size=len(tok), seed=cfg.seed
    )
    _agree_rng(info)
    return loaded


def _agree_rng(info: Any) -> None:
    """Every rank continues with rank 0's RNG state (only rank 0 drew the initial weights of a sharded load)."""
    import torch
    import torch.distributed as tdist

    if info.enabled:
        state = [torch.get_rng_state()]
        tdist.broadcast_object_list(state, src=0)
        torch.set_rng_state(state[0])


def _optimizer(cfg: TrainConfig, plan: Plan, loaded: Any, device: Any) -> Any:
    """The plan's optimizer over the trainable parameters (``oomdoctor.execute.optim``)."""
    from oomdoctor.execute.optim import OptimizerArgs, make_plan_optimizer

    args = OptimizerArgs(
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon,
    )
    return make_plan_optimizer(loaded.trainable, plan, args, target="gpu" if device.type == "cuda" else "cpu")


def _zero_engine(
    cfg: TrainConfig, plan: Plan, loaded: Any, optimizer: Any, device: Any, info: Any, micro: int, eff: int
) -> Any:
    """The DeepSpeed engine of a ZeRO plan (``oomdoctor.execute.zero``), None for the other strategies."""
    if plan.strategy not in DEEPSPEED:
        return None
    from oomdoctor.execute import zero as ds

    config = ds.zero_config(
        plan,
        loaded.model.config.hidden_size,
        ds.ZeroRun(
            micro_batch=micro,
            grad_accum=max(1, eff // (micro * info.world_size)),
            max_grad_norm=cfg.max_grad_norm,
            device_type=device.type,
        ),
    )
    return ds.initialize(loaded.model, optimizer, config)


def _train_step(cfg: TrainConfig, plan: Plan, loaded: Any, optimizer: Any, engine: Any, device: Any, info: Any) -> Any:
    """The executor's step (``oomdoctor.execute.step.TrainStep``) for the strategy: through the DeepSpeed
    ``engine`` (ZeRO), on the FSDP2-sharded model, or on the model wrapped for DDP (alone: the model)."""
    from oomdoctor.execute.step import TrainStep

    if engine is not None:  # clipping, the step and zeroing the gradients are engine.step()'s
        from oomdoctor.execute.zero import EngineOptimizer

        return TrainStep(
            engine,
            EngineOptimizer(engine),
            plan,
            device_type=device.type,
            max_grad_norm=None,
            backward=lambda loss: engine.backward(loss, scale_wrt_gas=False),
        )
    if plan.strategy == "fsdp":
        from oomdoctor.execute.shard import clip_grad_norm

        return TrainStep(
            loaded.model, optimizer, plan, device_type=device.type, max_grad_norm=cfg.max_grad_norm, clip=clip_grad_norm
        )
    return TrainStep(
        dist.wrap(loaded.model, info, device), optimizer, plan, device_type=device.type, max_grad_norm=cfg.max_grad_norm
    )


def _meter(device: Any, cap: int | None, loaded: Any, optimizer: Any) -> Any:
    """CPU: a LiveBytes meter over the model (and the optimizer, unless it lives on the host), capped at ``cap``.
    CUDA: None; the process is capped at ``cap`` and the allocator's peak reset."""
    import torch

    if device.type == "cuda":
        if cap is not None:
            card = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / card), device)
        torch.cuda.reset_peak_memory_stats(device)
        return None
    from oomdoctor.execute.optim import CPUOffloadOptimizer
    from oomdoctor.execute.tracking import LiveBytes

    meter = LiveBytes(cap_bytes=cap, history=False)
    meter.track_module(loaded.model, None if isinstance(optimizer, CPUOffloadOptimizer) else optimizer, grad_hooks=True)
    return meter


__all__ = ["setup", "resolve_topology"]
