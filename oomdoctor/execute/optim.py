"""The optimizer a plan trains with, the CPU-offloaded optimizer step, activation offload, and the LR schedule.

- :func:`make_optimizer`: what ``transformers.Trainer`` builds for the plan's optimizer (HF ``optim`` names in
  ``oomdoctor.plan.HF_OPTIM_NAMES``), with Trainer's two parameter groups (weights decay; biases and norms do not):
  torch AdamW / SGD (``foreach``/``fused`` passed explicitly), bitsandbytes AdamW8bit / Paged AdamW (32-bit and
  8-bit; paged = CUDA unified memory) / Lion, transformers Adafactor (fixed LR, no relative step).
  ``target`` says where the step really runs: ``gpu`` (a CUDA device: bnb as is), ``cpu`` (real CPU tensors:
  paged optimizers refused, they need CUDA), ``cuda`` (a CPU replay of a CUDA run, the simulated engine: bnb's
  paged buffers are counted as unified memory by the tracker ``lb``, outside the allocator).
- ``offload_optimizer``: :class:`CPUOffloadOptimizer` keeps an fp32 master copy of every trainable parameter and
  the optimizer state in host memory (pinned on CUDA); each step copies the gradients to the host, steps there and
  copies the updated weights back (ZeRO-Offload's scheme, Ren et al. 2021, without DeepSpeed). The device then
  holds only weights + gradients for the trainable parameters. Known cost: two PCIe copies of the trainable
  parameters per step and a CPU-speed optimizer step.
- ``offload_activations``: on CUDA ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (every tensor saved for
  backward is copied to pinned host memory in forward and back in backward). On CPU the same pack/unpack hooks run,
  the host copy made outside the simulated device budget (``LiveBytes``), the unpacked copy inside it.
- LR schedule: ``transformers.get_scheduler``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomdoctor.errors import BadInput, NoGPU

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.plan import Plan

#: bnb paged optimizers keep tensors smaller than this on the device (bitsandbytes optim/optimizer.py get_state_buffer).
PAGED_MIN_NUMEL = 100_000


@dataclass(frozen=True)
class OptimizerArgs:
    """Hyperparameters with no memory effect (Hugging Face ``TrainingArguments`` names and defaults)."""

    learning_rate: float = 5e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the weight matrices (biases and norms never decay)."""
    adam_beta1: float = 0.9
    """Adam/Lion first-moment decay."""
    adam_beta2: float = 0.999
    """Adam/Lion second-moment decay."""
    adam_epsilon: float = 1e-8
    """Adam epsilon."""


