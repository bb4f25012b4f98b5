"""Atomic, resumable checkpoints: ``<output_dir>/checkpoint-<step>/``.

A checkpoint is written into ``<output_dir>/.tmp-checkpoint-<step>-<pid>/`` (every file flushed and fsynced),
then renamed into place with ``os.replace`` — a kill at any moment leaves either the previous checkpoints or the
new complete one, never a half-written directory. ``trainer_state.json`` is written last inside the temp dir and
marks a checkpoint as complete.

Contents:
- weights: ``model.safetensors`` (full fine-tuning: the whole state dict) or ``adapter_model.safetensors`` +
  ``adapter_config.json`` (LoRA/QLoRA: adapters only, via peft's ``save_pretrained``; the frozen base is not
  copied);
- ``optimizer.pt`` (optimizer state; with offload also the host fp32 master weights), ``scheduler.pt``,
  ``scaler.pt`` (fp16 GradScaler), ``rng.pt`` (torch CPU/CUDA, Python ``random``);
- ``trainer_state.json``: optimizer steps done, samples consumed (data position), current micro-batch, OOM
  recoveries, loss history, a fingerprint of the config's math-relevant keys.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


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
        if m and (p / "trainer_state.json").exists():
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


def save_checkpoint(output_dir: str | Path, step: int, *, model, is_peft: bool, optimizer, scheduler, scaler,
                    state: dict, save_total_limit: int | None = None) -> Path:
    """Write ``checkpoint-<step>`` atomically; returns its path. Runs outside any simulated memory budget."""
    from torch.utils._python_dispatch import _disable_current_modes

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"checkpoint-{step}"
    tmp = out / f".tmp-checkpoint-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with _disable_current_modes():
        if is_peft:
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            from safetensors.torch import save_file

            sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            # tied weights share storage: keep one name (safetensors refuses shared tensors)
            seen: dict[int, str] = {}
            for k in list(sd):
                ptr = model.state_dict()[k].data_ptr()
                if ptr in seen:
                    del sd[k]
                else:
                    seen[ptr] = k
            save_file(sd, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    _fsync_dir_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. after an unrecoverable OOM): swap atomically
        trash = out / f".old-checkpoint-{step}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if save_total_limit:
        for _, p in list_checkpoints(out)[:-save_total_limit]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, *, model, is_peft: bool, optimizer, scheduler, scaler) -> dict:
    """Restore weights, optimizer, scheduler, scaler and RNG from ``path``; returns the trainer state."""
    p = Path(path)
    if is_peft:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        sd = load_file(str(p / "adapter_model.safetensors"))
        res = set_peft_model_state_dict(model, sd)
        bad = [k for k in getattr(res, "unexpected_keys", []) if "lora" in k]
        if bad:
            raise ValueError(f"{p}: adapter keys do not match the model: {bad[:3]}")
    else:
        from safetensors.torch import load_file

        sd = load_file(str(p / "model.safetensors"))
        missing, unexpected = model.load_state_dict(sd, strict=False)
        tied = {k for k in missing if "lm_head" in k or "embed" in k}
        if unexpected or set(missing) - tied:
            raise ValueError(f"{p}: weights do not match the model (missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]})")
    optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(p / "scheduler.pt", weights_only=False))
    if scaler is not None and (p / "scaler.pt").exists():
        scaler.load_state_dict(torch.load(p / "scaler.pt", weights_only=False))
    _set_rng_state(torch.load(p / "rng.pt", weights_only=False))
    return json.loads((p / "trainer_state.json").read_text())


__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints"]
