"""Instrumented replay of the executor's training step: the steps of :class:`oomdoctor.execute.step.TrainStep`
run under :class:`oomdoctor.execute.tracking.LiveBytes`, which counts live tensor bytes per category and phase
through the step's hooks. Used by the simulated engine (fake tensors on ``cpu`` replaying a CUDA run), its real-CPU
reference run, and the measured engine (a real CUDA device).

The target is a CUDA GPU, so where the CPU code path would allocate differently the replay follows CUDA
(:class:`CudaPolicy`, documented in docs/simulate.md):

* autocast: CPU autocast casts the same ops to lower precision (linear, matmul, bmm, baddbmm, addmm, SDPA) and
  caches weight casts the same way (leaf fp32 tensors requiring grad), but CUDA's fp32 list is longer (softmax,
  log_softmax, layer_norm, pow, rsqrt, exp, log, sum, cumsum, ...): those ops are upcast here as on CUDA;
  ``torch.is_autocast_enabled()`` (no argument = CUDA) answers for the CPU autocast, so peft takes its CUDA path;
* dropout: CUDA's fused ``native_dropout`` keeps a 1-byte bool mask, the CPU path a mask in the input dtype;
  attention dropout inside SDPA runs in CUDA's flash / memory-efficient kernels (no probabilities saved) where the
  CPU falls back to the math path: replayed as the kernel without dropout;
* bitsandbytes paged optimizer state (tensors of >= 1e5 elements) is unified memory outside PyTorch's allocator:
  reported as ``paged_optimizer``, not in the allocator peak (``oomdoctor.execute.optim``);
* torch optimizers keep the ``step`` counter on the host unless ``fused`` (not counted then);
* fp16 loss scaling with a constant scale (:class:`oomdoctor.execute.step.StaticLossScale`: fake tensors hold no
  values to check for inf).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomdoctor.execute.step import PHASES, StaticLossScale, StepHooks

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.plan import Plan


#: CUDA autocast "fp32" policy (aten/src/ATen/autocast_mode.cpp, KERNEL_CUDA(..., fp32)): inputs cast to fp32.
_FP32_FUNCS = (
    "layer_norm",
    "group_norm",
    "pow",
    "rsqrt",
    "exp",
    "log",
    "log1p",
    "log2",
    "log10",
    "expm1",
    "reciprocal",
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    "erfinv",
    "softplus",
    "norm",
    "normalize",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "kl_div",
    "binary_cross_entropy_with_logits",
    "nll_loss",
    "cross_entropy",
    "cosine_similarity",
    "__pow__",
    "__rpow__",
    "__rtruediv__",
    "__rdiv__",
)
#: CUDA autocast "fp32_set_opt_dtype" policy: run in fp32 (dtype=float32) unless an output dtype is given.
_FP32_OPT_DTYPE_FUNCS = ("softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod", "nansum", "softmin")


def cuda_policy_mode_cls():
    import torch
    from torch.overrides import TorchFunctionMode

    fp32_funcs: set = set()
    opt_funcs: set = set()
    for name in _FP32_FUNCS:
        for ns in (torch, torch.Tensor, torch.nn.functional):
            f = getattr(ns, name, None)
            if f is not None:
                fp32_funcs.add(f)
    for name in _FP32_OPT_DTYPE_FUNCS:
        for ns in (torch, torch.Tensor, torch.nn.functional):
            f = getattr(ns, name, None)
            if f is not None:
                opt_funcs.add(f)
    low = (torch.float16, torch.bfloat16)
    dropout_funcs = {torch.nn.functional.dropout}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def _upcast(x):
        if isinstance(x, torch.Tensor) and x.dtype in low:
            return x.float()
        return x

    class CudaPolicy(TorchFunctionMode):
        """Torch-function mode that makes a CPU replay allocate as CUDA does (see the module docstring)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa and (kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) or 0.0) > 0:
                # CUDA's flash / memory-efficient kernels apply attention dropout inside the kernel (a Philox seed
                # and offset saved, no probabilities); CPU kernels fall back to the math path (B·heads·S² probs
                # and mask): replay the kernel without dropout, which saves what CUDA's does
                if len(args) > 4:
                    args = args[:4] + (0.0,) + args[5:]  # is_causal, scale, enable_gqa may follow positionally
                else:
                    kwargs = dict(kwargs, dropout_p=0.0)
                return func(*args, **kwargs)
            if func in dropout_funcs:
                x = args[0] if args else kwargs.get("input")
                p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
                training = kwargs.get("training", args[2] if len(args) > 2 else True)
                inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
                if training and 0 < p < 1 and not inplace and x.numel() > 0:
                    return torch.native_dropout(x, p, True)[0]
                return func(*args, **kwargs)
            if torch.is_autocast_enabled("cpu"):
                if func in fp32_funcs:
                    args = tuple(_upcast(a) for a in args)
                    kwargs = {k: _upcast(v) for k, v in kwargs.items()}
                elif func in opt_funcs and kwargs.get("dtype") is None and args and isinstance(args[0], torch.Tensor):
                    if args[0].dtype in low and not (len(args) > 2 and func is not torch.Tensor.sum):
                        kwargs = dict(kwargs, dtype=torch.float32)
            return func(*args, **kwargs)

    return CudaPolicy


