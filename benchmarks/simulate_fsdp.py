#!/usr/bin/env python
"""Per-rank FSDP2 simulation of Llama-2-7B (fake process group + fake tensors): peak and wall time per world size.

    python benchmarks/simulate_fsdp.py            # N = 8, (3, 4)-block extrapolation and the full 32-block replay
    python benchmarks/simulate_fsdp.py --gpus 1 2 4 8 16 --no-full
    python benchmarks/simulate_fsdp.py --quick    # N = 8, extrapolated only

Goal: each per-rank peak within 1 % of its reference, the research measurement where there is one (N = 8), else the
full-depth replay of the same N (a row without either has no verdict).

Plan: full fine-tuning, bf16-mixed (fp32 shards, bf16 all-gathers, fp32 gradient reduce), gradient checkpointing,
micro-batch 1 x 2048, foreach AdamW. Reference: shared/research/multi-gpu.md §4 measured 16.98 GB per rank for
N = 8 with its own loop (no gradient clipping, no autocast, no accelerate fp32 logits copy, no 512-byte rounding) in
about 14 s. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OOMDOCTOR_OFFLINE", "1")

MODEL = "meta-llama/Llama-2-7b-hf"
RESEARCH_GB = {8: 16.977}
#: Largest relative distance of a peak from its reference.
GOAL = 0.01


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8])
    ap.add_argument("--no-full", action="store_true", help="skip the full-depth (32-block) replay")
    ap.add_argument("--quick", action="store_true", help="N = 8, extrapolated only (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.gpus, args.no_full = [8], True

    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan import Plan

    spec = load_spec(MODEL)
    print(f"{MODEL}: full FT, bf16-mixed, GC, micro 1 x 2048, foreach AdamW, FSDP2 per rank")
    print(
        f"{'N':>3} {'depth':>14} {'peak GB':>8} {'phase':>15} {'params':>7} {'grads':>7} {'optim':>7} "
        f"{'acts':>6} {'temps':>6} {'s':>6} {'reference':>10} {'error':>7} {'goal':>6}  verdict"
    )
    for n in args.gpus:
        plan = Plan(
            method="full",
            precision="bf16-mixed",
            gradient_checkpointing=True,
            micro_batch=1,
            seq_len=2048,
            optimizer="adamw",
            optimizer_impl="foreach",
            world_size=n,
            strategy="fsdp",
        )
        results = []
        for depth in ("auto",) if args.no_full else ("full", "auto"):  # the full replay is the auto rows' reference
            t = time.perf_counter()
            results.append((depth, simulate_plan(spec, plan, layers=depth), time.perf_counter() - t))
        full = next((r.breakdown.peak_allocated / 1e9 for d, r, _ in results if d == "full"), None)
        for depth, r, s in reversed(results):
            b = r.breakdown
            label = "x".join(map(str, r.layers_simulated)) + (" extrap" if r.extrapolated else " blocks")
            peak = b.peak_allocated / 1e9
            ref = RESEARCH_GB.get(n, full if depth == "auto" else None)
            err = None if ref is None else (peak - ref) / ref
            verdict = "-" if err is None else ("PASS" if abs(err) <= GOAL else "MISS")
            print(
                f"{n:>3} {label:>14} {peak:8.3f} {b.peak_phase:>15} "
                f"{(b.parameters + b.master_weights) / 1e9:7.3f} {b.gradients / 1e9:7.3f} "
                f"{b.optimizer_states / 1e9:7.3f} {b.activations / 1e9:6.3f} {b.temporaries / 1e9:6.3f} "
                f"{s:6.1f} {'-' if ref is None else f'{ref:.3f}':>10} {'-' if err is None else f'{err:+.2%}':>7} "
                f"{GOAL:>6.0%}  {verdict}",
                flush=True,
            )


if __name__ == "__main__":
    main()
