"""Helpers shared by the tests/test_train_*.py files (not a test module)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_YAML = ROOT / "configs" / "train" / "tiny-cpu.yaml"


def tiny_cfg(out_dir, **kw):
    """The bundled tiny-cpu config, short (3 steps, micro 4 x 2), writing into ``out_dir``."""
    from oomdoctor.train.config import load_train_config

    cfg = load_train_config(TINY_YAML)
    base = dict(max_steps=3, save_steps=0, warmup_steps=0, micro_batch_size=4, gradient_accumulation_steps=2,
                logging_steps=1, output_dir=str(out_dir))
    base.update(kw)
    return replace(cfg, **base)


def write_yaml(path, cfg) -> Path:
    from oomdoctor.train.config import render_yaml

    p = Path(path)
    p.write_text(render_yaml(cfg))
    return p


def cli(*args, env_extra: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "oomdoctor", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def load_weights(ckpt_dir) -> dict:
    from safetensors.torch import load_file

    d = Path(ckpt_dir)
    f = d / "model.safetensors"
    if not f.exists():
        f = d / "adapter_model.safetensors"
    return load_file(str(f))


def max_abs_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