@contextmanager
def cuda_autocast_answers():
    """``torch.is_autocast_enabled()`` without a device means CUDA; answer for the CPU autocast instead."""
    import torch

    orig = torch.is_autocast_enabled

    def patched(*a, **k):
        if not a and not k:
            return orig("cpu") or orig("cuda")
        return orig(*a, **k)

    torch.is_autocast_enabled = patched
    try:
        yield
    finally:
        torch.is_autocast_enabled = orig


@contextmanager
def hf_data_paths():
    """Make transformers take the branch real (unpacked, unpadded) data takes where it branches on tensor values:
    with fake tensors ``is_tracing`` is true, so ``find_packed_sequence_indices`` would report a packed batch (and a
    mask would be built), and SDPA's causal-mask skip would never look at an attention mask (a trainer's collator
    passes one, all ones for a full batch). Same ops, then the answer real data gives: not packed; an all-ones mask
    is skipped like no mask (``is_causal``)."""
    import torch

    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover
        yield
        return
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    orig_skip = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if orig is None or orig_skip is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def patched(position_ids):
        if not isinstance(position_ids, FakeTensor):
            return orig(position_ids)
        first_dummy_value = position_ids[:, :1] - 1
        position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
        packed_sequence_mask = (position_diff != 1).cumsum(-1)
        (packed_sequence_mask[:, -1] == 0).all()
        return None

    def skip(padding_mask, *args, **kwargs):
        if not isinstance(padding_mask, FakeTensor):
            return orig_skip(padding_mask, *args, **kwargs)
        masking_utils.fast_all(padding_mask)  # what the real check computes, its answer: all ones
        return orig_skip(None, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = patched
    masking_utils._ignore_causal_mask_sdpa = skip
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig
        masking_utils._ignore_causal_mask_sdpa = orig_skip


@dataclass
class RunStats:
    """Raw numbers of one simulated (or real) run."""

    layers: int
    """Transformer blocks of the model that ran."""
    peak: int
    """Peak live tensor bytes over all steps (rounded as configured)."""
    peak_phase: str
    """Phase of ``peak``."""
    peak_categories: dict[str, int]
    """Bytes per category at the peak (sums to ``peak``)."""
    phase_peaks: dict[str, int]
    """Peak per phase (max over the steps)."""
    phase_categories: dict[str, dict[str, int]]
    """Bytes per category at each phase's peak."""
    step_peaks: list[int]
    """Peak of each step."""
    external: dict[str, int]
    """Bytes outside the device allocator: ``paged_optimizer``, ``cpu_offloaded``."""
    timeline: list = field(default_factory=list)
    """(event, phase, {category: bytes}) samples when recorded."""
    param_bytes: int = 0
    """Bytes of parameters/buffers (and registered quantization constants) before the first step."""
    adapter_bytes: int = 0
    """Of ``param_bytes``: LoRA adapter weights."""
    trainable_bytes: int = 0
    """Bytes of the trainable parameters (what one full set of their gradients takes)."""
    candidates: dict = field(default_factory=dict)
    """Per phase: category dicts at [the phase peak, the start and the end of its last instance] — moments that are
    aligned across block counts, extrapolated separately (the peak may move to a phase boundary for large N)."""


class TrackingHooks(StepHooks):
    """The step's hooks feeding a LiveBytes tracker: phases, the logits region (forward of the head until the
    backward leaves it), optimizer state classification after the first step.

    Sharded (FSDP2) models: the gathered parameter buffers are classified after the first forward (``parameters``,
    or ``master_weights`` when gathered in a lower compute dtype: AMP's working copies; a buffer keeps its category
    across FSDP's resizes), and the sharded gradients after each backward (FSDP assigns them after its
    reduce-scatter, outside autograd's accumulation, so post-accumulate-grad hooks never see them)."""

    def __init__(self, lb, plan: "Plan", *, head: Any, target: str, model: Any = None):
        self.lb, self.plan, self.head, self.target = lb, plan, head, target
        self.model = model if plan.strategy == "fsdp" else None

    def phase(self, name: str):
        return self.lb.phase(name)

    def forward_done(self) -> None:
        self.lb.pop_region_all()
        if self.model is not None:
            from oomdoctor.execute.shard import gathered_buffers

            for buf, cast in gathered_buffers(self.model):
                self.lb.classify(buf, "master_weights" if cast else "parameters")

    def backward_start(self) -> None:
        self.lb.set_backward_region("logits" if self.head is not None else None)

    def backward_done(self) -> None:
        self.lb.set_backward_region(None)
        if self.model is not None:
            self.lb.track_existing([p.grad for p in self.model.parameters()], "gradients")

    def optimizer_stepped(self, optimizer: Any, step_index: int) -> None:
        from oomdoctor.execute.optim import CPUOffloadOptimizer

        if step_index != 0:
            return
        if isinstance(optimizer, CPUOffloadOptimizer):
            _offload_optimizer_state(optimizer.inner, self.lb)
            return
        self.lb.track_optimizer(optimizer)
        fused = self.plan.optimizer in ("adamw", "sgd") and self.plan.optimizer_impl == "fused"
        if self.target == "cuda" and not fused:
            # (on a real GPU, target "gpu", these CPU scalars are not on the device: not counted)
            _untrack_host_scalars(optimizer, self.lb)


def _head_region_hooks(head, lb) -> list:
    """Classify the head's forward output (and its backward) as ``logits``."""
    import torch

    if head is None:
        return []

    def _head_out(m, a, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: lb.set_backward_region(None))
        return None

    return [
        head.register_forward_pre_hook(lambda m, a: lb.push_region("logits")),
        head.register_forward_hook(_head_out),
    ]


def _backbone_region_hooks(backbone, lb) -> list:
    """Classify what runs after ``backbone``'s forward as ``logits`` (a loss that reads the head's weight directly,
    never calling the head module: TRL's fused LM head), and the backward's ``logits`` region as over once the
    backbone's output gradient exists."""
    import torch

    if backbone is None:
        return []

    def _done(m, a, out):
        hidden = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda g: lb.set_backward_region(None))
        lb.push_region("logits")

    return [backbone.register_forward_hook(_done)]


