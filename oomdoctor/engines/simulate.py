"""The simulated engine: replay the real Hugging Face training step on tensors that hold no data.

``simulate_plan(spec, plan)`` builds the model the plan trains (``oomdoctor.execute.build``: meta device, plan dtype,
bitsandbytes stand-ins, gradient checkpointing, peft LoRA, attention implementation), materializes it under
``FakeTensorMode`` on ``cpu`` (``to_empty``), and runs **two** full steps as ``transformers.Trainer`` does them —
forward with labels under autocast (accelerate converts the outputs to fp32), loss, backward, gradient clipping,
optimizer step, ``zero_grad(set_to_none=True)`` — while :class:`oomdoctor.execute.tracking.LiveBytes` counts live storage
bytes rounded as the CUDA caching allocator rounds. Two steps because optimizer state appears at the first step;
the second is the steady state.

The target is a CUDA GPU, so where the CPU code path would allocate differently the replay follows CUDA
(:class:`CudaPolicy`, documented in docs/simulate.md):

* autocast: CPU autocast casts the same ops to lower precision (linear, matmul, bmm, baddbmm, addmm, SDPA) and
  caches weight casts the same way (leaf fp32 tensors requiring grad), but CUDA's fp32 list is longer (softmax,
  log_softmax, layer_norm, pow, rsqrt, exp, log, sum, cumsum, ...): those ops are upcast here as on CUDA;
  ``torch.is_autocast_enabled()`` (no argument = CUDA) answers for the CPU autocast, so peft takes its CUDA path;
* dropout: CUDA's fused ``native_dropout`` keeps a 1-byte bool mask, the CPU path a mask in the input dtype;
* bitsandbytes: 4-bit matmuls over more than 1536 rows dequantize the weight as a separate temporary (bnb's CUDA
  fallback); int8 runs ``MatMul8bitLt``; paged optimizer state (tensors of >= 1e5 elements) is unified memory outside
  PyTorch's allocator: counted in ``peak_device`` (``paged_optimizer``), not in ``peak_allocated``;
* torch optimizers keep the ``step`` counter on the host unless ``fused`` (not counted then).

Speed: transformer blocks are identical, so the step is simulated with 2 and 3 blocks (``EXTRAPOLATE_FROM``) and
every number is extrapolated linearly to N blocks (per phase, at three aligned moments: the phase peak, its start and
its end, keeping the largest); models whose blocks differ (alternating attention kinds, MoE) are simulated in full.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from oomdoctor.errors import BadInput
from oomdoctor.memory.breakdown import TENSOR_COMPONENTS, MemoryBreakdown

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.plan import Plan
    from oomdoctor.model.spec import ModelSpec

PHASE_NAMES = ("forward", "backward", "optimizer-step")
#: Categories reported by the tracker, mapped to MemoryBreakdown fields.
CATEGORY_FIELDS = {
    "parameters": "parameters",
    "master_weights": "master_weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer_states",
    "activations": "activations",
    "logits": "logits",
    "temporaries": "temporaries",
}
#: Block counts simulated for linear extrapolation. Memory is affine in the block count from two blocks on (blocks are
#: identical; the first/last block's own differences, e.g. a non-grad-requiring input, are in the intercept; with one
#: block the backward peak can sit elsewhere, e.g. QLoRA + GC): checked against full simulations in
#: tests/test_simulate.py.
EXTRAPOLATE_FROM = (2, 3)
#: bnb paged optimizers keep tensors smaller than this on the device (bitsandbytes optim/optimizer.py get_state_buffer).
PAGED_MIN_NUMEL = 100_000


@dataclass
class SimulationResult:
    """What one simulated plan produced."""

    breakdown: MemoryBreakdown
    """The typed breakdown (engine ``simulate``); tensor components are those at the peak moment."""
    timeline: list
    """(event index, phase, {category: bytes}) samples of the simulated run, for plots (``oomdoctor.diagnose.plot``).
    With extrapolation this is the timeline of the largest simulated model (``timeline_layers`` blocks)."""
    phase_peaks: dict[str, int]
    """Peak allocated bytes per phase (forward, backward, optimizer-step), extrapolated to the full model."""
    phase_categories: dict[str, dict[str, int]]
    """Per-category bytes at each phase's peak, extrapolated to the full model."""
    seconds: float
    """Wall time of the simulation."""
    layers_simulated: tuple[int, ...]
    """Block counts actually simulated (e.g. (2, 4) when extrapolating, (N,) for a full simulation)."""
    timeline_layers: int
    """Blocks of the model the timeline comes from."""
    extrapolated: bool
    paged_bytes: int = 0
    """bitsandbytes paged optimizer state (unified memory) of the full model."""
    step_peaks: tuple[int, ...] = ()
    """Peak of each simulated step (of the largest simulated model)."""

    def to_dict(self) -> dict:
        return {
            "memory": self.breakdown.to_dict(),
            "phase_peaks": self.phase_peaks,
            "phase_categories": self.phase_categories,
            "seconds": round(self.seconds, 3),
            "layers_simulated": list(self.layers_simulated),
            "extrapolated": self.extrapolated,
        }


