"""The analytic engine against real CPU training steps: the tables of docs/memory-model.md "Verification".

    python scripts/analytic_vs_cpu.py

Runs every case of ``tests/test_analytic_vs_cpu.py`` (two real steps of a tiny random-init model, live tensor bytes
counted with a ``TorchDispatchMode``; the QLoRA ones on a real bitsandbytes model, with and without peft's k-bit
upcast) and prints the real peak, the analytic one (``device="cpu"``) and the error, as the test asserts them. A
couple of minutes on 2 cores.
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
    bnb_table(cases)


def bnb_table(cases) -> None:
    """Pure-bf16 QLoRA on real bitsandbytes models, with and without peft's k-bit upcast (the test's cases)."""
    import itertools
    import tempfile

    from oomdoctor.memory.analytic import estimate_analytic
    from oomdoctor.model.architectures import build_spec

    print(f"\n| {'QLoRA bf16, real bitsandbytes':48} | {'real peak (B)':>14} | {'analytic (B)':>14} | {'error':>7} |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in cases.BNB_MODELS.items():
            cases.save_random_weights(cfg, f"{tmp}/{name}")
            for quant, gc, up in itertools.product(("nf4", "int8"), (False, True), (True, False)):
                plan = cases.bnb_plan(quant, gc, up)
                real = cases.measure_bnb_cpu_step(cfg, plan, f"{tmp}/{name}")["peak"]
                est = estimate_analytic(build_spec(cfg, name), plan, device="cpu").peak_allocated
                case = f"{name} {quant}{' GC' if gc else ''}{'' if up else ' no-upcast'}"
                print(f"| {case:48} | {real:14,} | {est:14,} | {(est - real) / real:+7.2%} |", flush=True)


if __name__ == "__main__":
    main()
