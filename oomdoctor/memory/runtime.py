"""Device memory outside the tensors: CUDA context, cuBLAS workspace, caching-allocator slack.

All constants are named module-level values so that a GPU calibration (``measure`` engine) can replace them.

* CUDA context: what ``nvidia-smi`` shows for a process after ``torch.cuda.init()`` plus the kernels a training step
  loads (torch >= 1.13 / CUDA >= 11.7 load modules lazily, ``CUDA_MODULE_LOADING=LAZY``). PyTorch's CUDA notes
  ("Memory management": memory "used by the CUDA context ... is not tracked by the caching allocator") and common
  measurements put it at 300-600 MiB on Ampere/Hopper with torch 2.x; we use 512 MiB until calibrated.
* cuBLAS workspace: torch allocates it *through the caching allocator* (``aten/src/ATen/cuda/CublasHandlePool.cpp``:
  ``getNewWorkspace`` -> ``CUDACachingAllocator::get()->allocate``), one per (handle, stream); handles are
  per thread, and autograd runs backward on its own device thread, so a training step holds two. Default size
  (``_getWorkspaceSize`` / ``CUBLAS_WORKSPACE_CONFIG``): ``:4096:8`` = 32 MiB on Hopper (sm90+), ``:4096:2:16:8``
  = 8.125 MiB before; cuBLASLt reuses it (torch >= 2.6). Because it is an allocator block it shows in
  ``memory_allocated``/``memory_reserved``; oomdoctor keeps it out of ``peak_allocated`` (the tensor-bytes
  invariant) and adds it to ``peak_reserved``. A real ``max_memory_allocated`` is higher by this amount.
* Allocator slack (``peak_reserved - peak_allocated``), from c10/cuda/CUDACachingAllocator.cpp and the PyTorch
  "CUDA memory management" docs: every block is rounded up to 512 bytes (``kMinBlockSize``); requests <= 1 MiB
  (``kSmallSize``) share 2 MiB segments (``kSmallBuffer``); 1-10 MiB requests get 20 MiB segments (``kLargeBuffer``);
  larger ones are rounded up to 2 MiB (``kRoundLarge``) and get their own segment. Model: per-tensor rounding of
  the persistent tensors (weights, grads, states: computed exactly per parameter tensor) + one partly used small
  and large segment + a fragmentation allowance of ``FRAGMENTATION_FRACTION`` of the transient bytes
  (activations, logits, temporaries), which are freed and re-allocated in changing sizes every step.
  Limits: fragmentation depends on allocation order and ``expandable_segments``; the allowance is a calibrated
  average, not a bound (field reports: torchtune #1185 saw 16.4 -> 10.8 GiB with expandable segments).
* NCCL buffers (a CUDA assumption, like the context): with more than one rank NCCL allocates its communication
  buffers through ``cudaMalloc``, outside the caching allocator: ``NCCL_BUFFSIZE`` (4 MiB, NCCL's default) per
  channel for each peer connection and protocol. Field reports put them at hundreds of MB per GPU on large jobs
  (``shared/research/multi-gpu.md`` §7.7); the fake process group of the simulate engine cannot see them. We use
  :data:`NCCL_BUFFER_BYTES` per rank until calibrated on GPUs.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from oomdoctor.memory.context import Ctx

MiB = 2**20

#: CUDA context + lazily loaded kernels of a training step, per process (H100, torch 2.x). Calibrate on a GPU.
CUDA_CONTEXT_BYTES = 512 * MiB
#: cuBLAS workspace per handle on Hopper (``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:8``).
CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: Handles holding a workspace during a step: the main thread (forward) and autograd's device thread (backward).
CUBLAS_HANDLES = 2
#: NCCL's buffers per rank when world_size > 1: 2 directions x 32 channels x NCCL_BUFFSIZE 4 MiB. Calibrate on GPUs.
NCCL_BUFFER_BYTES = 256 * MiB
#: Allocator rounding granularity (kMinBlockSize) and large-allocation rounding (kRoundLarge above kMinLargeAlloc).
ALLOC_BLOCK = 512
ALLOC_ROUND_LARGE = 2 * MiB
ALLOC_MIN_LARGE = 10 * MiB
ALLOC_SMALL_SIZE = 1 * MiB
#: The caching allocator's environment variable and the setting oomdoctor runs CUDA with: expandable segments grow
#: segments instead of caching fixed-size blocks, so reserved-but-unallocated memory can serve big requests
#: (fragmentation OOMs, torchtune #1185). Newer torch also reads ``PYTORCH_ALLOC_CONF``.
ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"


def set_allocator_env(env: MutableMapping[str, str] = os.environ) -> None:
    """Set :data:`ALLOC_CONF` in ``env`` unless the user set their own (theirs wins). The allocator reads it once:
    call before CUDA is initialized (in a child's environment, before it starts)."""
    env.setdefault(ALLOC_CONF_VAR, ALLOC_CONF)


ALLOC_SMALL_SEGMENT = 2 * MiB
ALLOC_LARGE_SEGMENT = 20 * MiB
#: Share of the transient bytes (activations + logits + temporaries) the allocator holds on top as fragmentation.
FRAGMENTATION_FRACTION = 0.08


def rounded(nbytes: int) -> int:
    """Bytes the caching allocator reserves for one request of ``nbytes`` (block rounding only)."""
    if nbytes <= 0:
        return 0
    if nbytes > ALLOC_MIN_LARGE:
        return -(-nbytes // ALLOC_ROUND_LARGE) * ALLOC_ROUND_LARGE
    return -(-nbytes // ALLOC_BLOCK) * ALLOC_BLOCK


def rounding_waste(tensor_sizes: list[tuple[int, int]]) -> int:
    """Sum of (rounded - actual) over ``(nbytes, count)`` tensor kinds."""
    return sum((rounded(n) - n) * k for n, k in tensor_sizes)


def cuda_context_bytes(c: Ctx) -> int:
    """The CUDA context of one process (0 off CUDA)."""
    return CUDA_CONTEXT_BYTES if c.device == "cuda" else 0


def nccl_buffer_bytes(c: Ctx) -> int:
    """NCCL's communication buffers of one rank (0 on one rank or off CUDA)."""
    return NCCL_BUFFER_BYTES if c.device == "cuda" and c.plan.world_size > 1 else 0


def cublas_workspace_bytes(c: Ctx) -> int:
    """cuBLAS workspaces of a training step (0 off CUDA)."""
    return CUBLAS_WORKSPACE_BYTES * CUBLAS_HANDLES if c.device == "cuda" else 0


def allocator_slack_bytes(c: Ctx, persistent_tensors: list[tuple[int, int]], transient_bytes: int) -> int:
    """``peak_reserved - peak_allocated`` of CUDA's caching allocator: rounding of persistent tensors + segment tails
    + fragmentation. 0 on the CPU: its allocator (c10 ``DefaultCPUAllocator``, ``posix_memalign`` per tensor) keeps no
    cache of blocks, and a CPU run's budget counts live tensor bytes (``execute.tracking.LiveBytes``)."""
    if c.device != "cuda":
        return 0
    return (
        rounding_waste(persistent_tensors)
        + ALLOC_SMALL_SEGMENT
        + ALLOC_LARGE_SEGMENT // 2
        + int(FRAGMENTATION_FRACTION * transient_bytes)
    )