def replay_step(model, plan: "Plan", lb, *, target: str, head=None) -> Any:
    """The executor's :class:`~oomdoctor.execute.step.TrainStep` for a replay: the plan's optimizer (offloaded to
    host memory outside ``lb`` when the plan says so), tracking hooks, constant fp16 loss scale off a real GPU."""
    from oomdoctor.execute.optim import HostActivationOffload, activation_offload, make_plan_optimizer
    from oomdoctor.execute.step import TrainStep

    params = [p for p in model.parameters() if p.requires_grad]
    on_gpu = target == "gpu"
    opt = make_plan_optimizer(params, plan, target=target, lb=lb, host_scope=None if on_gpu else lb.paused)
    device_type = "cuda" if on_gpu else "cpu"
    if not plan.offload_activations:
        offload = None
    elif on_gpu:
        offload = lambda: activation_offload(True, "cuda")  # noqa: E731 - a one-line local helper
    else:
        offload = HostActivationOffload(host_scope=lb.paused, lb=lb)
    scaler = StaticLossScale() if plan.precision == "fp16-mixed" and not on_gpu else None
    return TrainStep(
        model,
        opt,
        plan,
        device_type=device_type,
        scaler=scaler,
        hooks=TrackingHooks(lb, plan, head=head, target=target, model=model),
        offload=offload,
    )


