"""Optimizers by HF ``optim`` name, the CPU-offloaded optimizer step, activation offload, and the LR schedule.

- torch AdamW / SGD (``foreach``/``fused`` passed explicitly), bitsandbytes AdamW8bit / Paged AdamW (32-bit and
  8-bit; paged = unified memory, CUDA only) / Lion, transformers Adafactor (fixed LR, no relative step).
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

import torch

from oomdoctor.errors import BadInput, NoGPU
from oomdoctor.train.config import TrainConfig


def _disable_modes():
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def make_optimizer(cfg: TrainConfig, params: list, device: torch.device):
    """The optimizer named by ``cfg.optim`` over ``params``."""
    kind = cfg.plan_optimizer
    impl = cfg.plan_optimizer_impl
    lr, wd = cfg.learning_rate, cfg.weight_decay
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    on_cuda = any(p.device.type == "cuda" for p in params)
    if kind.startswith("paged") and not on_cuda:
        raise NoGPU(
            f"optim: {cfg.optim} pages optimizer state through CUDA unified memory and needs a CUDA GPU",
            "on CPU use optim: adamw_bnb_8bit (8-bit state) or adamw_torch / adafactor",
        )
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=cfg.adam_epsilon, weight_decay=wd,
                                 foreach=impl == "foreach", fused=impl == "fused")
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.sgd_momentum, weight_decay=wd,
                               foreach=impl == "foreach", fused=impl == "fused")
    if kind == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False,
                         weight_decay=wd)
    import bitsandbytes as bnb

    if kind == "adamw-8bit":
        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=cfg.adam_epsilon, weight_decay=wd)
    if kind == "paged-adamw":
        return bnb.optim.PagedAdamW32bit(params, lr=lr, betas=betas, eps=cfg.adam_epsilon, weight_decay=wd)
    if kind == "paged-adamw-8bit":
        return bnb.optim.PagedAdamW8bit(params, lr=lr, betas=betas, eps=cfg.adam_epsilon, weight_decay=wd)
    if kind == "lion":
        return bnb.optim.Lion(params, lr=lr, betas=betas, weight_decay=wd)
    raise BadInput(f"optim: {cfg.optim} is not supported")  # pragma: no cover - config validation prevents it


class CPUOffloadOptimizer:
    """Optimizer state + fp32 master weights in host memory; the step runs on the CPU.

    ``param_groups`` exposes the *device* parameters (so ``GradScaler.unscale_`` and gradient clipping see the
    device gradients); ``inner`` is the real optimizer over the host copies (the LR scheduler drives it).
    """

    def __init__(self, cfg: TrainConfig, params: list[torch.nn.Parameter]):
        self.params = list(params)
        pin = any(p.device.type == "cuda" for p in self.params) and torch.cuda.is_available()
        with _disable_modes():  # host memory: outside the simulated device budget
            self.host = []
            for p in self.params:
                h = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                h.copy_(p.detach())
                self.host.append(h)
            self.inner = make_optimizer(cfg, self.host, torch.device("cpu"))
        self.param_groups = [{"params": self.params}]
        self.state: dict = {}  # device-side state: none (what LiveBytes.track_optimizer reads)
        self.defaults = self.inner.defaults

    def step(self, closure=None):  # noqa: ARG002 - optimizer protocol
        with _disable_modes():
            for p, h in zip(self.params, self.host):
                if p.grad is None:
                    h.grad = None
                    continue
                g = p.grad.detach().to("cpu", dtype=torch.float32, non_blocking=True)
                if g.data_ptr() == p.grad.data_ptr():  # CPU fp32: .to() returned the same tensor; keep it separate
                    g = g.clone()
                h.grad = g
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
        with _disable_modes():
            self.inner.load_state_dict(sd["inner"])
            for h, src in zip(self.host, sd["host"]):
                h.copy_(src)


def scheduler_target(optimizer):
    """The object an LR scheduler must drive (the inner host optimizer when offloading)."""
    return optimizer.inner if isinstance(optimizer, CPUOffloadOptimizer) else optimizer


def make_scheduler(cfg: TrainConfig, optimizer):
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler_type, optimizer=scheduler_target(optimizer),
                         num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps)


class _CPUSaveOnHost(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu`` semantics when the "device" is the CPU under a simulated budget: the saved tensor is copied
    outside the budget (host) in forward and copied back inside it (device) in backward."""

    def __init__(self):
        def pack(t: torch.Tensor):
            if isinstance(t, torch.nn.Parameter):
                return t  # a weight stays where it is (it is not an activation)
            with _disable_modes():
                return t.detach().clone()

        def unpack(h: torch.Tensor):
            if isinstance(h, torch.nn.Parameter):
                return h
            return h.clone()

        super().__init__(pack, unpack)


def activation_offload(enabled: bool, device: torch.device):
    """Context for the forward pass that moves saved activations to host memory."""
    if not enabled:
        return contextlib.nullcontext()
    if device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return _CPUSaveOnHost()


__all__ = ["make_optimizer", "CPUOffloadOptimizer", "make_scheduler", "activation_offload", "scheduler_target"]
