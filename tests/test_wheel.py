"""A wheel install (not editable) works from any directory: the bundled configs, the tiny model/tokenizer/dataset and
the train configs ship inside the package and ``tune``'s emitted YAML names them so that ``train`` finds them.

Builds the wheel from a copy of the sources (the checkout stays clean), installs it with ``--no-deps`` into a fresh
venv that sees the system site-packages (torch & co. are not downloaded), then runs the CLI from an empty directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(args: list, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OOMDOCTOR_MODELS_DIR")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_wheel_install_runs_from_any_directory(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("oomdoctor", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("oomdoctor-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    py = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel], cwd=tmp_path)

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    where = _run([py, "-c", "import oomdoctor.resources as r; print(r.package_dir()); print(r.configs_dir())"], cwd)
    pkg, configs = where.stdout.split()
    assert Path(pkg).is_relative_to(env_dir) and Path(configs) == Path(pkg) / "configs"

    out = _run([py, "-m", "oomdoctor", "diagnose", "bundled:tiny/model/config.json", "--gpu-mem", "1GB"], cwd)
    assert "fit" in out.stdout
    _run([py, "-m", "oomdoctor", "diagnose", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB"], cwd)  # registry
    _run(
        [
            py,
            "-m",
            "oomdoctor",
            "tune",
            "bundled:tiny/model/config.json",
            "--gpu-mem",
            "1GB",
            "--seq-len",
            "64",
            "--global-batch",
            "8",
            "--output",
            "x.yaml",
        ],
        cwd,
    )
    text = (cwd / "x.yaml").read_text()
    assert "bundled:tiny/train.jsonl" in text and "bundled:tiny/tokenizer" in text
    _run([py, "-m", "oomdoctor", "train", "x.yaml", "--max-steps", "1"], cwd)  # tokenizer + dataset really load
    _run([py, "-m", "oomdoctor", "train", "bundled:configs/train/tiny-cpu.yaml", "--dry-run", "--gpu-mem", "1GB"], cwd)
