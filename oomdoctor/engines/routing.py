"""Balanced MoE routing for fake-tensor replays of transformers' eager experts.

transformers' eager experts (``@use_experts_implementation``'s ``eager``: what runs where the grouped matmul needs
bf16 — fp32 master weights, ``*-mixed``, QLoRA's fp32-upcast experts) pick the hit experts and each expert's tokens
with ``nonzero``, whose output shape depends on the router's data, which fake tensors do not hold
(``models/mixtral/modeling_mixtral.py`` ``MixtralExperts.forward``; every switchable-experts class copies it)::

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()      # [hit, 1]
    for expert_idx in expert_hit:
        if expert_idx == self.num_experts: continue                           # a Python bool of the data
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])           # nonzero of [top_k, tokens]

The mode :func:`balanced_routing` enters answers those two questions for the replay as a balanced router would: every expert is hit
(a real index tensor, so the loop and its comparisons run) and each receives ``tokens·top_k / experts`` token slots
(``nonzero_static`` of that size; the remainder spread over the first experts). The bytes the experts save are the
same for any routing — every token sends exactly ``top_k`` rows, so the per-expert slices always sum to
``tokens·top_k`` — only the largest single expert's transient depends on the balance, and the analytic formulas
assume the same balanced router. Known limitation: a skewed router (one expert taking most tokens) peaks higher
by that expert's transient; no fake replay can know the data.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache
from typing import TYPE_CHECKING

from oomdoctor.errors import BadInput

if TYPE_CHECKING:
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan


def expert_token_counts(slots: int, experts: int) -> list[int]:
    """Token slots per expert under a balanced router: ``slots`` (tokens·top_k) spread as evenly as integers allow."""
    base, extra = divmod(slots, experts)
    return [base + (1 if e < extra else 0) for e in range(experts)]


@lru_cache(maxsize=1)
def _mode_cls():
    """The ``TorchDispatchMode`` class (defined on first use: importing torch stays lazy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _BalancedRouting(TorchDispatchMode):
        """Sizes ``nonzero`` in eager experts as a balanced router would (module docstring); the hit-expert index is
        a real tensor, and ops whose tensors all derive from it run for real (tiny index arithmetic)."""

        def __init__(self, experts: int, top_k: int):
            super().__init__()
            self.experts, self.top_k = experts, top_k
            self.calls = 0
            from torch.utils.weak import WeakIdKeyDictionary

            self.real = WeakIdKeyDictionary()  # the real index tensors, by identity, dropped with them

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.utils._pytree import tree_flatten, tree_map_only

            kwargs = kwargs or {}
            flat = (*args, *kwargs.values())
            if any(isinstance(a, (list, tuple, dict)) for a in flat):  # a tensor list (cat, stack, index)
                flat = tree_flatten((args, kwargs))[0]
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            if tensors and all(t in self.real for t in tensors):
                with unset_fake_temporarily():
                    out = func(*args, **kwargs)
                tree_map_only(torch.Tensor, self._keep, out)
                return out
            if func is torch.ops.aten.nonzero.default:
                return self._nonzero(args[0])
            return func(*args, **kwargs)

        def _keep(self, t) -> None:
            self.real[t] = True

        def _nonzero(self, x):
            import torch
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            if x.dim() == 1 and x.numel() in (self.experts, self.experts + 1):  # which experts are hit: all
                with unset_fake_temporarily():
                    hit = torch.arange(self.experts, dtype=torch.long).unsqueeze(1)
                self._keep(hit)
                return hit
            if x.dim() == 2 and x.shape[0] == self.top_k:  # the (top-k slot, token) pairs of one expert
                size = expert_token_counts(x.numel(), self.experts)[self.calls % self.experts]
                self.calls += 1
                return torch.ops.aten.nonzero_static.default(x, size=size)
            raise BadInput(
                f"the replay met a data-dependent nonzero of shape {list(x.shape)} outside the MoE experts it can size",
                "use --engine analytic",
            )

    return _BalancedRouting


def balanced_routing(spec: "ModelSpec", plan: "Plan"):
    """The balanced-routing dispatch mode for a plan that runs transformers' eager experts (enter it inside the
    ``FakeTensorMode``), else a no-op context."""
    from oomdoctor.execute.build import runs_eager_experts

    if not runs_eager_experts(spec, plan):
        return nullcontext()
    return _mode_cls()(spec.num_experts, spec.experts_per_token)
