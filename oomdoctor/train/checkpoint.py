"""Atomic, resumable checkpoints: ``<output_dir>/checkpoint-<step>/``.

A checkpoint is written into ``<output_dir>/.tmp-checkpoint-<step>-<pid>/`` (every file flushed and fsynced),
then renamed into place with ``os.replace`` — a kill at any moment leaves either the previous checkpoints or the
new complete one, never a half-written directory. ``trainer_state.json`` is written last inside the temp dir and
marks a checkpoint as complete.

Contents (Hugging Face Trainer's ``checkpoint-N`` layout):
- weights through ``save_pretrained``: ``model.safetensors`` (sharded with an index for big models) +
  ``config.json`` (full fine-tuning), or ``adapter_model.safetensors`` + ``adapter_config.json`` (LoRA/QLoRA:
  adapters only; the frozen base is not copied);
- ``optimizer.pt`` (optimizer state; with offload also the host fp32 master weights), ``scheduler.pt``,
  ``scaler.pt`` (fp16 GradScaler), ``rng_state.pth`` (torch CPU/CUDA, Python ``random``);
- ``trainer_state.json``: ``global_step``, samples consumed (data position), current micro-batch, OOM recoveries,
  loss history, a fingerprint of the config's math-relevant settings.

A write that fails (disk full, quota, I/O error) removes the temporary directory, leaves every earlier checkpoint as
it was and raises :class:`~oomdoctor.errors.WriteFailed` (exit 74) naming the directory, the free space and the
newest intact checkpoint (:func:`writing`).

Reading: :func:`read_state` (the JSON alone, to compare fingerprints before touching the model), then
:func:`load_checkpoint`; a checkpoint that cannot be read raises :class:`CorruptCheckpoint` and the caller falls
back to an older one.

Sharded runs (strategy ``fsdp``) write the same directory through :func:`save_sharded_checkpoint`, collectively:
``sharded/`` is a ``torch.distributed.checkpoint`` (DCP) directory with every rank's shards of the model (LoRA: the
adapters only) and of the optimizer state plus DCP's ``.metadata``; ``scheduler.pt``; ``rng_state_<rank>.pth`` per
rank; ``trainer_state.json`` last. All ranks write into one temporary directory, rank 0 renames it into place once
every rank is done (a shared filesystem across nodes, as DCP needs). :func:`load_sharded_checkpoint` reads it back
(DCP reshards when the shard layout changed). DeepSpeed ZeRO runs (``zero2``/``zero3``) use the same directory
with ``deepspeed/`` (``engine.save_checkpoint`` / ``load_checkpoint``, tag ``zero``) in place of ``sharded/``
(DeepSpeed reloads on the same number of ranks).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from oomdoctor.files import write_failed

_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.pth"


class CorruptCheckpoint(Exception):
    """A checkpoint directory whose files cannot be read back (truncated, empty, wrong content)."""


def _fsync_dir_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:  # pragma: no cover - platforms without directory fsync
        pass


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with trainer_state.json), sorted by step."""
    out = []
    d = Path(output_dir)
    if not d.is_dir():
        return out
    for p in d.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and (p / STATE_FILE).exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    cps = list_checkpoints(output_dir)
    return cps[-1][1] if cps else None


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


#: An errno named in a writer's message: safetensors' Rust writer ("No space left on device (os error 28)"), DCP's
#: CheckpointException, which carries each rank's formatted error ("OSError: [Errno 28] ...").
_OS_ERROR_RE = re.compile(r"(?:os error |\[Errno )(\d+)")


