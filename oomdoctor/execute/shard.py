"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as a plan applies it: one unit per decoder layer plus the root,
on a 1-D device mesh of ``world_size`` ranks or, with ``shard_group`` < ``world_size``, a 2-D HSDP mesh
(replicate x shard). The one place sharding is applied: ``train`` (real process group under torchrun) and the
simulate engine (fake process group, meta-built model) both call :func:`apply_fsdp`.

Recipe and measurements: ``shared/research/multi-gpu.md`` §1 and §4 (per-layer + root wrapping; the mesh and
``fully_shard`` are built outside ``FakeTensorMode``; ``CPUOffloadPolicy(pin_memory=False)`` is the only offload
that runs without a GPU).

Mixed precision: with ``*-mixed`` plans the sharded parameters stay fp32 (the master copy) and FSDP gathers them in
the compute dtype (``MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=fp32)``), gradients are reduced in
fp32 -- torchtitan's and accelerate's FSDP2 setup. The step's autocast stays on top (a no-op for ops already in the
compute dtype).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomdoctor.plan import Plan


def mesh_shape(plan: "Plan") -> tuple[int, ...]:
    """``(world_size,)`` or, for HSDP, ``(world_size // shard_group, shard_group)``."""
    if plan.shard_group and plan.shard_group < plan.world_size:
        return (plan.world_size // plan.shard_group, plan.shard_group)
    return (plan.world_size,)


def device_mesh(plan: "Plan", device_type: str) -> Any:
    """The device mesh of the plan's ranks (the process group must already be initialized)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(plan)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _mp_policy(plan: "Plan") -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not plan.is_mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, plan.compute_dtype), reduce_dtype=torch.float32)


def _offload_policy(plan: "Plan", device_type: str) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not plan.offload_params:
        return OffloadPolicy()
    # pin_memory needs an accelerator: on a CPU-only host it raises "Cannot access accelerator device" (§1)
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_fsdp(model: Any, plan: "Plan", mesh: Any, device_type: str) -> Any:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm, LM head); returns the model (now
    an ``FSDPModule``). Works on a meta-device model (simulate) and on materialized weights (train)."""
    from torch.distributed.fsdp import fully_shard

    from oomdoctor.execute.build import find_layers

    kw = dict(mesh=mesh, mp_policy=_mp_policy(plan), offload_policy=_offload_policy(plan, device_type))
    for layer in find_layers(model):  # the transformer blocks
        fully_shard(layer, reshard_after_forward=plan.reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=plan.reshard_after_forward, **kw)  # FSDP2 keeps the root gathered
    return model


def gathered_buffers(model: Any) -> list[tuple[Any, bool]]:
    """``(buffer, cast)`` for every sharded parameter's all-gather output: the storage FSDP2 gathers the unsharded
    parameter into before a unit's forward/backward and frees (``UntypedStorage.resize_(0)``) after it. ``cast``:
    gathered in a lower compute dtype (``MixedPrecisionPolicy.param_dtype``) than the stored shard. The buffers
    exist from the unit's first all-gather on (an empty list before the first forward). Reads FSDP2's private
    ``FSDPParam.all_gather_outputs`` (torch 2.6+), checked by tests/test_simulate_fsdp.py."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        group = mod._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            cast = fp.param_dtype is not None and fp.param_dtype != fp.orig_dtype
            out.extend((t, cast) for t in fp.all_gather_outputs)
    return out


def reset_after_error(model: Any) -> None:
    """After an exception inside forward/backward (an OOM the one-rank guard recovers from), put FSDP2 back in its
    idle state: if the failed attempt had reached backward, run the end-of-backward callback autograd never ran
    (it reduce-scatters what landed and clears FSDP's per-iteration state; the guard then zeroes the gradients and
    replays the step), then reshard every unit so the modules hold their sharded DTensor parameters again. Uses
    FSDP2's root state (private API, torch 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    root = model._get_fsdp_state()  # FSDP2's private state (no public API for it)
    if root._state_ctx.post_backward_final_callback_queued:  # FSDP2's private state (no public API for it)
        root._root_post_backward_final_callback()  # FSDP2's private state (no public API for it)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.reshard()


def clip_grad_norm(params: list, max_norm: float):
    """Clip sharded (DTensor) gradients to a total L2 norm of ``max_norm``; returns the total norm (a 0-d tensor).

    torch's ``clip_grad_norm_`` math (coefficient ``max_norm / (norm + 1e-6)`` clamped to 1) computed on the local
    shards: the squared norms of this rank's shards are summed over the mesh's ``shard`` dimension (HSDP replicas
    hold the same shard and are not counted twice), in float64 on the mesh's device. Done by hand rather than with
    ``torch.nn.utils.clip_grad_norm_`` because that fails on CPU-offloaded FSDP2 gradients (pytorch#148532) and
    one code path serves every FSDP plan."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    mesh = grads[0].device_mesh
    local = [g.to_local() for g in grads]
    comm = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    sq = torch.stack([n.to(comm, torch.float64) for n in torch._foreach_norm(local)]).pow(2).sum()
    group = mesh.get_group("shard") if mesh.ndim == 2 else mesh.get_group()
    dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for dev in {t.device for t in local}:
        on_dev = [t for t in local if t.device == dev]
        torch._foreach_mul_(on_dev, coef.to(dev, on_dev[0].dtype))
    return total


__all__ = ["apply_fsdp", "clip_grad_norm", "device_mesh", "gathered_buffers", "mesh_shape", "reset_after_error"]
