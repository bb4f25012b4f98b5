"""Allocations outside PyTorch's caching allocator: ``CUDA error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED``,
``CUDNN_STATUS_ALLOC_FAILED``, NCCL's ``Cuda failure 'out of memory'`` (CUDA context creation, library workspaces).
No sizes are printed."""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText

_CUDA_ERR_RE = re.compile(
    r"CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|"
    r"Cuda failure '?out of memory|CUDA driver error: out of memory|CUDNN_STATUS_ALLOC_FAILED"
)
_NOTE = ("raised by the CUDA runtime/cuBLAS outside PyTorch's caching allocator (context creation, "
         "library workspaces, NCCL): no sizes are printed, and HF auto_find_batch_size / accelerate's "
         "should_reduce_batch_size do not recognise it as an OOM")


def parse(text: FlatText) -> Found | None:
    m = _CUDA_ERR_RE.search(text.flat)
    if not m:
        return None
    return Found(OomMessage(
        kind="cuda-error", format="cuda-runtime", device="cuda", message=m.group(0),
        occurrences=len(_CUDA_ERR_RE.findall(text.flat)), notes=(_NOTE,),
    ), m.start())
