"""What every fake-tensor replay of a model needs, in one place (the simulate engine, the block measurement and the
replay of foreign trainers use it): the model built on the meta device as the executor builds it (FSDP2-wrapped when
the plan shards), the ops torch has no fake implementation for, and the weights ``to_empty`` unties, tied again.
Importing this module does not import torch."""

from __future__ import annotations

from contextlib import contextmanager


def meta_model(spec, plan, num_layers, bnb_decompose: bool, device_type: str = "cpu"):
    """The meta-built model of ``plan``; wrapped by FSDP2 on the current process group when ``strategy: fsdp``."""
    from oomdoctor.execute.build import build_model

    built = build_model(spec, plan, device="meta", num_layers=num_layers, bnb_decompose=bnb_decompose)
    if plan.strategy == "fsdp":
        from oomdoctor.execute.shard import apply_fsdp, device_mesh

        apply_fsdp(built.model, plan, device_mesh(plan, device_type), device_type)
    return built


@contextmanager
def fake_gaps():
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


def retie(model) -> None:
    """``to_empty`` replaces each module's parameters one by one, which unties shared weights (tied embeddings):
    tie them again as transformers does after loading."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(base, "config", None), "tie_word_embeddings", False) and hasattr(base, "tie_weights"):
        base.tie_weights()


__all__ = ["meta_model", "fake_gaps", "retie"]
