"""Data-parallel training across processes started by torch's own launcher (``torchrun`` /
``torch.distributed.run``): the process group, and the two collectives a data-parallel step needs.

A step under DDP here runs every micro-batch inside ``DistributedDataParallel.no_sync()`` and then sums the
gradients over the ranks once (:func:`all_reduce_sum` per gradient), instead of letting DDP's hooks all-reduce
during the last backward. The sum is exact because every rank's loss is already divided by the *global* number of
target tokens (:func:`all_reduce_sum` of the local counts), and it keeps the ranks in lock-step even when one rank's
OOM guard splits its micro-batch into more backward passes than the others (multi-gpu.md §6: a rank splitting
inside ``no_sync`` has no collective in flight). DDP still broadcasts rank 0's parameters and buffers at wrap time.
Backend: NCCL for CUDA tensors (gloo for the small CPU tensors of the step's bookkeeping), gloo on CPU. FSDP2
(``oomdoctor.execute.shard``) needs a process group even on one rank (``offload_params`` on one GPU): :func:`init`
then makes a one-process group over an in-memory store. Collectives time out after :data:`TIMEOUT_ENV` seconds
(default :data:`DEFAULT_TIMEOUT_S`) instead of gloo's 30 min / NCCL's 10 min, so that ranks whose peer died without
a clean exit fail fast (multi-gpu.md §7.5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in a torchrun job (``WORLD_SIZE``/``RANK``/``LOCAL_RANK``; 1/0/0 alone)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    restarts: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: how often torchrun restarted the job (``--max-restarts``)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def from_env() -> DistInfo:
    def env(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return DistInfo(env("WORLD_SIZE", 1), env("RANK", 0), env("LOCAL_RANK", 0), env("TORCHELASTIC_RESTART_COUNT", 0))


#: Environment variable: seconds a collective waits for the peers before it fails.
TIMEOUT_ENV = "OOMDOCTOR_DIST_TIMEOUT_S"
#: Default of :data:`TIMEOUT_ENV`: long enough for rank 0 to read a large checkpoint while the others wait.
DEFAULT_TIMEOUT_S = 300


#: File stores this process made (removed by :func:`shutdown`).
_store_files: list[str] = []


def timeout_s() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return float(DEFAULT_TIMEOUT_S)


def init(info: DistInfo, device_type: str, *, one_rank_group: bool = False, shared_dir: str | None = None) -> None:
    """Join the process group (no-op when already joined). Alone: nothing, unless ``one_rank_group`` (FSDP2 on one
    rank), which makes a group of this process only.

    After a torchrun restart the ranks meet through a file store of their own (in the temp directory on one node,
    in ``shared_dir`` across nodes) instead of the agent's TCP store: with the agent's store, restarted gloo ranks
    intermittently connect to addresses of the previous attempt and fail ("Gloo connectFullMesh failed ...
    Connection refused"; torch 2.13, measured with slow-starting ranks whose peers outlived the failure)."""
    import datetime
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized() or not (info.enabled or one_rank_group):
        return
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s())
    if info.enabled and info.restarts:
        one_node = os.environ.get("LOCAL_WORLD_SIZE") == str(info.world_size)
        where = tempfile.gettempdir() if one_node or not shared_dir else shared_dir
        store = os.path.join(where, f".oomdoctor-pg-{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}-{info.restarts}")
        dist.init_process_group(
            backend=backend, init_method=f"file://{store}", rank=info.rank, world_size=info.world_size, timeout=timeout
        )
        _store_files.append(store)
    elif info.enabled:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def wrap(model: Any, info: DistInfo, device: Any) -> Any:
    """``DistributedDataParallel(model)`` (rank 0's weights broadcast to all); ``model`` itself alone."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def no_sync(model: Any):
    """DDP's ``no_sync()`` context (a null context for an unwrapped model)."""
    import contextlib

    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def all_reduce_sum(t: Any, info: DistInfo) -> Any:
    """``t`` summed over the ranks, in place (returned)."""
    if info.enabled:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_grads(params: list, info: DistInfo) -> None:
    """Sum every gradient over the ranks (a parameter without a gradient on this rank contributes zeros)."""
    if not info.enabled:
        return
    import torch

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce_sum(p.grad, info)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        dist.barrier()


def shutdown() -> None:
    """Leave the process group (the DDP one, or a one-rank FSDP group); remove its file store."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    while _store_files:
        try:
            os.remove(_store_files.pop())
        except OSError:
            pass


__all__ = [
    "DistInfo",
    "from_env",
    "init",
    "timeout_s",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT_S",
    "wrap",
    "no_sync",
    "all_reduce_sum",
    "all_reduce_grads",
    "barrier",
    "shutdown",
]
