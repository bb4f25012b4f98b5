#!/usr/bin/env python3
"""Benchmark: wall time of `oomdoctor diagnose` from a cold process (the goal: full 70B matrix <= 3 s on 2 cores).

Each row runs the real CLI in a fresh interpreter (imports included) and prints the median of N runs.
Usage: python scripts/bench_diagnose.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = [
    ("Llama-2-70B, full matrix, table", ["meta-llama/Llama-2-70b-hf", "--gpu-mem", "80GB"]),
    ("Llama-2-70B, full matrix, --json", ["meta-llama/Llama-2-70b-hf", "--gpu-mem", "24GB", "--json"]),
    ("Llama-2-7B, full matrix, table", ["meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB"]),
    ("Llama-3.1-405B, full matrix", ["meta-llama/Llama-3.1-405B", "--gpu-mem", "80GB"]),
    ("Llama-2-7B, one plan", ["meta-llama/Llama-2-7b-hf", "--method", "lora", "--precision", "bf16-mixed",
                              "--optimizer", "adamw", "--gradient-checkpointing", "--gpu-mem", "24GB"]),
]


def run_once(args: list[str]) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomdoctor", "diagnose", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"})
    dt = time.perf_counter() - t0
    n_plans = 0
    if "--json" in args and proc.returncode == 0:
        n_plans = len(json.loads(proc.stdout)["plans"])
    return dt, proc.returncode, n_plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    print(f"{'case':42} {'median s':>9} {'min s':>7} {'exit':>5} {'plans':>6}")
    for name, args in CASES:
        times, rc, n = [], 0, 0
        for _ in range(a.runs):
            dt, rc, n = run_once(args)
            times.append(dt)
        print(f"{name:42} {statistics.median(times):9.2f} {min(times):7.2f} {rc:5d} {n or '':>6}")


if __name__ == "__main__":
    main()
