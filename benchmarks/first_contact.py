#!/usr/bin/env python3
"""Benchmark: a new user's first commands, each timed against a yardstick measured in the same run (issue 28).

Each command runs in a fresh interpreter (imports included) with an empty measurement cache (``OOMDOCTOR_CACHE``),
offline (``HF_HUB_OFFLINE=1``), ``N`` times, interleaved with its yardstick so that both see the same load; the table
prints the medians, their ratio and the goal:

* ``oomdoctor tune meta-llama/Llama-2-7b-hf --gpu-mem 24GB --seq-len 1024 --global-batch 32``, verification
  included (without a GPU: the simulated replay of the chosen plan), against ``python -c "import torch,
  transformers"``: goal <= 1.5x;
* ``oomdoctor models`` against ``oomdoctor --help``: goal <= 3x.

The row "replay's imports alone" is the floor under the tune row: the modules a replay of the step needs (torch,
transformers' Llama, peft, bitsandbytes under oomdoctor's lazy ``torch.compile``, fake tensors), imported and
nothing run, against the same yardstick and goal.

Bytecode is written and reused (``PYTHONDONTWRITEBYTECODE`` is dropped, as an installed package has its ``.pyc``
files) and one untimed run of each command comes first (``--quick``: no warm-up, one run each and no floor row: a
smoke run, the numbers are indicative only).

Usage: python benchmarks/first_contact.py [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    """A command measured against a yardstick."""

    name: str
    command: list[str]
    yardstick_name: str
    yardstick: list[str]
    goal: float
    """Most the command may take, as a multiple of the yardstick."""
    in_quick: bool = True
    """Whether ``--quick`` (the test suite's smoke run) runs it."""


#: What a replay of Llama's training step imports before it runs anything.
REPLAY_IMPORTS = (
    "from oomdoctor.imports import cheap_imports; cheap_imports(); "
    "import torch, transformers.models.llama.modeling_llama, peft, bitsandbytes; "
    "from torch._subclasses.fake_tensor import FakeTensorMode"
)


def _oomdoctor(*args: str) -> list[str]:
    return [sys.executable, "-m", "oomdoctor", *args]


def cases(out_dir: str) -> list[Case]:
    import_torch = [sys.executable, "-c", "import torch, transformers"]
    return [
        Case(
            "tune 7B / 24 GB, verified (simulate)",
            _oomdoctor(
                "tune",
                "meta-llama/Llama-2-7b-hf",
                "--gpu-mem",
                "24GB",
                "--seq-len",
                "1024",
                "--global-batch",
                "32",
                "--output",
                os.path.join(out_dir, "plan.yaml"),
                "--force",
            ),
            "import torch, transformers",
            import_torch,
            1.5,
        ),
        Case(
            "replay's imports alone (the floor)",
            [sys.executable, "-c", REPLAY_IMPORTS],
            "import torch, transformers",
            import_torch,
            1.5,
            in_quick=False,
        ),
        Case("models", _oomdoctor("models"), "oomdoctor --help", _oomdoctor("--help"), 3.0),
    ]


def wall(command: list[str], env: dict[str, str]) -> float:
    """Seconds of one fresh-process run of ``command`` (an empty measurement cache each time); it must succeed."""
    with tempfile.TemporaryDirectory(prefix="oomdoctor-bench-cache-") as cache:
        t0 = time.perf_counter()
        proc = subprocess.run(
            command, capture_output=True, text=True, env={**env, "OOMDOCTOR_CACHE": cache}, timeout=1800
        )
        dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each command and yardstick")
    ap.add_argument("--quick", action="store_true", help="one run each, no warm-up (smoke run)")
    a = ap.parse_args()
    runs = 1 if a.quick else a.runs
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    rows = []
    with tempfile.TemporaryDirectory(prefix="oomdoctor-bench-") as out:
        for case in cases(out):
            if a.quick and not case.in_quick:
                continue
            if not a.quick:
                wall(case.command, env)
                wall(case.yardstick, env)
            cmd, yard = [], []
            for _ in range(runs):  # interleaved: both see the same load
                yard.append(wall(case.yardstick, env))
                cmd.append(wall(case.command, env))
            rows.append((case, statistics.median(cmd), statistics.median(yard)))
    print(f"{'command':<38} {'median s':>9}  {'yardstick':<26} {'median s':>9} {'ratio':>6} {'goal':>6}  verdict")
    for case, c, y in rows:
        ratio = c / y
        print(
            f"{case.name:<38} {c:9.2f}  {case.yardstick_name:<26} {y:9.2f} {ratio:5.2f}x {case.goal:5.1f}x  "
            f"{'PASS' if ratio <= case.goal else 'MISS'}"
        )
    print(f"\n{runs} run(s) each, fresh processes, medians; machine load {os.getloadavg()[0]:.1f} (1-minute average)")


if __name__ == "__main__":
    main()
