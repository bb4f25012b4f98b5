"""The local GPU as NVML sees it (name, total, free, memory held by other processes). No torch import.

``detect_gpu()`` returns None when there is no NVIDIA driver/GPU (laptops, CI): callers then give no fit verdict
unless the user passes ``--gpu-mem``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as NVML reports it."""

    index: int
    """NVML device index (honours the first entry of CUDA_VISIBLE_DEVICES when it is a plain index)."""
    name: str
    """Marketing name, e.g. ``NVIDIA H100 80GB HBM3``."""
    total_bytes: int
    """Total device memory."""
    free_bytes: int
    """Free device memory right now."""
    used_bytes: int
    """Used device memory right now (all processes, plus driver reservations)."""
    used_by_others_bytes: int
    """Memory held by processes other than this one (compute + graphics)."""
    other_processes: tuple[tuple[int, int], ...] = ()
    """(pid, bytes) of the other processes NVML lists."""

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "used_bytes": self.used_bytes,
            "used_by_others_bytes": self.used_by_others_bytes,
            "other_processes": [{"pid": p, "bytes": b} for p, b in self.other_processes],
        }


def _device_index() -> int:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(vis) if vis.isdigit() else 0


def detect_gpu(index: int | None = None) -> GpuInfo | None:
    """Query NVML for the (first visible) GPU; None when NVML or a GPU is not available."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded...
        return None
    try:
        idx = _device_index() if index is None else index
        if idx >= pynvml.nvmlDeviceGetCount():
            return None
        h = pynvml.nvmlDeviceGetHandleByIndex(idx)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else str(name)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        me = os.getpid()
        others: list[tuple[int, int]] = []
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs = getattr(pynvml, getter)(h)
            except Exception:  # noqa: BLE001 - not supported on some drivers/containers
                continue
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                if p.pid != me and isinstance(used, int) and used > 0:
                    others.append((int(p.pid), int(used)))
        return GpuInfo(
            index=idx,
            name=name,
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            used_by_others_bytes=sum(b for _, b in others),
            other_processes=tuple(others),
        )
    except Exception:  # noqa: BLE001 - any NVML failure means "no usable GPU info"
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
