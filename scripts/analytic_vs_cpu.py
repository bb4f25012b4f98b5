"""The analytic engine against real CPU training steps: the tables of docs/memory-model.md "Verification".

    python scripts/analytic_vs_cpu.py

Runs every case of ``tests/test_analytic_vs_cpu.py`` (two real steps of a tiny random-init model, live tensor bytes
counted with a ``TorchDispatchMode``) and prints the real peak, the analytic one (``device="cpu"``) and the error, as
the test asserts them. About a minute on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_analytic_vs_cpu as cases

    print(f"| {'case':34} | {'real peak (B)':>14} | {'analytic (B)':>14} | {'error':>7} |")
    for name, cfg, plan in cases.CASES + cases.ARCH_CASES:
        real, est, err, _real_phase, _est_phase = cases.compare(cfg, plan)
        print(f"| {name:34} | {real:14,} | {est:14,} | {err:+7.2%} |", flush=True)


if __name__ == "__main__":
    main()
