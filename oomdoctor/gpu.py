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


def _device_processes(pynvml, handle) -> list[tuple[int, int]]:
    """(pid, bytes) of every compute and graphics process NVML lists on ``handle``."""
    procs: list[tuple[int, int]] = []
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            listed = getattr(pynvml, getter)(handle)
        except Exception:  # noqa: BLE001 - not supported on some drivers/containers
            continue
        for p in listed:
            used = getattr(p, "usedGpuMemory", None)
            if isinstance(used, int) and used > 0:
                procs.append((int(p.pid), int(used)))
    return procs


def _with_nvml(fn, index: int | None = None):
    """Run ``fn(pynvml, handle, index)`` on the (first visible) GPU; None when NVML or a GPU is not available."""
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
        return fn(pynvml, pynvml.nvmlDeviceGetHandleByIndex(idx), idx)
    except Exception:  # noqa: BLE001 - any NVML failure means "no usable GPU info"
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting NVML down must not hide the answer
            pass


def detect_gpu(index: int | None = None) -> GpuInfo | None:
    """Query NVML for the (first visible) GPU; None when NVML or a GPU is not available."""

    def query(pynvml, h, idx: int) -> GpuInfo:
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else str(name)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        me = os.getpid()
        others = [(pid, b) for pid, b in _device_processes(pynvml, h) if pid != me]
        return GpuInfo(
            index=idx,
            name=name,
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            used_by_others_bytes=sum(b for _, b in others),
            other_processes=tuple(others),
        )

    return _with_nvml(query, index)


def process_bytes(pid: int | None = None, index: int | None = None) -> int | None:
    """Device memory NVML attributes to process ``pid`` (default: this one); None when not available."""
    pid = os.getpid() if pid is None else pid

    def query(pynvml, h, idx: int) -> int | None:
        return next((b for p, b in _device_processes(pynvml, h) if p == pid), None)

    return _with_nvml(query, index)


def host_ram_bytes() -> int | None:
    """Physical RAM of this machine (``sysconf``), None where the OS does not say: what CPU offload can use."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
