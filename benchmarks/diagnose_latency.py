#!/usr/bin/env python3
"""Benchmark: wall time of `oomdoctor diagnose` from a fresh process, against its goal.

Each row runs the real CLI in a fresh interpreter (imports included) and prints the median of N runs. Goals: a
diagnose the formulas price (any matrix, 405B included) <= 3 s on 2 cores, and so is one of a model whose blocks are
measured (oomdoctor/engines/blocks.py; Command R7B here) once the measurement cache (``OOMDOCTOR_CACHE``) holds them:
an untimed run fills it first. The first, cold, run of every kind of model: benchmarks/cold_diagnose.py.
Usage: python benchmarks/diagnose_latency.py [--runs 3] [--quick: one run, the formula-priced rows only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Most a diagnose may take, seconds on 2 cores.
GOAL_S = 3.0
#: (name, diagnose arguments, whether its blocks are measured: an untimed run fills the cache first; --quick skips it)
CASES = [
    ("Llama-2-70B, full matrix, table", ["meta-llama/Llama-2-70b-hf", "--gpu-mem", "80GB"], False),
    ("Llama-2-70B, full matrix, --json", ["meta-llama/Llama-2-70b-hf", "--gpu-mem", "24GB", "--json"], False),
    ("Llama-2-7B, full matrix, table", ["meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB"], False),
    ("Llama-3.1-405B, full matrix", ["meta-llama/Llama-3.1-405B", "--gpu-mem", "80GB"], False),
    (
        "Llama-2-7B, one plan",
        [
            "meta-llama/Llama-2-7b-hf",
            "--method",
            "lora",
            "--precision",
            "bf16-mixed",
            "--optimizer",
            "adamw",
            "--gradient-checkpointing",
            "--gpu-mem",
            "24GB",
        ],
        False,
    ),
    ("Command R7B, full matrix, warm cache", ["CohereLabs/c4ai-command-r7b-12-2024", "--seq-len", "2048"], True),
]
ROOT = Path(__file__).resolve().parent.parent


def run_once(args: list[str], cache: str) -> tuple[float, int, int]:
    """(seconds, exit code, plans in --json) of one fresh-process diagnose with the measurement cache ``cache``."""
    env = {
        **os.environ,
        "COLUMNS": "200",
        "HF_HUB_OFFLINE": "1",
        "OOMDOCTOR_CACHE": cache,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "oomdoctor", "diagnose", *args], capture_output=True, text=True, env=env
    )
    dt = time.perf_counter() - t0
    n_plans = 0
    if "--json" in args and proc.returncode == 0:
        n_plans = len(json.loads(proc.stdout)["plans"])
    return dt, proc.returncode, n_plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one run of the analytic rows (smoke run)")
    a = ap.parse_args()
    cases = [c for c in CASES if not (a.quick and c[2])]
    runs = 1 if a.quick else a.runs
    print(f"{'case':42} {'median s':>9} {'min s':>7} {'exit':>5} {'plans':>6} {'goal s':>7}  verdict")
    warm = tempfile.mkdtemp(prefix="oomdoctor-bench-cache-")
    for name, args, measured in cases:
        if measured:
            run_once(args, warm)  # untimed: fills the cache
        times, rc, n = [], 0, 0
        for _ in range(runs):
            dt, rc, n = run_once(args, warm)
            times.append(dt)
        med = statistics.median(times)
        verdict = "PASS" if rc == 0 and med <= GOAL_S else "MISS"
        print(f"{name:42} {med:9.2f} {min(times):7.2f} {rc:5d} {n or '':>6} {GOAL_S:7.1f}  {verdict}")
    shutil.rmtree(warm, ignore_errors=True)


if __name__ == "__main__":
    main()
