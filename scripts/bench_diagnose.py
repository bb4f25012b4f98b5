#!/usr/bin/env python3
"""Benchmark: wall time of `oomdoctor diagnose` from a cold process (the goal: full 70B matrix <= 3 s on 2 cores).

Each row runs the real CLI in a fresh interpreter (imports included) and prints the median of N runs. The Command R7B
rows time a model whose blocks are measured (oomdoctor/engines/blocks.py): with an empty measurement cache
(``OOMDOCTOR_CACHE``, a new directory per run) and with the cache the first run filled; ``measured`` counts the
block measurements (cache entries, each two replays: micro-batch 1 and 2) a cold run made.
Usage: python scripts/bench_diagnose.py [--runs 3]
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

CASES = [
    ("Llama-2-70B, full matrix, table", ["meta-llama/Llama-2-70b-hf", "--gpu-mem", "80GB"]),
    ("Llama-2-70B, full matrix, --json", ["meta-llama/Llama-2-70b-hf", "--gpu-mem", "24GB", "--json"]),
    ("Llama-2-7B, full matrix, table", ["meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB"]),
    ("Llama-3.1-405B, full matrix", ["meta-llama/Llama-3.1-405B", "--gpu-mem", "80GB"]),
    ("Llama-2-7B, one plan", ["meta-llama/Llama-2-7b-hf", "--method", "lora", "--precision", "bf16-mixed",
                              "--optimizer", "adamw", "--gradient-checkpointing", "--gpu-mem", "24GB"]),
    ("Command R7B, full matrix, cold cache", ["CohereLabs/c4ai-command-r7b-12-2024", "--seq-len", "2048"]),
    ("Command R7B, full matrix, warm cache", ["CohereLabs/c4ai-command-r7b-12-2024", "--seq-len", "2048"]),
]
#: The directory the warm rows share (filled by the cold row before them).
WARM = tempfile.mkdtemp(prefix="oomdoctor-bench-cache-")


def run_once(name: str, args: list[str]) -> tuple[float, int, int, int]:
    cache = tempfile.mkdtemp(prefix="oomdoctor-bench-cold-") if "cold cache" in name else WARM
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomdoctor", "diagnose", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", "OOMDOCTOR_CACHE": cache})
    dt = time.perf_counter() - t0
    measured = 0
    if cache != WARM:  # what a cold run measured warms the rows after it
        blocks = os.path.join(cache, "blocks")
        measured = len(os.listdir(blocks)) if os.path.isdir(blocks) else 0
        shutil.copytree(cache, WARM, dirs_exist_ok=True)
    n_plans = 0
    if "--json" in args and proc.returncode == 0:
        n_plans = len(json.loads(proc.stdout)["plans"])
    return dt, proc.returncode, n_plans, measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    print(f"{'case':42} {'median s':>9} {'min s':>7} {'exit':>5} {'plans':>6} {'measured':>9}")
    for name, args in CASES:
        times, rc, n, m = [], 0, 0, 0
        for _ in range(a.runs):
            dt, rc, n, m = run_once(name, args)
            times.append(dt)
        print(f"{name:42} {statistics.median(times):9.2f} {min(times):7.2f} {rc:5d} {n or '':>6} {m or '':>9}")


if __name__ == "__main__":
    main()
