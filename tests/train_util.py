"""Helpers shared by the tests/test_train_*.py files and the CLI tests (not a test module)."""

from __future__ import annotations

import json
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
    base = dict(
        max_steps=3,
        save_steps=0,
        warmup_steps=0,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=1,
        output_dir=str(out_dir),
    )
    base.update(kw)
    return replace(cfg, **base)


def write_yaml(path, cfg) -> Path:
    from oomdoctor.train.config import render_yaml

    p = Path(path)
    p.write_text(render_yaml(cfg))
    return p


def cli(*args, env_extra: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "oomdoctor", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def run_main(args, capsys) -> tuple[int, str, str]:
    """``oomdoctor ARGS`` in this process (``oomdoctor.cli.main``): (exit code, stdout, stderr)."""
    from oomdoctor.cli import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


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


def scaleout_cfg(tmp_path, name: str, **kw):
    """The tiny run the scale-out tests share: 3 steps of micro 8 x 2, packed rows (every rank sees full batches)."""
    base = tiny_cfg(
        tmp_path / name,
        max_steps=3,
        micro_batch_size=8,
        gradient_accumulation_steps=2,
        dataset=replace(tiny_cfg(tmp_path).dataset, packing=True, packing_strategy="wrapped"),
    )
    return replace(base, **kw)


def run_json(*args, env_extra=None, timeout: int = 400) -> tuple[dict, str]:
    """``oomdoctor train ARGS --json`` that must succeed without a traceback: (its JSON summary, its stderr)."""
    p = cli("train", *args, "--json", env_extra=env_extra, timeout=timeout)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return json.loads(p.stdout), p.stderr
