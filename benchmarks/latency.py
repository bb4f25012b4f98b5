#!/usr/bin/env python3
"""Benchmark: latencies the tests used to assert (timed assertions belong here, not in tests on a shared machine).

Prints one row per case: median wall time of N runs, the goal, and whether the median meets it.

- ``oomdoctor --help`` in a fresh interpreter (goal: instant; heavy imports are lazy).
- The analytic estimate of 192 plans of a 70B Llama (goal: < 1 s in total, ~0.25 ms per plan).
- ``tune`` of Llama-2-7B on 8 GPUs, every technique stack climbing the strategy ladder, no verification (goal:
  < 3 s per decision, issue 13).
- ``load_spec`` of an unknown id when nothing listens at the hub endpoint (goal: one refused connection, not
  huggingface_hub's retries of about 20 s).

Usage: python benchmarks/latency.py [--runs 3] [--quick: one run each]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HELP = "from oomdoctor.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"

ANALYTIC = (
    "import itertools, time\n"
    "from oomdoctor.model.architectures import build_spec\n"
    "from oomdoctor.plan import Plan, validate\n"
    "from oomdoctor.memory.analytic import estimate_analytic\n"
    "s = build_spec(dict(model_type='llama', hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,"
    " num_key_value_heads=8, intermediate_size=28672, vocab_size=32000), '70b')\n"
    "plans = [validate(Plan(method=m, precision=p, optimizer=o, gradient_checkpointing=g, micro_batch=b))"
    " for m, p, o, g, b in itertools.product(('full','lora','qlora'), ('bf16-mixed','bf16'),"
    " ('adamw','adamw-8bit','paged-adamw-8bit','adafactor'), (False, True), (1, 2, 4, 8))]\n"
    "t = time.perf_counter()\n"
    "for p in plans: estimate_analytic(s, p)\n"
    "print(time.perf_counter() - t)\n"
)

TUNE_MULTI = (
    "import time\n"
    "from oomdoctor.tune.tuner import tune\n"
    "t = time.perf_counter()\n"
    "tune('meta-llama/Llama-2-7b-hf', gpu_mem=24 * 10**9, pins={'world_size': 8}, gpu=None, verify_mode='none')\n"
    "print(time.perf_counter() - t)\n"
)

HUB = "from oomdoctor.model.load import load_spec\ntry:\n    load_spec('org/some-7b')\nexcept Exception as e:\n    print(e)\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wall(code: str, env: dict[str, str]) -> float:
    """Wall time of ``python -c code`` (imports included)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120)
    return time.perf_counter() - t0


def _inner(code: str, env: dict[str, str]) -> float:
    """The time the snippet itself prints (the measured section only)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120)
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one run of each case (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    here = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this checkout's oomdoctor
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": here}
    hub_env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "OOMDOCTOR_OFFLINE")}
    hub_env["PYTHONPATH"] = here
    hub_env["HF_ENDPOINT"] = f"http://127.0.0.1:{_free_port()}"
    cases = [
        ("oomdoctor --help, fresh process", lambda: _wall(HELP, base), 1.5),
        ("analytic estimate, 192 plans of a 70B", lambda: _inner(ANALYTIC, base), 1.0),
        ("tune Llama-2-7B on 8 GPUs (strategy ladder)", lambda: _inner(TUNE_MULTI, base), 3.0),
        ("unknown id, hub unreachable, fresh process", lambda: _wall(HUB, hub_env), 15.0),
    ]
    print(f"{'case':<46} {'median s':>9} {'goal s':>7}  verdict")
    for name, fn, goal in cases:
        med = statistics.median(fn() for _ in range(args.runs))
        print(f"{name:<46} {med:>9.3f} {goal:>7.1f}  {'PASS' if med <= goal else 'MISS'}")


if __name__ == "__main__":
    main()