def _disable_modes():
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def param_groups(params: list, weight_decay: float) -> list[dict]:
    """Trainer's two groups: matrices decay, vectors (biases, norms) do not; empty groups dropped."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def make_optimizer(
    params: list, plan: "Plan", args: OptimizerArgs = OptimizerArgs(), *, target: str = "cpu", lb: Any = None
):
    """The optimizer ``plan.optimizer`` over ``params`` (see the module docstring for ``target`` and ``lb``)."""
    import torch

    if not params:
        raise BadInput("the plan trains no parameter (no LoRA target matched?)", "check the LoRA target modules")
    kind, impl = plan.optimizer, plan.optimizer_impl
    groups = param_groups(params, args.weight_decay)
    lr, betas = args.learning_rate, (args.adam_beta1, args.adam_beta2)
    if kind.startswith("paged") and target == "cpu":
        raise NoGPU(
            f"optimizer {kind} pages optimizer state through CUDA unified memory and needs a CUDA GPU",
            "on CPU use adamw-8bit (optim: adamw_bnb_8bit), adamw or adafactor",
        )
    if kind == "adamw":
        return torch.optim.AdamW(
            groups, lr=lr, betas=betas, eps=args.adam_epsilon, foreach=impl == "foreach", fused=impl == "fused"
        )
    if kind == "sgd":
        return torch.optim.SGD(
            groups, lr=lr, momentum=plan.sgd_momentum, foreach=impl == "foreach", fused=impl == "fused" or None
        )
    if kind == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    return _bnb_optimizer(groups, plan, lr, betas, args.adam_epsilon, target, lb)


def _bnb_optimizer(groups: list, plan: "Plan", lr: float, betas: tuple, eps: float, target: str, lb: Any):
    """bitsandbytes AdamW (8/32-bit, paged or not) or Lion. On a replay (``target="cuda"``) paged state buffers
    are created outside the tracker and reported to it as ``paged_optimizer`` (unified memory)."""
    import bitsandbytes as bnb
    import torch

    kind = plan.optimizer
    bits = 8 if "8bit" in kind else 32
    paged = kind.startswith("paged")
    base = bnb.optim.Lion if kind == "lion" else bnb.optim.AdamW
    kw: dict = {"lr": lr, "betas": betas, "optim_bits": bits}
    if kind != "lion":
        kw["eps"] = eps
    if target != "cuda":
        return base(groups, is_paged=paged, **kw)

    class ReplayedPaged(base):  # type: ignore[misc, valid-type]
        """bnb optimizer whose paged buffers are counted as unified memory (outside the allocator)."""

        def fill_qmap(self):
            # bnb computes its two quantization maps in every optimizer, ~50 tensor ops each (a replay with an
            # optimizer per parameter ran thousands of them); the values are computed once per process here and each
            # optimizer gets its own tensors, made from Python data as bnb makes them
            signed, unsigned = _dynamic_maps()
            self.name2qmap["dynamic"] = torch.tensor(signed, dtype=torch.float32)
            self.name2qmap["udynamic"] = torch.tensor(unsigned, dtype=torch.float32)

        def get_state_buffer(self, p, dtype=torch.float32):
            return replayed_state_buffer(p, dtype, paged, lb)

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # bnb builds its quantization maps from data (real tensors, shared by all params)
        return ReplayedPaged(groups, is_paged=False, **kw)


def replayed_state_buffer(p, dtype, paged: bool, lb: Any):
    """A bitsandbytes optimizer state buffer as bnb allocates it on CUDA (``Optimizer8bit.get_state_buffer``): in
    unified memory when the optimizer is paged and the tensor has >= :data:`PAGED_MIN_NUMEL` elements — made outside
    the tracker ``lb`` and counted as ``paged_optimizer`` —, else on the device."""
    import torch

    if paged and p.numel() >= PAGED_MIN_NUMEL and lb is not None:
        with lb.paused():
            buf = torch.zeros_like(p, dtype=dtype, device=p.device)
        lb.ignore(buf, external="paged_optimizer")
        return buf
    return torch.zeros_like(p, dtype=dtype, device=p.device)


@functools.lru_cache(maxsize=1)
def _dynamic_maps() -> tuple[list[float], list[float]]:
    """bitsandbytes' signed and unsigned dynamic quantization maps (``create_dynamic_map``), as Python floats,
    computed outside every dispatch mode."""
    from bitsandbytes import functional as F

    with _disable_modes():
        return F.create_dynamic_map(signed=True).tolist(), F.create_dynamic_map(signed=False).tolist()


class CPUOffloadOptimizer:
    """Optimizer state + fp32 master weights in host memory; the step runs on the CPU.

    ``param_groups`` exposes the *device* parameters (so ``GradScaler.unscale_`` and gradient clipping see the
    device gradients); ``inner`` is the real optimizer over the host copies (the LR scheduler drives it).
    ``host_scope``: context in which host memory is allocated and the host step runs — by default outside every
    dispatch mode (a ``LiveBytes`` budget counts device memory only); the simulated engine passes its tracker's
    ``paused`` (tensors stay fake, nothing is counted).
    """

    def __init__(
        self,
        params: list,
        plan: "Plan",
        args: OptimizerArgs = OptimizerArgs(),
        *,
        host_scope: Callable[[], AbstractContextManager] = _disable_modes,
    ):
        import torch

        self.params = list(params)
        self.host_scope = host_scope
        on_cuda = any(p.device.type == "cuda" for p in self.params)
        pin = on_cuda and torch.cuda.is_available()
        with host_scope():
            self.host = []
            for p in self.params:
                h = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                h.copy_(p.detach())
                self.host.append(h)
            self.inner = make_optimizer(self.host, plan, args, target="gpu" if on_cuda else "cpu")
        self.param_groups = [{"params": self.params}]
        self.state: dict = {}  # device-side state: none (what LiveBytes.track_optimizer reads)
        self.defaults = self.inner.defaults

    def step(self, closure=None):  # optimizer protocol
        import torch

        with self.host_scope():
            for p, h in zip(self.params, self.host):
                if p.grad is None:
                    h.grad = None
                    continue
                g = p.grad.detach()
                if g.device.type == "cpu" and g.dtype == torch.float32:
                    h.grad = g.clone()  # .to() would return the device gradient itself: keep the host's separate
                else:
                    h.grad = g.to("cpu", dtype=torch.float32, non_blocking=True)
            if any(p.device.type == "cuda" for p in self.params):
                torch.cuda.synchronize()
            self.inner.step()
            for h in self.host:
                h.grad = None
        with torch.no_grad():
            for p, h in zip(self.params, self.host):
                p.copy_(h, non_blocking=True)  # in place: allocates nothing on the device

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "host": [h.clone() for h in self.host]}

    def load_state_dict(self, sd: dict) -> None:
        with self.host_scope():
            self.inner.load_state_dict(sd["inner"])
            for h, src in zip(self.host, sd["host"]):
                h.copy_(src)


def make_plan_optimizer(
    params: list,
    plan: "Plan",
    args: OptimizerArgs = OptimizerArgs(),
    *,
    target: str = "cpu",
    lb: Any = None,
    host_scope: Callable[[], AbstractContextManager] | None = None,
):
    """The optimizer a run of ``plan`` steps with: :class:`CPUOffloadOptimizer` when the plan offloads it,
    :class:`OptimizerInBackward` when it steps in backward, else :func:`make_optimizer`. Sharded strategies take
    the plain optimizer: FSDP2's CPUOffloadPolicy keeps the states with the offloaded shards, DeepSpeed wraps (and
    offloads) a torch optimizer itself."""
    from oomdoctor.plan.plan import SHARDED

    if plan.strategy in SHARDED:
        return make_optimizer(params, plan, args, target=target, lb=lb)
    if plan.offload_optimizer:
        return CPUOffloadOptimizer(params, plan, args, host_scope=host_scope or _disable_modes)
    if plan.optimizer_in_backward:
        return optimizer_in_backward(params, plan, args, target=target, lb=lb)
    return make_optimizer(params, plan, args, target=target, lb=lb)


def scheduler_target(optimizer):
    """The object an LR scheduler must drive (the inner host optimizer when offloading)."""
    return optimizer.inner if isinstance(optimizer, CPUOffloadOptimizer) else optimizer


def make_scheduler(name: str, optimizer, *, warmup_steps: int, total_steps: int):
    """``transformers.get_scheduler`` over the optimizer (the host optimizer when offloading)."""
    from transformers import get_scheduler

    return get_scheduler(
        name, optimizer=scheduler_target(optimizer), num_warmup_steps=warmup_steps, num_training_steps=total_steps
    )


class HostActivationOffload:
    """``torch.autograd.graph.save_on_cpu`` semantics where the "device" is the CPU under a budget (``LiveBytes``)
    or a fake-tensor replay: every tensor saved for backward is copied to host memory in forward (inside
    ``host_scope``: outside the budget) and copied back onto the device in backward — weights too, as torch's
    ``save_on_cpu`` does. With ``lb`` the host bytes of the largest forward are reported as ``cpu_offloaded``."""

    def __init__(self, host_scope: Callable[[], AbstractContextManager] = _disable_modes, lb: Any = None):
        self.host_scope = host_scope
        self.lb = lb
        self._per_forward: dict[int, int] = {}
        self._reported = 0

    def _account(self, host) -> None:
        if self.lb is None:
            return
        k = len(self.lb.spans())
        self._per_forward[k] = self._per_forward.get(k, 0) + host.untyped_storage().nbytes()
        largest = max(self._per_forward.values())
        self.lb.external["cpu_offloaded"] = self.lb.external.get("cpu_offloaded", 0) - self._reported + largest
        self._reported = largest

    def __call__(self) -> AbstractContextManager:
        import torch

        def pack(t):
            with self.host_scope():
                host = torch.empty_like(t, device="cpu")
                host.copy_(t.detach())
            self._account(host)
            return host

        def unpack(host):
            return host.clone()

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def activation_offload(enabled: bool, device_type: str) -> AbstractContextManager:
    """Context for the forward pass that moves saved activations to host memory."""
    if not enabled:
        return contextlib.nullcontext()
    import torch

    if device_type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return HostActivationOffload()()


__all__ = [
    "OptimizerArgs",
    "PAGED_MIN_NUMEL",
    "make_optimizer",
    "make_plan_optimizer",
    "param_groups",
    "replayed_state_buffer",
    "CPUOffloadOptimizer",
    "make_scheduler",
    "activation_offload",
    "HostActivationOffload",
    "scheduler_target",
]


def _optimizer_base():
    import torch

    return torch.optim.Optimizer


class OptimizerInBackward:
    """Per-parameter optimizers stepped in backward (plan ``optimizer_in_backward``; torchtune's
    ``optimizer_in_bwd``): each trainable parameter gets its own optimizer of the plan's kind, and a
    post-accumulate-grad hook steps it and frees the gradient the moment the gradient is complete. :meth:`step`
    and :meth:`zero_grad` do nothing (the work is done); ``param_groups`` are the inner optimizers' own dicts, so
    an LR scheduler over this object drives them all. Build with :func:`optimizer_in_backward`."""

    def __init__(self, inner: dict):
        self.inner = inner
        self.param_groups = [g for o in inner.values() for g in o.param_groups]
        self.defaults: dict = {}
        self.hooks = [p.register_post_accumulate_grad_hook(self._step_param) for p in inner]

    @property
    def state(self) -> dict:
        """The inner optimizers' states by parameter (what trackers classify as optimizer states)."""
        return {p: st for o in self.inner.values() for p, st in o.state.items()}

    def _step_param(self, p) -> None:
        opt = self.inner[p]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self, closure=None) -> None:  # Optimizer protocol
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # gradients are freed in backward
        return None

    def state_dict(self) -> dict:
        return {"inner": [o.state_dict() for o in self.inner.values()]}

    def load_state_dict(self, sd: dict) -> None:
        for o, s in zip(self.inner.values(), sd["inner"]):
            o.load_state_dict(s)


def optimizer_in_backward(
    params: list, plan: "Plan", args: OptimizerArgs = OptimizerArgs(), *, target: str = "cpu", lb: Any = None
):
    """An :class:`OptimizerInBackward` (a ``torch.optim.Optimizer`` for LR schedulers) over ``params``."""
    cls = type("OptimizerInBackward", (OptimizerInBackward, _optimizer_base()), {})
    inner = {p: make_optimizer([p], plan, args, target=target, lb=lb) for p in params}
    return cls(inner)