# ============================================================================ CUDA policy


#: CUDA autocast "fp32" policy (aten/src/ATen/autocast_mode.cpp, KERNEL_CUDA(..., fp32)): inputs cast to fp32.
_FP32_FUNCS = (
    "layer_norm", "group_norm", "pow", "rsqrt", "exp", "log", "log1p", "log2", "log10", "expm1", "reciprocal",
    "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softplus", "norm", "normalize", "mse_loss", "l1_loss",
    "smooth_l1_loss", "kl_div", "binary_cross_entropy_with_logits", "nll_loss", "cross_entropy",
    "cosine_similarity", "__pow__", "__rpow__", "__rtruediv__", "__rdiv__",
)
#: CUDA autocast "fp32_set_opt_dtype" policy: run in fp32 (dtype=float32) unless an output dtype is given.
_FP32_OPT_DTYPE_FUNCS = ("softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod", "nansum", "softmin")


def _cuda_policy_mode_cls():
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

    def _upcast(x):
        if isinstance(x, torch.Tensor) and x.dtype in low:
            return x.float()
        return x

    class CudaPolicy(TorchFunctionMode):
        """Torch-function mode that makes a CPU replay allocate as CUDA does (see the module docstring)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
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
    """Make transformers take the branch real (unpacked) data takes where it branches on tensor values: with fake
    tensors ``is_tracing`` is true and ``find_packed_sequence_indices`` would report a packed batch (and a mask would
    be built). Same ops, then the answer real position ids give: not packed."""
    import torch

    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover
        yield
        return
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if orig is None:
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

    masking_utils.find_packed_sequence_indices = patched
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig


# ============================================================================ optimizers


def make_optimizer(model, plan: "Plan", lb=None, *, target: str = "cuda"):
    """The optimizer ``transformers.Trainer`` builds for ``plan.optimizer`` (``HF_OPTIM_NAMES``), with Trainer's two
    parameter groups (decay / no decay). ``lb`` receives bnb paged state as external bytes."""
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise BadInput("the plan trains no parameter (no LoRA target matched?)", "check --lora-targets")
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    lr = 1e-4
    opt = plan.optimizer
    if opt == "adamw":
        kw = {"foreach": plan.optimizer_impl == "foreach", "fused": plan.optimizer_impl == "fused"}
        if kw["fused"]:
            kw["foreach"] = False
        return torch.optim.AdamW(groups, lr=lr, **kw)
    if opt == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=plan.sgd_momentum, foreach=plan.optimizer_impl == "foreach",
                               fused=plan.optimizer_impl == "fused" or None)
    if opt == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False)
    import bitsandbytes as bnb

    optim_bits = 8 if "8bit" in opt else 32
    is_paged = opt.startswith("paged")
    base = bnb.optim.Lion if opt == "lion" else bnb.optim.AdamW

    class _GpuLike(base):  # type: ignore[misc, valid-type]
        """bnb optimizer whose paged buffers are counted as unified memory (outside the allocator)."""

        def get_state_buffer(self, p, dtype=torch.float32):
            if self._sim_paged and p.numel() >= PAGED_MIN_NUMEL and lb is not None:
                with lb.paused():
                    buf = torch.zeros_like(p, dtype=dtype, device=p.device)
                lb.ignore(buf, external="paged_optimizer")
                return buf
            return torch.zeros_like(p, dtype=dtype, device=p.device)

    if target == "gpu":  # a real GPU: bnb as is (paged state really is unified memory)
        return base(groups, lr=lr, optim_bits=optim_bits, is_paged=is_paged)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # bnb builds its quantization maps from data (real tensors, shared by all params)
        o = _GpuLike(groups, lr=lr, optim_bits=optim_bits, is_paged=False)
    o._sim_paged = is_paged and target == "cuda"
    return o


# ============================================================================ the step


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
    candidates: dict = field(default_factory=dict)
    """Per phase: category dicts at [the phase peak, the start and the end of its last instance] — moments that are
    aligned across block counts, extrapolated separately (the peak may move to a phase boundary for large N)."""


def run_steps(model, plan: "Plan", batch: dict, lb, *, steps: int = 2, target: str = "cuda", head=None,
              optimizer=None, checkpoint_region: bool = True, on_step=None, micro_batches: int | None = None) -> RunStats:
    """Run ``steps`` training steps of ``model`` on ``batch`` under the live tracker ``lb`` (this function enters it).

    ``target``: ``"cuda"`` replays on CPU tensors (real or fake) allocating as CUDA does (:class:`CudaPolicy`);
    ``"cpu"`` runs plain CPU semantics; ``"gpu"`` runs on a real CUDA device (CUDA autocast, bnb as is).
    ``on_step(step_index)`` is called after each step (the measured engine samples NVML there).
    ``micro_batches``: forward/backward passes per optimizer step (None: 2 when ``plan.grad_accum >= 2`` — the
    later micro-batches all run with the gradients allocated and are identical — else 1)."""
    import torch

    lb.track_module(model)
    adapter_bytes = sum(
        lb.counted_bytes(p) for n, p in model.named_parameters() if "lora_" in n
    )
    param_bytes = lb.current
    mixed = plan.is_mixed
    ac_device = "cuda" if target == "gpu" else "cpu"
    cdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[plan.compute_dtype]
    step_peaks: list[int] = []
    # gradient accumulation: micro-batches after the first run with every gradient already allocated (accumulated
    # in place); the 2nd and later are identical, so 2 micro-batches per optimizer step price any grad_accum >= 2.
    n_micro = min(max(plan.grad_accum, 1), 2) if micro_batches is None else micro_batches
    hooks = []
    if head is not None:
        hooks.append(head.register_forward_pre_hook(lambda m, a: lb.push_region("logits")))

        def _head_out(m, a, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: lb.set_backward_region(None))
            return None

        hooks.append(head.register_forward_hook(_head_out))
    restore_ckpt = []
    policy_cls = _cuda_policy_mode_cls() if target == "cuda" else None
    if plan.gradient_checkpointing:
        restore_ckpt = _wrap_checkpoint_functions(model, lb, policy_cls, classify=checkpoint_region)

    with ExitStack() as stack:
        stack.enter_context(hf_data_paths())
        if target == "cuda":
            stack.enter_context(cuda_autocast_answers())
            stack.enter_context(policy_cls())
        stack.enter_context(lb)
        opt = optimizer if optimizer is not None else make_optimizer(model, plan, lb, target=target)
        for step in range(steps):
            lb.reset_peak()
            for _micro in range(n_micro):
                with lb.phase("forward"):
                    ac = torch.autocast(ac_device, dtype=cdtype) if mixed else torch.autocast(ac_device, enabled=False)
                    with ac:
                        out = model(**batch)
                    loss = out["loss"] if isinstance(out, dict) else out.loss
                    if mixed:
                        # accelerate's convert_outputs_to_fp32: every fp16/bf16 output becomes an fp32 copy
                        logits = out["logits"] if isinstance(out, dict) else out.logits
                        if logits is not None and logits.dtype in (torch.float16, torch.bfloat16):
                            logits.float()  # the copy is allocated and dropped here, as in accelerate
                        del logits
                    if n_micro > 1:
                        loss = loss / plan.grad_accum  # Trainer: loss / gradient_accumulation_steps
                    if plan.precision == "fp16-mixed":
                        loss = loss * 65536.0  # GradScaler.scale
                    del out
                    lb.pop_region_all()
                with lb.phase("backward"):
                    lb.set_backward_region("logits" if head is not None else None)
                    loss.backward()
                    lb.set_backward_region(None)
                    del loss
            with lb.phase("optimizer-step"):
                params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=plan.optimizer_impl != "for-loop")
                del params
                if plan.offload_optimizer and target != "gpu":
                    # the state lives and the update runs on the host (CPU-offloaded optimizer): nothing of the
                    # step is device memory; gradients and weights stay on the device
                    with lb.paused():
                        opt.step()
                    if step == 0:
                        _offload_optimizer_state(opt, lb)
                else:
                    opt.step()
                    if step == 0:
                        lb.track_optimizer(opt)
                        if target == "cuda" and not (plan.optimizer in ("adamw", "sgd") and plan.optimizer_impl == "fused"):
                            # (on a real GPU, target "gpu", these CPU scalars are not on the device: not counted)
                            _untrack_host_scalars(opt, lb)
                opt.zero_grad(set_to_none=True)
            step_peaks.append(lb.peak)
            if on_step is not None:
                on_step(step)
    for h in hooks:
        h.remove()
    for mod, fn in restore_ckpt:
        mod._gradient_checkpointing_func = fn
    lb.remove_hooks()
    peaks = lb.phase_peaks
    events = lb.phase_peak_events()
    phase_cats = {ph: lb.categories_at(ev) for ph, ev in events.items()}
    # aligned candidate moments for extrapolation: the peak, and the start/end of the last instance of each phase
    last: dict[str, tuple] = {}
    for name, start, end, _pk in lb.spans():
        last[name] = (start, end)
    candidates = {
        ph: [phase_cats[ph], lb.categories_at(last[ph][0]), lb.categories_at(last[ph][1])] for ph in phase_cats
    }
    best = max(PHASE_NAMES, key=lambda ph: peaks.get(ph, -1))
    peak = max(peaks.values())
    return RunStats(
        layers=0,
        peak=peak,
        peak_phase=best,
        peak_categories=phase_cats[best],
        phase_peaks=dict(peaks),
        phase_categories=phase_cats,
        step_peaks=step_peaks,
        external=dict(lb.external),
        timeline=lb.timeline() if lb.record_timeline else [],
        param_bytes=param_bytes,
        adapter_bytes=adapter_bytes,
        candidates=candidates,
    )


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


def _wrap_checkpoint_functions(model, lb, policy_cls=None, *, classify: bool = True) -> list:
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


# ============================================================================ simulate


def layer_period(spec: "ModelSpec") -> int | None:
    """Blocks per repeating unit: 1 when every block is built the same way, p when the blocks repeat with period p
    (Gemma 2 alternates sliding-window and global attention: p = 2; explicit ``layer_types`` lists), None when
    memory is not periodic in the block count (MoE: data-dependent routing; partial sliding windows)."""
    cfg = spec.config
    if spec.num_experts or spec.arch_kind != "decoder":
        return None
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") not in (None, 0, cfg.get("num_hidden_layers")):
        return None
    lt = cfg.get("layer_types")
    if isinstance(lt, list) and lt:
        for p in range(1, len(lt) + 1):
            if len(lt) % p == 0 and all(lt[i] == lt[i % p] for i in range(len(lt))):
                return p
        return None
    return {"gemma2": 2, "gemma3": 6, "cohere2": 4}.get(spec.model_type, 1)


def homogeneous_layers(spec: "ModelSpec") -> bool:
    """True when every transformer block is built the same way, so memory is linear in the block count."""
    return layer_period(spec) == 1


def simulate_run(spec: "ModelSpec", plan: "Plan", num_layers: int | None = None, *, timeline: bool = False,
                 steps: int = 2, target: str = "cuda", round_to: int = 512, bnb_decompose: bool = True) -> RunStats:
    """One fake-tensor simulation of ``plan`` with ``num_layers`` blocks (None = the spec's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.execute.build import build_model, make_batch
    from oomdoctor.execute.tracking import LiveBytes

    if plan.offload_params:
        raise BadInput("the simulated engine does not model --offload-params yet", "use --engine analytic")
    built = build_model(spec, plan, device="meta", num_layers=num_layers, bnb_decompose=bnb_decompose)
    model = built.model
    # no fallback kernels: an op without a fake implementation must never run for real on full-size zeros
    fake = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    with fake, _fake_gaps():
        model.to_empty(device="cpu")
        _retie(model)
        batch = make_batch(spec, plan, "cpu")
        lb = LiveBytes(round_to=round_to, record_timeline=timeline, param_copy_category="master_weights")
        with _offload_activations(plan, lb):
            stats = run_steps(model, plan, batch, lb, steps=steps, target=target, head=built.head_module)
    stats.layers = built.num_layers
    del model, built
    return stats


@contextmanager
def _fake_gaps():
    """Ops torch has no fake implementation for: ``_fused_sgd_`` (in-place update, allocates nothing on CUDA)."""
    import torch

    orig = torch._fused_sgd_

    def fused_sgd_(*args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor

        params = args[0] if args else kwargs.get("self", [])
        if params and isinstance(params[0], FakeTensor):
            return None
        return orig(*args, **kwargs)

    torch._fused_sgd_ = fused_sgd_
    try:
        yield
    finally:
        torch._fused_sgd_ = orig


def real_cpu_run(spec: "ModelSpec", plan: "Plan", *, model=None, head=None, num_layers: int | None = None,
                 steps: int = 2, target: str = "cuda", round_to: int = 512, bnb_decompose: bool = True,
                 seed: int = 0, timeline: bool = False) -> RunStats:
    """The same two steps on REAL tensors on the CPU (random init of the real shape, or ``model``), counted by the
    same tracker: the reference the fake-tensor replay is checked against."""
    import torch

    from oomdoctor.execute.build import build_model, make_batch
    from oomdoctor.execute.tracking import LiveBytes

    torch.manual_seed(seed)
    if model is None:
        built = build_model(spec, plan, device="cpu", num_layers=num_layers, seed=seed, bnb_decompose=bnb_decompose)
        model, head, layers = built.model, built.head_module, built.num_layers
    else:
        layers = num_layers or spec.num_layers
    batch = make_batch(spec, plan, "cpu", fake_ok=False)
    lb = LiveBytes(round_to=round_to, record_timeline=timeline, param_copy_category="master_weights")
    with _offload_activations(plan, lb):
        stats = run_steps(model, plan, batch, lb, steps=steps, target=target, head=head)
    stats.layers = layers
    return stats


@contextmanager
def _offload_activations(plan, lb):
    """``offload_activations``: tensors saved for backward go to host memory (``save_on_cpu``): the device copy is
    freed at pack time and re-created at unpack time."""
    if not plan.offload_activations:
        yield
        return
    import torch

    per_span: dict[int, int] = {}

    def pack(t):
        with lb.paused():
            host = torch.empty_like(t)
            host.copy_(t)  # real runs need the values back (fake: free)
        k = len(lb.spans())
        per_span[k] = per_span.get(k, 0) + host.untyped_storage().nbytes()
        lb.external["cpu_offloaded"] = lb.external.get("cpu_offloaded", 0) - _prev[0] + max(per_span.values())
        _prev[0] = max(per_span.values())
        return (t.device, host)

    _prev = [0]

    def unpack(packed):
        _dev, host = packed
        return host.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _retie(model) -> None:
    """``to_empty`` replaces each module's parameters one by one, which unties shared weights (tied embeddings):
    tie them again as transformers does after loading."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(base, "config", None), "tie_word_embeddings", False) and hasattr(base, "tie_weights"):
        base.tie_weights()


def _extrapolate(a: int, b: int, la: int, lb_: int, n: int) -> int:
    """Linear extrapolation of a per-block-linear quantity measured at ``la`` and ``lb_`` blocks to ``n`` blocks."""
    if lb_ == la:
        return b
    return a + (b - a) * (n - la) // (lb_ - la)


def _extrapolate_categories(c2: dict, c4: dict, la: int, lb_: int, n: int, total: int) -> dict:
    """Per-category extrapolation that still sums to ``total`` (the extrapolated sum, exact when memory is affine in
    the block count): categories that would go negative are clamped and the difference is taken from/added to the
    transient categories."""
    cats = {c: max(_extrapolate(c2[c], c4[c], la, lb_, n), 0) for c in c4}
    diff = total - sum(cats.values())
    order = ("temporaries", "activations", "logits", "master_weights", "gradients", "optimizer_states", "parameters")
    if diff > 0:
        cats["temporaries"] += diff
    for c in order:
        if diff >= 0:
            break
        take = min(cats[c], -diff)
        cats[c] -= take
        diff += take
    return cats


def simulate_plan(spec: "ModelSpec", plan: "Plan", *, layers: str = "auto", timeline: bool = False,
                  round_to: int = 512, timeline_layers: str = "full") -> SimulationResult:
    """Simulate ``plan`` on ``spec``. ``layers="auto"`` simulates 2 and 3 blocks (whole periods for periodic blocks)
    and extrapolates (else the full model); ``"full"`` always simulates every block. ``timeline=True`` also records
    the memory curve for plots: of the full model (``timeline_layers="full"``, one more replay of every block) or of
    the 3-block model (``"sample"``, fast, not the real peak)."""
    from oomdoctor.plan import validate

    plan = validate(plan)
    t0 = time.perf_counter()
    n = spec.num_layers
    period = layer_period(spec) if layers == "auto" else None
    extrap = period is not None and n % period == 0 and n > (EXTRAPOLATE_FROM[1] + 1) * period
    try:
        return _simulate_plan(spec, plan, n, extrap, timeline, round_to, t0, period or 1, timeline_layers)
    except BadInput:
        raise
    except Exception as exc:  # noqa: BLE001 - an op or model path the replay cannot run: say so, point to analytic
        msg = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""
        raise BadInput(
            f"{spec.name}: the simulated step could not run this model/plan ({type(exc).__name__}: {msg})",
            "use --engine analytic for this model, or report it with the model's config.json",
        ) from exc


def _simulate_plan(spec, plan, n: int, extrap: bool, timeline: bool, round_to: int, t0: float,
                   period: int = 1, timeline_layers: str = "full") -> SimulationResult:
    if extrap:
        la, lb_ = EXTRAPOLATE_FROM[0] * period, EXTRAPOLATE_FROM[1] * period
        r2 = simulate_run(spec, plan, la, timeline=False, round_to=round_to)
        r4 = simulate_run(spec, plan, lb_, timeline=False, round_to=round_to)
        runs = (r2, r4)
        ex = lambda a, b: max(_extrapolate(a, b, r2.layers, r4.layers, n), 0)  # noqa: E731
        phase_peaks, phase_cats = {}, {}
        for ph in r4.phase_peaks:
            best, best_total = None, -1
            for c2, c4 in zip(r2.candidates[ph], r4.candidates[ph]):
                total = ex(sum(c2.values()), sum(c4.values()))
                if total > best_total:
                    best, best_total = _extrapolate_categories(c2, c4, r2.layers, r4.layers, n, total), total
            phase_cats[ph] = best
            phase_peaks[ph] = best_total
        external = {k: ex(r2.external.get(k, 0), r4.external.get(k, 0)) for k in set(r2.external) | set(r4.external)}
        adapter = ex(r2.adapter_bytes, r4.adapter_bytes)
        ref = r4
    else:
        r = simulate_run(spec, plan, None, timeline=timeline, round_to=round_to)
        runs = (r,)
        phase_peaks, phase_cats, external, adapter, ref = r.phase_peaks, r.phase_categories, r.external, r.adapter_bytes, r
    tl_run = ref
    if timeline and extrap and timeline_layers == "full":
        # a plot needs the real curve: one more replay of every block (slower: ~N/5 times the extrapolated cost)
        tl_run = simulate_run(spec, plan, None, timeline=True, round_to=round_to)
    elif timeline and extrap:
        tl_run = simulate_run(spec, plan, EXTRAPOLATE_FROM[1] * period, timeline=True, round_to=round_to)
    peak_phase = max(PHASE_NAMES, key=lambda ph: phase_peaks.get(ph, -1))
    cats = phase_cats[peak_phase]
    peak = phase_peaks[peak_phase]
    # categories sum to the peak by construction in each run; linear extrapolation keeps the sum
    drift = peak - sum(cats.values())
    if drift:
        cats = dict(cats, temporaries=cats["temporaries"] + drift)
    seconds = time.perf_counter() - t0
    notes = []
    if extrap:
        notes.append(f"simulated {runs[0].layers} and {runs[1].layers} blocks, extrapolated linearly to {n}")
    if plan.attn == "flash":
        notes.append("flash attention simulated with SDPA's flash kernel (same O(seq) saved state)")
    if plan.quant == "int8":
        notes.append("LLM.int8() outlier columns not modelled (data dependent; usually a handful)")
    bd = breakdown_from(cats, peak, peak_phase, phase_peaks, adapter, external, spec, plan, notes)
    return SimulationResult(
        breakdown=bd,
        timeline=tl_run.timeline,
        phase_peaks=phase_peaks,
        phase_categories=phase_cats,
        seconds=seconds,
        layers_simulated=tuple(r.layers for r in runs),
        timeline_layers=tl_run.layers,
        extrapolated=extrap,
        paged_bytes=external.get("paged_optimizer", 0),
        step_peaks=tuple(ref.step_peaks),
    )


def breakdown_from(cats: dict, peak: int, peak_phase: str, phase_peaks: dict, adapter: int, external: dict,
                   spec, plan, notes: list[str]) -> MemoryBreakdown:
    """Fill a MemoryBreakdown from tensor categories at the peak plus the device-level model (runtime constants)."""
    paged = external.get("paged_optimizer", 0)
    offloaded = external.get("cpu_offloaded", 0)
    transient = cats["activations"] + cats["logits"] + cats["temporaries"] + cats["master_weights"]
    dev = device_overheads(spec, plan, transient)
    reserved = peak + dev["allocator_slack"] + dev["cublas_workspace"]
    return MemoryBreakdown(
        **{c: cats[c] for c in TENSOR_COMPONENTS},
        adapters=min(adapter, cats["parameters"]),
        allocator_slack=dev["allocator_slack"],
        cuda_context=dev["cuda_context"],
        cublas_workspace=dev["cublas_workspace"],
        paged_optimizer=paged,
        cpu_offloaded=offloaded,
        peak_allocated=peak,
        peak_reserved=reserved,
        peak_device=reserved + dev["cuda_context"] + paged,
        peak_phase=peak_phase,
        phases={ph: int(phase_peaks.get(ph, 0)) for ph in PHASE_NAMES},
        engine="simulate",
        notes=tuple(notes) + tuple(dev.get("notes", ())),
    )


def device_overheads(spec, plan, transient_bytes: int) -> dict:
    """CUDA context, cuBLAS workspace and allocator slack around a simulated tensor peak.

    Taken from the analytic engine's runtime model (``oomdoctor.memory.runtime``: named constants calibrated on a
    GPU), so both engines agree on everything outside the tensor bytes: slack = per-block rounding of the
    persistent tensors + segment tails + a fragmentation share of the transient bytes at the peak; cuBLAS workspace
    is allocator memory counted in ``peak_reserved``; the context only in ``peak_device``."""
    try:
        from oomdoctor.memory import optimizer as optm
        from oomdoctor.memory import runtime as rt
        from oomdoctor.memory.analytic import _persistent_tensors
        from oomdoctor.memory.context import make_ctx

        c = make_ctx(spec, plan, "cuda")
        slack = rt.allocator_slack_bytes(_persistent_tensors(c, optm.optimizer_memory(c)), transient_bytes)
        return {
            "allocator_slack": int(slack),
            "cuda_context": int(rt.cuda_context_bytes(c)),
            "cublas_workspace": int(rt.cublas_workspace_bytes(c)),
        }
    except (ImportError, AttributeError, TypeError):  # runtime model absent or changed: documented fallback
        return {
            "allocator_slack": int(transient_bytes * 0.08) + 12 * 2**20,
            "cuda_context": 512 * 2**20,
            "cublas_workspace": 64 * 2**20,
            "notes": ("device overheads: fallback constants (oomdoctor.memory.runtime not importable)",),
        }


def estimate_simulated(spec: "ModelSpec", plan: "Plan") -> MemoryBreakdown:
    """Entry point of ``oomdoctor.memory.estimate(spec, plan, "simulate")``."""
    return simulate_plan(spec, plan).breakdown


__all__ = ["simulate_plan", "estimate_simulated", "SimulationResult", "run_steps", "simulate_run", "make_optimizer",
           "homogeneous_layers"]
_ = (math, replace, Any)