class Instruments:
    """What a replay sets up around a model's training steps, shared by :func:`run_steps` (the executor's step) and
    the trainers' replay (``oomdoctor.engines.trainers``: TRL's / transformers' own step): the model's tensors
    tracked by ``lb``, the ``logits`` region (from the LM head's forward — or, for a loss that never calls the head
    module, from the end of the ``backbone``'s forward — until the backward leaves it), the moment the input
    embedding's backward starts (an aligned moment for the extrapolation), checkpointed blocks recomputed under the
    CUDA policy, and, while entered, the CUDA policy and ``lb`` themselves. :meth:`stats` turns the run into
    :class:`RunStats`."""

    def __init__(
        self, model, plan: "Plan", lb, *, target: str = "cuda", head=None, backbone=None, checkpoint_region: bool = True
    ):
        import torch

        self.model, self.plan, self.lb, self.target, self.checkpoint_region = model, plan, lb, target, checkpoint_region
        lb.track_module(model)
        self.adapter_bytes = sum(lb.counted_bytes(p) for n, p in model.named_parameters() if "lora_" in n)
        self.trainable_bytes = sum(lb.counted_bytes(p) for p in model.parameters() if p.requires_grad)
        self.param_bytes = lb.current
        self.hooks = _head_region_hooks(head, lb) + _backbone_region_hooks(backbone, lb)
        self.tail_starts: list[int] = []
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is not None:
            # the input embedding's backward starts the tail of backward (after every block): a moment aligned
            # across block counts for the extrapolation (a tied head's gradients are summed there, with every
            # gradient alive)
            def _mark_tail(_m, _a, out):
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda _g: self.tail_starts.append(lb.events))

            self.hooks.append(emb.register_forward_hook(_mark_tail))
        self.policy_cls = cuda_policy_mode_cls() if target == "cuda" else None
        self.restore_ckpt: list = []
        self._stack: ExitStack | None = None

    def wrap_checkpoints(self) -> None:
        """Make each checkpointed block recompute under the CUDA policy (call once checkpointing is enabled)."""
        self.restore_ckpt += wrap_checkpoint_functions(
            self.model, self.lb, self.policy_cls, classify=self.checkpoint_region
        )

    def __enter__(self) -> "Instruments":
        st = self._stack = ExitStack()
        st.enter_context(hf_data_paths())
        if self.target == "cuda":
            st.enter_context(cuda_autocast_answers())
            st.enter_context(self.policy_cls())
        st.enter_context(self.lb)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        for h in self.hooks:
            h.remove()
        for mod, fn in self.restore_ckpt:
            mod._gradient_checkpointing_func = fn
        self.lb.remove_hooks()

    def stats(self, step_peaks: list[int]) -> RunStats:
        return _stats(
            self.lb, step_peaks, self.param_bytes, self.adapter_bytes, self.trainable_bytes, self.tail_starts[-1:]
        )


def run_steps(
    model,
    plan: "Plan",
    batch: dict,
    lb,
    *,
    steps: int = 2,
    target: str = "cuda",
    head=None,
    checkpoint_region: bool = True,
    on_step=None,
    micro_batches: int | None = None,
) -> RunStats:
    """Run ``steps`` training steps of ``model`` on ``batch`` under the live tracker ``lb`` (this function enters it).

    ``target``: ``"cuda"`` replays on CPU tensors (real or fake) allocating as CUDA does (:class:`CudaPolicy`);
    ``"cpu"`` runs plain CPU semantics; ``"gpu"`` runs on a real CUDA device (CUDA autocast, bnb as is).
    ``on_step(step_index)`` is called after each step (the measured engine samples NVML there).
    ``micro_batches``: forward/backward passes per optimizer step (None: 2 when ``plan.grad_accum >= 2`` — the
    later micro-batches all run with the gradients allocated (accumulated in place) and are identical — else 1)."""
    step_peaks: list[int] = []
    n_micro = replayed_micro_batches(plan) if micro_batches is None else micro_batches
    inst = Instruments(model, plan, lb, target=target, head=head, checkpoint_region=checkpoint_region)
    if plan.gradient_checkpointing:
        inst.wrap_checkpoints()
    with inst:
        step = replay_step(model, plan, lb, target=target, head=head)
        divisor = plan.grad_accum if n_micro > 1 else 1  # Trainer: loss / gradient_accumulation_steps
        for i in range(steps):
            lb.reset_peak()
            for _micro in range(n_micro):
                step.forward_backward(batch, loss_divisor=divisor)
            step.optimizer_step()
            step_peaks.append(lb.peak)
            if on_step is not None:
                on_step(i)
    return inst.stats(step_peaks)


def replayed_micro_batches(plan: "Plan") -> int:
    """Micro-batches a replay runs per optimizer step: 2 when ``plan.grad_accum >= 2`` (the 3rd and later run with
    every gradient already allocated, as the 2nd does), else 1."""
    return min(max(plan.grad_accum, 1), 2)


