#!/usr/bin/env python
"""Per-rank FSDP2 simulation of Llama-2-7B (fake process group + fake tensors): peak and wall time per world size.

    python benchmarks/simulate_fsdp.py            # N = 8, (3, 4)-block extrapolation and the full 32-block replay
    python benchmarks/simulate_fsdp.py --gpus 1 2 4 8 16 --no-full

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8])
    ap.add_argument("--no-full", action="store_true", help="skip the full-depth (32-block) replay")
    args = ap.parse_args()

    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan import Plan

    spec = load_spec(MODEL)
    print(f"{MODEL}: full FT, bf16-mixed, GC, micro 1 x 2048, foreach AdamW, FSDP2 per rank")
    print(f"{'N':>3} {'depth':>14} {'peak GB':>8} {'phase':>15} {'params':>7} {'grads':>7} {'optim':>7} "
          f"{'acts':>6} {'temps':>6} {'s':>6} {'research':>9}")
    for n in args.gpus:
        plan = Plan(method="full", precision="bf16-mixed", gradient_checkpointing=True, micro_batch=1,
                    seq_len=2048, optimizer="adamw", optimizer_impl="foreach", world_size=n, strategy="fsdp")
        for depth in ("auto",) if args.no_full else ("auto", "full"):
            t = time.perf_counter()
            r = simulate_plan(spec, plan, layers=depth)
            s = time.perf_counter() - t
            b = r.breakdown
            label = "x".join(map(str, r.layers_simulated)) + (" extrap" if r.extrapolated else " blocks")
            ref = RESEARCH_GB.get(n)
            print(f"{n:>3} {label:>14} {b.peak_allocated / 1e9:8.3f} {b.peak_phase:>15} "
                  f"{(b.parameters + b.master_weights) / 1e9:7.3f} {b.gradients / 1e9:7.3f} "
                  f"{b.optimizer_states / 1e9:7.3f} {b.activations / 1e9:6.3f} {b.temporaries / 1e9:6.3f} "
                  f"{s:6.1f} {'' if ref is None else f'{ref:9.3f}'}", flush=True)


if __name__ == "__main__":
    main()
