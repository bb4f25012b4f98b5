"""Silence third-party messages that say nothing about the user's run (one place, called by the CLI and train)."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_third_party() -> None:
    """bitsandbytes warns at import that an optional CPU 4-bit speed kernel (the ``kernels`` package) is missing;
    transformers 5.x warns on every gradient-checkpointing call that the name changes in v6; DeepSpeed announces
    that it falls back to the CPU, and calls torch collectives under deprecated names. None is actionable for an
    oomdoctor user. torch's fake-tensor mode logs a traceback when an op's meta kernel refuses its inputs (transformers'
    grouped expert matmul on a width that is not 16-byte aligned): the replay that ran it reports the failure in one
    line, or the formulas price the blocks it was measuring."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # a filter, not a level: importing torch later resets its registered loggers' levels
    fake = logging.getLogger("torch._subclasses.fake_tensor")
    if not any(isinstance(f, _MetaFailures) for f in fake.filters):
        fake.addFilter(_MetaFailures())
    _no_deepspeed_accelerator_probe()
    warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6.*", category=FutureWarning)
    # peft's MoE conversion sets rank/alpha patterns for the fused gate_up_proj (rank 2r) and then warns that they
    # matched no *module*: they match the ParamWrapper parameter and are applied (tests/test_moe.py counts them)
    warnings.filterwarnings(
        "ignore",
        message=r"The following (rank|alpha)_pattern keys did not match any targeted "
        r"module and were ignored: \[[^,]*gate_up_proj[^,]*\]",
        category=RuntimeWarning,
    )
    # DeepSpeed ZeRO's all-gather calls the name torch 2.13 deprecates (not the user's code)
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r".*torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    )


def _no_deepspeed_accelerator_probe() -> None:
    """Once deepspeed is installed, accelerate imports it, and on a machine without an NVIDIA driver its accelerator
    probe logs "Setting accelerator to CPU. If you have GPU ..." on stdout at every command. Telling it the answer
    (``DS_ACCELERATOR=cpu``, its documented override) when no GPU device node exists (NVIDIA, WSL2, ROCm) keeps it
    quiet; a user's own ``DS_ACCELERATOR`` wins, and a machine with a GPU probes as usual."""
    gpu_nodes = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # NVIDIA, WSL2's GPU paravirtualization, ROCm
    if "DS_ACCELERATOR" not in os.environ and not any(os.path.exists(p) for p in gpu_nodes):
        os.environ["DS_ACCELERATOR"] = "cpu"


class _MetaFailures(logging.Filter):
    """Drops fake-tensor mode's "failed while attempting to run meta for ..." record (the exception it logs is
    raised to the replay, which handles it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


class _PlannedRestarts(logging.Filter):
    """Drops torchrun's "failed (exitcode: 75)" record: that exit is a sharded rank's planned OOM restart
    (``oomdoctor.errors.EXIT_OOM_RESTART``), which train announces in its own words."""

    def filter(self, record: logging.LogRecord) -> bool:
        from oomdoctor.errors import EXIT_OOM_RESTART

        return f"exitcode: {EXIT_OOM_RESTART})" not in record.getMessage()


def quiet_planned_restarts() -> None:
    """Install :class:`_PlannedRestarts` on torch's elastic launcher logger (idempotent)."""
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _PlannedRestarts) for f in log.filters):
        log.addFilter(_PlannedRestarts())
