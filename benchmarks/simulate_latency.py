#!/usr/bin/env python
"""Benchmark: wall time of the simulated engine per plan, for 1B / 7B / 70B configs (bundled ids, no download).

    python benchmarks/simulate_latency.py              # default models and plans: goal <= 5 s per plan
    python benchmarks/simulate_latency.py --threads 2  # as on a 2-core CI machine
    python benchmarks/simulate_latency.py --compare    # also the analytic engine and its error vs simulate
    python benchmarks/simulate_latency.py --json out.json
    python benchmarks/simulate_latency.py --cold       # each plan in a fresh process, imports included (goal <= 5 s)
    python benchmarks/simulate_latency.py --quick      # smoke run: TinyLlama, two plans

The first plan of a process also pays the imports (torch, transformers, peft, bitsandbytes) and is reported
separately as ``warm-up``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OOMDOCTOR_OFFLINE", "1")

#: Seconds one plan may take (warm process; ``--cold``: a fresh one, imports included).
GOAL_S = 5.0

MODELS = (
    "meta-llama/Llama-3.2-1B",
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Llama-2-70b-hf",
)


def default_plans():
    from oomdoctor.plan import Plan

    return [
        Plan(method="full", seq_len=2048, micro_batch=1),
        Plan(method="full", seq_len=2048, micro_batch=1, gradient_checkpointing=True, optimizer="adamw-8bit"),
        Plan(method="lora", seq_len=2048, micro_batch=2),
        Plan(
            method="qlora",
            quant="nf4",
            seq_len=2048,
            micro_batch=1,
            gradient_checkpointing=True,
            optimizer="paged-adamw-8bit",
        ),
    ]


def grid_plans():
    """The analytic-vs-simulate grid (sizes come from --models): methods, GC, optimizers, precisions, seq lengths."""
    from oomdoctor.plan import Plan

    return [
        Plan(method="full", seq_len=1024),
        Plan(method="full", seq_len=2048, micro_batch=2, gradient_checkpointing=True),
        Plan(method="full", seq_len=1024, optimizer="adamw-8bit"),
        Plan(method="full", seq_len=1024, optimizer="adafactor", precision="bf16"),
        Plan(method="full", seq_len=512, optimizer="sgd", sgd_momentum=0.9, optimizer_impl="fused"),
        Plan(method="full", seq_len=1024, optimizer="lion", attn="eager"),
        Plan(method="full", seq_len=1024, optimizer="paged-adamw", gradient_checkpointing=True),
        Plan(method="lora", seq_len=1024),
        Plan(method="lora", seq_len=4096, gradient_checkpointing=True),
        Plan(method="lora", seq_len=512, micro_batch=4, precision="fp16-mixed", lora_targets=("q_proj", "v_proj")),
        Plan(method="lora", seq_len=2048, attn="eager", lora_r=64),
        Plan(method="qlora", seq_len=2048, gradient_checkpointing=True, optimizer="paged-adamw-8bit"),
        Plan(method="qlora", seq_len=1024),
        Plan(method="qlora", seq_len=1024, double_quant=True, micro_batch=2),
        Plan(method="qlora", quant="int8", seq_len=1024, gradient_checkpointing=True),
    ]


COLD_CHILD = """
import sys, time
t0 = time.perf_counter()
from oomdoctor.imports import cheap_imports
cheap_imports()
from oomdoctor.engines.simulate import simulate_plan
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan, validate
import torch
torch.set_num_threads(int(sys.argv[3]))
plan = validate(Plan(**__import__("json").loads(sys.argv[2])))
spec = load_spec(sys.argv[1])
t1 = time.perf_counter()
simulate_plan(spec, plan)
t2 = time.perf_counter()
print(f"{t1 - t0:.2f} {t2 - t1:.2f}")
"""


def cold(models: list[str], threads: int, plans: list) -> list[dict]:
    """Each default plan in a fresh interpreter: what one ``diagnose --engine simulate`` of one plan costs."""
    import subprocess
    from dataclasses import asdict

    rows = []
    print(f"{'model':40s} {'plan':58s} {'imports':>8s} {'simulate':>9s} {'cold total':>11s} {'goal s':>7s}  verdict")
    for mid in models:
        for plan in plans:
            d = asdict(plan)
            d["lora_targets"] = list(d["lora_targets"])
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", COLD_CHILD, mid, json.dumps(d), str(threads)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
            )
            total = time.perf_counter() - t
            imp, sim = (float(x) for x in out.stdout.split()[-2:])
            rows.append({"model": mid, "plan": plan.label(), "imports_s": imp, "simulate_s": sim, "cold_s": total})
            print(
                f"{mid:40s} {plan.label():58s} {imp:8.2f} {sim:9.2f} {total:11.2f} {GOAL_S:7.1f}  "
                f"{'PASS' if total <= GOAL_S else 'MISS'}",
                flush=True,
            )
    worst = max(r["cold_s"] for r in rows)
    print(f"cold wall time per plan (interpreter start to result): max {worst:.2f} s (goal <= {GOAL_S:g} s)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CI has 2 cores)")
    ap.add_argument("--compare", action="store_true", help="also run the analytic engine and print its error")
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--grid", action="store_true", help="the analytic-vs-simulate grid instead of the timing plans")
    ap.add_argument("--cold", action="store_true", help="each plan in a fresh process (imports included)")
    ap.add_argument("--quick", action="store_true", help="smoke run: TinyLlama, the first two plans")
    args = ap.parse_args(argv)
    plans = default_plans()
    if args.quick:
        args.models, plans = ["TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"], plans[:2]
    if args.cold:
        rows = cold(args.models if args.models != list(MODELS) else ["meta-llama/Llama-2-7b-hf"], args.threads, plans)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0

    from oomdoctor.imports import cheap_imports

    cheap_imports()  # as the CLI does
    import torch

    torch.set_num_threads(args.threads)
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan import validate
    from oomdoctor.units import format_bytes

    t0 = time.perf_counter()
    simulate_plan(load_spec(args.models[0]), validate(default_plans()[0].with_(seq_len=128)))
    print(f"warm-up (imports + first plan): {time.perf_counter() - t0:.1f} s")
    rows = []
    hdr = (
        f"{'model':52s} {'plan':58s} {'params':>8s} {'seconds':>8s} {'goal s':>7s} {'verdict':>7s} "
        f"{'peak_allocated':>15s} {'phase':>14s}"
    )
    if args.compare:
        hdr += f" {'analytic':>12s} {'error':>8s}"
    print(hdr)
    for mid in args.models:
        spec = load_spec(mid)
        for plan in grid_plans() if args.grid else plans:
            plan = validate(plan)
            t = time.perf_counter()
            r = simulate_plan(spec, plan)
            dt = time.perf_counter() - t
            b = r.breakdown
            row = {
                "model": mid,
                "plan": plan.label(),
                "params": spec.num_params,
                "seconds": round(dt, 2),
                "peak_allocated": b.peak_allocated,
                "peak_phase": b.peak_phase,
                "layers_simulated": list(r.layers_simulated),
            }
            verdict = "PASS" if dt <= GOAL_S else "MISS"
            line = (
                f"{mid:52s} {plan.label():58s} {spec.num_params / 1e9:7.2f}B {dt:8.2f} {GOAL_S:7.1f} "
                f"{verdict:>7s} {format_bytes(b.peak_allocated):>15s} {b.peak_phase:>14s}"
            )
            if args.compare:
                from oomdoctor.engines import estimate

                a = estimate(spec, plan, "analytic")
                err = (a.peak_allocated - b.peak_allocated) / b.peak_allocated
                row.update(analytic=a.peak_allocated, error=err)
                line += f" {format_bytes(a.peak_allocated):>12s} {err * 100:+7.2f}%"
            print(line, flush=True)
            rows.append(row)
    if args.compare:
        errs = [abs(r["error"]) for r in rows]
        print(
            f"analytic vs simulate |error| on peak allocated: median {statistics.median(errs) * 100:.2f}%, "
            f"max {max(errs) * 100:.2f}%, within 5%: {sum(e <= 0.05 for e in errs)}/{len(errs)}"
        )
    secs = [r["seconds"] for r in rows]
    print(
        f"simulate time per plan: median {statistics.median(secs):.2f} s, max {max(secs):.2f} s "
        f"({args.threads} threads)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
