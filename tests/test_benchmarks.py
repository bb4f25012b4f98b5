"""Benchmarks stay alive: every script in benchmarks/ runs in its quick mode as a real subprocess, exits 0 and prints
its table against its goal (a goal column and a PASS/MISS verdict). The figures themselves are the benchmarks'
business, never asserted here (timings on a shared machine are not test outcomes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_every_benchmark_is_listed():
    assert {p.stem for p in BENCHMARKS} >= {
        "first_contact",
        "latency",
        "train_vs_hf",
        "tune_choices",
        "simulate_fsdp",
        "diagnose_latency",
        "simulate_latency",
        "batch_finder",
    }


@pytest.mark.slow  # each starts processes that import torch and transformers; minutes in all
@pytest.mark.every_case  # every benchmark runs in make test: none rots
@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_benchmark_runs_quick_and_prints_its_goal(script):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OOMDOCTOR_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.lower()
    assert "goal" in out, proc.stdout
    assert "PASS" in proc.stdout or "MISS" in proc.stdout, proc.stdout
    if script.stem == "cold_diagnose":  # a cold cache: Mamba's blocks were measured, not priced by formulas
        mamba = next(r for r in proc.stdout.splitlines() if "tiny:mamba" in r)
        assert int(mamba.split()[-3]) > 0, proc.stdout
