"""Allocations outside PyTorch's caching allocator: ``CUDA error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED``,
``CUDNN_STATUS_ALLOC_FAILED``, NCCL's ``Cuda failure 'out of memory'`` (CUDA context creation, library workspaces),
and cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED``, which is how cuDNN reports that no algorithm's workspace fits in the free
memory (accelerate's ``should_reduce_batch_size`` counts it as an OOM). No sizes are printed.

A caching-allocator message in the same text is read first (:data:`oomdoctor.explain.parsers.PARSERS`); a cuDNN or
cuBLAS error after it is the same shortage seen again, and :func:`after_oom_note` says so.
"""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText

_CUDA_ERR_RE = re.compile(
    r"CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|"
    r"Cuda failure '?out of memory|CUDA driver error: out of memory|CUDNN_STATUS_ALLOC_FAILED|"
    r"CUDNN_STATUS_NOT_SUPPORTED"
)
_NOTE = (
    "raised by the CUDA runtime/cuBLAS outside PyTorch's caching allocator (context creation, "
    "library workspaces, NCCL): no sizes are printed, and HF auto_find_batch_size / accelerate's "
    "should_reduce_batch_size do not recognise it as an OOM"
)
_NOT_SUPPORTED_NOTE = (
    "cuDNN says NOT_SUPPORTED when no convolution/RNN algorithm's workspace fits in the free memory, so with large "
    "batches it is an out-of-memory error in disguise (accelerate's should_reduce_batch_size treats it as one); it "
    "also means a non-contiguous input: if a smaller batch does not make it go away, check the input's layout"
)


def after_oom_note(flat: str, oom_start: int) -> str | None:
    """When a cuDNN/cuBLAS error follows the out-of-memory message at ``oom_start``: a note saying it is a
    consequence of the same shortage (the allocator's numbers above are the ones that tell)."""
    later = _CUDA_ERR_RE.search(flat, oom_start + 1)
    if later is None:
        return None
    return (
        f"a later {later.group(0)} error in the same log followed this out-of-memory error: the same shortage "
        "seen by cuDNN/cuBLAS after the allocator ran out (fix the OOM above and it goes away)"
    )


def parse(text: FlatText) -> Found | None:
    m = _CUDA_ERR_RE.search(text.flat)
    if not m:
        return None
    note = _NOT_SUPPORTED_NOTE if m.group(0) == "CUDNN_STATUS_NOT_SUPPORTED" else _NOTE
    return Found(
        OomMessage(
            kind="cuda-error",
            format="cudnn" if m.group(0).startswith("CUDNN") else "cuda-runtime",
            device="cuda",
            message=m.group(0),
            occurrences=len(_CUDA_ERR_RE.findall(text.flat)),
            notes=(note,),
        ),
        m.start(),
    )