def _stats(
    lb, step_peaks: list[int], param_bytes: int, adapter_bytes: int, trainable_bytes: int, tail_start: list[int] = ()
) -> RunStats:
    peaks = lb.phase_peaks
    phase_cats = {ph: lb.categories_at(ev) for ph, ev in lb.phase_peak_events().items()}
    # aligned candidate moments for extrapolation: the peak, the start/end of the last instance of each phase and,
    # in backward, the peak of its tail (from the input embedding's backward on)
    last: dict[str, tuple] = {}
    for name, start, end, _pk in lb.spans():
        last[name] = (start, end)
    candidates = {
        ph: [phase_cats[ph]] + [_within(lb.categories_at(ev), phase_cats[ph], peaks[ph]) for ev in last[ph]]
        for ph in phase_cats
    }
    tail = []
    if tail_start and lb.history and "backward" in last and last["backward"][1] is not None:
        tail = [lb.categories_at(ev) for ev in range(tail_start[0], last["backward"][1] + 1)]
    if tail:
        candidates["backward"].append(
            _within(max(tail, key=lambda c: sum(c.values())), phase_cats["backward"], peaks["backward"])
        )
    best = max(PHASES, key=lambda ph: peaks.get(ph, -1))
    return RunStats(
        layers=0,
        peak=max(peaks.values()),
        peak_phase=best,
        peak_categories=phase_cats[best],
        phase_peaks=dict(peaks),
        phase_categories=phase_cats,
        step_peaks=step_peaks,
        external=dict(lb.external),
        timeline=lb.timeline() if lb.record_timeline else [],
        param_bytes=param_bytes,
        adapter_bytes=adapter_bytes,
        trainable_bytes=trainable_bytes,
        candidates=candidates,
    )


def _within(cats: dict[str, int], peak_cats: dict[str, int], phase_peak: int) -> dict[str, int]:
    """A phase boundary's categories, or the phase peak's when they add up to more than the phase ever held: at the
    boundary event tensors freed just before the phase began are still counted alive (a death is recorded as "gone
    after the next event"), e.g. the forward's outputs at the start of backward; that moment belongs to the previous
    phase, and extrapolating it would overstate this phase (seen with FSDP reshard_after_forward=False)."""
    return cats if sum(cats.values()) <= phase_peak else peak_cats


def _untrack_host_scalars(opt, lb) -> None:
    """torch's non-fused optimizers keep ``step`` as a CPU scalar tensor (not on the GPU)."""
    import torch

    for st in opt.state.values():
        s = st.get("step") if isinstance(st, dict) else None
        if isinstance(s, torch.Tensor) and s.dim() == 0:
            lb.untrack(s)


def _offload_optimizer_state(opt, lb) -> None:
    """Optimizer state created on the host (under ``lb.paused``): never device bytes; counted in cpu_offloaded."""
    import torch

    for st in opt.state.values():
        for v in st.values() if isinstance(st, dict) else ():
            if isinstance(v, torch.Tensor):
                lb.ignore(v, external="cpu_offloaded")


def wrap_checkpoint_functions(model, lb, policy_cls=None, *, classify: bool = True) -> list:
    """Wrap each block's checkpoint function so that the recompute during backward (a) runs under the CUDA policy
    again (torch-function modes are not active inside autograd's backward) and (b) is classified as activations
    (try/finally survives the non-reentrant checkpoint's early stop)."""
    restore = []
    for mod in model.modules():
        fn = getattr(mod, "_gradient_checkpointing_func", None)
        if fn is None or not getattr(mod, "gradient_checkpointing", False):
            continue

        def wrapped(function, *args, _fn=fn, **kwargs):
            def run(*a, **k):
                if lb.current_phase != "backward":
                    return function(*a, **k)
                with ExitStack() as st:
                    if policy_cls is not None:
                        st.enter_context(cuda_autocast_answers())
                        st.enter_context(policy_cls())
                    if classify:
                        lb.push_region("activations")
                        st.callback(lb.pop_region)
                    return function(*a, **k)

            return _fn(run, *args, **kwargs)

        restore.append((mod, fn))
        mod._gradient_checkpointing_func = wrapped
    return restore


__all__ = [
    "Instruments",
    "RunStats",
    "run_steps",
    "replay_step",
    "replayed_micro_batches",
    "TrackingHooks",
    "cuda_autocast_answers",
    "hf_data_paths",
    "cuda_policy_mode_cls",
    "wrap_checkpoint_functions",
]