def os_error(exc: BaseException | None) -> OSError | None:
    """The OS error under a failed write: ``exc`` itself, one it was raised from or while handling (``torch.save``
    into a file object chains the file's OSError), or the errno a writer's message names; None for any other
    failure."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        m = _OS_ERROR_RE.search(str(exc))
        if m:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
        exc = exc.__cause__ or exc.__context__
    return None


@contextmanager
def writing(tmp: Path, what: str, path: Path, run_dir: Path, *, cleanup: bool = True) -> Iterator[None]:
    """Around the writes into ``tmp``, the directory where ``what`` (``checkpoint``, ``final model``) is written aside
    before it lands at ``path`` in ``run_dir``: any failure removes ``tmp`` (``cleanup``: this process owns it); one
    with an OS cause (disk full, quota, I/O error) becomes WriteFailed naming the free space and the newest complete
    checkpoint of ``run_dir``, other errors pass through."""
    try:
        yield
    except Exception as exc:
        if cleanup:
            shutil.rmtree(tmp, ignore_errors=True)
        failure = os_error(exc)
        if failure is None:
            raise
        kept = latest_checkpoint(run_dir)
        raise write_failed(
            what,
            path,
            failure,
            "the partial copy was removed; " + (f"{kept.name} is intact" if kept else "no earlier checkpoint exists"),
            "free space on that disk (or move output_dir), then continue the run with --resume",
        ) from None


def _save(obj, path: Path) -> None:
    """``torch.save`` through a Python file, so that a failed write raises the file's OSError (:func:`os_error`)."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (HF Trainer's ``checkpoint-<step>``)."""
    return Path(output_dir) / f"checkpoint-{step}"


def _replace_into(out: Path, tmp: Path, final: Path, step: int) -> None:
    """Rename the complete ``tmp`` to ``final``; re-saving the same step (e.g. after an unrecoverable OOM) swaps
    atomically."""
    if final.exists():
        trash = out / f".old-checkpoint-{step}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model,
    is_peft: bool,
    optimizer,
    scheduler,
    scaler,
    state: dict,
    save_total_limit: int | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically; returns its path. Runs outside any simulated memory budget."""
    from torch.utils._python_dispatch import _disable_current_modes

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(out, step)
    tmp = out / f".tmp-checkpoint-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    with writing(tmp, "checkpoint", final, out):
        tmp.mkdir()
        with _disable_current_modes():
            model.save_pretrained(tmp, safe_serialization=True)
            _save(optimizer.state_dict(), tmp / "optimizer.pt")
            _save(scheduler.state_dict(), tmp / "scheduler.pt")
            if scaler is not None:
                _save(scaler.state_dict(), tmp / "scaler.pt")
            _save(_rng_state(), tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "global_step": step}, indent=1))
        _fsync_dir_tree(tmp)
        _replace_into(out, tmp, final, step)
    if save_total_limit:
        for _, p in list_checkpoints(out)[:-save_total_limit]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def read_state(path: str | Path) -> dict:
    """``trainer_state.json`` of a checkpoint; :class:`CorruptCheckpoint` when it cannot be read."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
        int(state["step"])
        return state
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"{STATE_FILE}: {exc}") from None


def _load_full_weights(model, p: Path) -> None:
    from safetensors.torch import load_file

    index = p / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    sd: dict = {}
    for f in files:
        sd.update(load_file(str(p / f)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed" in k}
    if unexpected or set(missing) - tied:
        raise CorruptCheckpoint(f"weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")


def _load_adapters(model, p: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    res = set_peft_model_state_dict(model, load_file(str(p / "adapter_model.safetensors")))
    bad = [k for k in getattr(res, "unexpected_keys", []) if "lora" in k]
    if bad:
        raise CorruptCheckpoint(f"adapter keys do not match the model: {bad[:3]}")


def load_checkpoint(path: str | Path, *, model, is_peft: bool, optimizer, scheduler, scaler) -> dict:
    """Restore weights, optimizer, scheduler, scaler and RNG from ``path``; returns the trainer state. Any file
    that cannot be read raises :class:`CorruptCheckpoint` (the RNG is restored last, only when all else loaded)."""
    p = Path(path)
    state = read_state(p)
    try:
        _load_adapters(model, p) if is_peft else _load_full_weights(model, p)
        optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=False))
        scheduler.load_state_dict(torch.load(p / "scheduler.pt", weights_only=False))
        if scaler is not None and (p / "scaler.pt").exists():
            scaler.load_state_dict(torch.load(p / "scaler.pt", weights_only=False))
        rng = torch.load(p / RNG_FILE, weights_only=False)
        _set_rng_state(rng)
    except CorruptCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors/torch.load/pickle raise many kinds for a damaged file
        raise CorruptCheckpoint(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
    return state


#: Sub-directory of a sharded checkpoint holding the DCP files.
SHARDED_DIR = "sharded"


def _dcp_state(model, optimizer, frozen_too: bool):
    """(options, {"model": ..., "optim": ...}) of a sharded model + optimizer (``get_state_dict``). Without
    ``frozen_too`` (LoRA) only the trainable weights; loading then checks them itself (``strict=False``: the frozen
    base is not in the checkpoint)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=not frozen_too, strict=frozen_too)
    msd, osd = get_state_dict(model, optimizer, options=options)
    return options, {"model": msd, "optim": osd}


