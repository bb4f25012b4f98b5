"""The one map from the plan's dtype names to torch dtypes, and the dtypes a plan trains in.

``weight_dtype``: the stored dtype of the unquantized weights — bf16 for pure ``bf16``, else fp32 (for ``*-mixed``
the fp32 weights are AMP's master copy). ``autocast_dtype``: the dtype matmuls run in under autocast, None without
autocast. Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomdoctor.plan.plan import DTYPE_NAMES

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from oomdoctor.plan import Plan


def torch_dtype(name: str) -> "torch.dtype":
    """``"bfloat16"`` -> ``torch.bfloat16`` (one of :data:`DTYPE_NAMES`)."""
    import torch

    if name not in DTYPE_NAMES:
        raise KeyError(f"unknown dtype name {name!r} (one of {', '.join(DTYPE_NAMES)})")
    return getattr(torch, name)


def weight_dtype(plan: "Plan") -> "torch.dtype":
    """Stored dtype of the (non-quantized) weights."""
    return torch_dtype("bfloat16" if plan.precision == "bf16" else "float32")


def autocast_dtype(plan: "Plan") -> "torch.dtype | None":
    """Autocast dtype of a plan whose forward runs under autocast (``fp16-mixed``/``bf16-mixed``, and pure bf16 as
    another trainer runs it: ``model.execution.runs_autocast``), None otherwise."""
    from oomdoctor.model.execution import runs_autocast

    return torch_dtype(plan.compute_dtype) if runs_autocast(plan) else None


__all__ = ["torch_dtype", "weight_dtype", "autocast_dtype"]