#: Sub-directory of a DeepSpeed ZeRO checkpoint holding ``engine.save_checkpoint``'s files, and its tag.
ZERO_DIR, ZERO_TAG = "deepspeed", "zero"


def save_sharded_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model,
    is_peft: bool,
    optimizer,
    scheduler,
    state: dict,
    rank: int,
    tag: str,
    save_total_limit: int | None = None,
    engine=None,
) -> Path:
    """Collective (every rank calls it): write ``checkpoint-<step>`` of a sharded run atomically; returns its path.
    ``tag`` names the temporary directory all ranks share (the same on every rank). With a DeepSpeed ``engine``
    (ZeRO) the model and optimizer go through ``engine.save_checkpoint`` into ``deepspeed/`` instead of DCP."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.utils._python_dispatch import _disable_current_modes

    out = Path(output_dir)
    final = checkpoint_dir(out, step)
    tmp = out / f".tmp-checkpoint-{step}-{tag}"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    # a rank whose write fails raises WriteFailed; torchrun then stops the others (rank 0 removes the directory)
    with writing(tmp, "checkpoint", final, out, cleanup=rank == 0), _disable_current_modes():
        if engine is not None:
            engine.save_checkpoint(str(tmp / ZERO_DIR), tag=ZERO_TAG, save_latest=False)
        else:
            _, sd = _dcp_state(model, optimizer, frozen_too=not is_peft)
            dcp.save(sd, checkpoint_id=str(tmp / SHARDED_DIR))
        _save(_rng_state(), tmp / f"rng_state_{rank}.pth")
        if rank == 0:
            _save(scheduler.state_dict(), tmp / "scheduler.pt")
    dist.barrier()
    if rank == 0:
        with writing(tmp, "checkpoint", final, out):
            (tmp / STATE_FILE).write_text(
                json.dumps({**state, "step": step, "global_step": step, "sharded": True}, indent=1)
            )
            _fsync_dir_tree(tmp)
            _replace_into(out, tmp, final, step)
        if save_total_limit:
            for _, p in list_checkpoints(out)[:-save_total_limit]:
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def load_sharded_checkpoint(
    path: str | Path, *, model, is_peft: bool, optimizer, scheduler, rank: int, engine=None
) -> dict:
    """Collective: restore a sharded checkpoint into the sharded ``model`` and ``optimizer`` (DCP; with a DeepSpeed
    ``engine``: ``engine.load_checkpoint``), the scheduler and this rank's RNG; returns the trainer state. :class:`CorruptCheckpoint` when this rank could not read it (the
    caller makes the ranks agree before falling back)."""
    p = Path(path)
    state = read_state(p)
    try:
        if engine is not None:
            loaded, _ = engine.load_checkpoint(str(p / ZERO_DIR), tag=ZERO_TAG, load_lr_scheduler_states=False)
            if loaded is None:
                raise CorruptCheckpoint(f"no DeepSpeed checkpoint in {p / ZERO_DIR}")
        else:
            _load_dcp(p, model, optimizer, is_peft)
        scheduler.load_state_dict(torch.load(p / "scheduler.pt", weights_only=False))
        _set_rng_state(torch.load(p / f"rng_state_{rank}.pth", weights_only=False))
    except Exception as exc:  # noqa: BLE001 - DCP raises CheckpointException wrapping any rank's read error
        raise CorruptCheckpoint(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
    return state


def _load_dcp(p: Path, model, optimizer, is_peft: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    options, sd = _dcp_state(model, optimizer, frozen_too=not is_peft)
    dcp.load(sd, checkpoint_id=str(p / SHARDED_DIR))
    res = set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    trainable = {n for n, q in model.named_parameters() if q.requires_grad}
    bad = [k for k in getattr(res, "missing_keys", []) if k in trainable] + list(getattr(res, "unexpected_keys", []))
    if bad:
        raise CorruptCheckpoint(f"weights do not match the model: {bad[:3]}")


def full_model_state(model) -> dict:
    """Collective: the whole (unsharded) state dict of a sharded model, on the CPU, on every rank
    (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``; rank 0 saves it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


__all__ = [
    "os_error",
    "writing",
    "ZERO_DIR",
    "ZERO_TAG",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "full_model_state",
    "SHARDED_DIR",
    "save_checkpoint",
    "load_checkpoint",
    "read_state",
    "latest_checkpoint",
    "list_checkpoints",
    "CorruptCheckpoint",
    "STATE_FILE",
]
