#!/usr/bin/env python
"""Batch-size finders on the same memory-capped device: trials, chosen micro-batch, exact effective batch.

Compared (issue 4, item 5):

1. **oomdoctor** — predict the largest micro-batch with the memory model (bisection over ``estimate(...)``, no
   device work), verify it with one real trial; when that trial fits, calibrate the model by the measured peak and
   try the largest size the calibrated model allows once (refine); when it fails, step down (calibrated by the
   overshoot) — ``oomdoctor.tune.batch_search.verify_and_refine``, the routine ``tune`` uses;
   the micro-batch for ``--global-batch`` is then the largest divisor <= the verified maximum (monotone memory:
   any smaller micro-batch fits too), with ``gradient_accumulation_steps = G / micro``.
2. **Lightning** ``scale_batch_size(mode="binsearch")`` — re-implemented faithfully (Lightning is not installed) from
   ``src/lightning/pytorch/tuner/batch_size_scaling.py::_run_binary_scaling`` (Lightning 2.0-2.4): start at
   ``init_val=2``, double after every success until the first OOM, then bisect between the last success and the
   first failure until ``high - low <= 1``; every trial runs ``steps_per_trial=3`` training steps; ``max_trials=25``.
   (Newer releases add ``margin=0.05``, which shrinks the result by a further 5%; not applied here.)
3. **accelerate** — the real ``accelerate.utils.find_executable_batch_size`` (installed), ``starting_batch_size=128``:
   runs the function, and on an OOM exception (``should_reduce_batch_size``) multiplies the batch size by 0.9.
   Each call of the wrapped function runs ``--steps`` training steps.

The device: the CPU, with live tensor bytes capped by ``oomdoctor.execute.tracking.LiveBytes`` (``cap_bytes``), which raises
``torch.OutOfMemoryError`` with the CUDA allocator's message past the cap — what accelerate's and Lightning's OOM
detection match. A trial = ``run_steps`` of ``oomdoctor.engines.probe`` (the same step the GPU probe runs: the model as
``oomdoctor train`` builds it, a fresh optimizer, full forward/backward/optimizer steps on ``micro x seq_len`` random
tokens). The **true maximum** is found exhaustively: every micro-batch from 1 up to the first failure is run, and the
three sizes after it are checked to fail too (monotonicity).

Goal (oomdoctor, per case): at most :data:`GOAL_TRIALS` trials, a micro-batch of at least :data:`GOAL_SHARE` of the
true maximum, and the effective batch kept exactly (micro x accumulation = G).

Usage: ``python benchmarks/batch_finder.py [--engine analytic|simulate] [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import Plan
from oomdoctor.plan.batch import divisors, max_fitting
from oomdoctor.units import format_bytes

VERBOSE = bool(os.environ.get("BENCH_VERBOSE"))
#: Most device trials oomdoctor may run per case (one verification, one refinement).
GOAL_TRIALS = 2
#: Least share of the true maximum micro-batch oomdoctor must choose.
GOAL_SHARE = 0.95

MODELS = {
    # 2 layers, hidden 64: the test-suite shape
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_cache": False,
    },
    # 4 layers, hidden 128, a 4k vocabulary (logits matter, as in real LLMs)
    "small": {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_cache": False,
    },
}


@dataclass
class Device:
    """The capped CPU device: counts trials and steps of whichever finder uses it."""

    loaded: object
    plan: Plan
    cap: int
    steps: int
    trials: int = 0
    steps_run: int = 0
    log: list = field(default_factory=list)

    def run(self, micro: int, steps: int | None = None) -> tuple[bool, int | None, str | None]:
        from oomdoctor.engines.probe import run_steps

        n = steps or self.steps
        self.trials += 1
        if VERBOSE:
            print(f"    trial micro={micro} steps={n}", file=sys.stderr, flush=True)
        outcome, done, peak, msg = run_steps(
            self.loaded, self.plan.with_(micro_batch=micro), device="cpu", steps=n, cap_bytes=self.cap
        )
        self.steps_run += done + (1 if outcome == "oom" else 0)  # the failing step counts as attempted
        if outcome == "error":
            raise RuntimeError(f"trial at micro-batch {micro} failed: {msg}")
        self.log.append((micro, outcome, peak))
        return outcome == "fits", peak, msg

    def reset(self) -> None:
        self.trials = self.steps_run = 0
        self.log = []


# ---------------------------------------------------------------------------------------------- finders


def true_max(dev: Device, limit: int = 512) -> int:
    b = 0
    while b < limit:
        ok, _, _ = dev.run(b + 1)
        if not ok:
            break
        b += 1
    for extra in (2, 3, 4):  # monotonicity check past the first failure
        ok, _, _ = dev.run(b + extra)
        if ok:
            raise AssertionError(f"memory not monotone: {b + 1} fails but {b + extra} fits")
    return b


def oomdoctor_finder(dev: Device, spec, engine: str, margin: float, limit: int = 1024) -> tuple[int, int]:
    """Predict with the memory model (bisection, no device work), verify once, refine once with the measured peak
    (``oomdoctor.tune.batch_search.verify_and_refine``, the same routine ``tune`` runs). Returns (verified max,
    evaluations)."""
    from oomdoctor.engines import estimate
    from oomdoctor.tune.batch_search import verify_and_refine

    budget = int(dev.cap * (1 - margin))
    cache: dict[int, int] = {}

    def pred(b: int) -> int:
        if b not in cache:
            # the capped CPU device counts tensor bytes: compare the model's peak_allocated (no CUDA context)
            cache[b] = estimate(spec, dev.plan.with_(micro_batch=b, grad_accum=1), engine).peak_allocated
        return cache[b]

    start = max(max_fitting(lambda m: pred(m) <= budget, limit), 1)
    best, _ = verify_and_refine(start, range(1, limit + 1), pred, lambda b: dev.run(b)[:2], budget, dev.cap)
    return best, len(cache)


def lightning_binsearch(
    dev: Device, init_val: int = 2, max_trials: int = 25, steps_per_trial: int = 3, max_val: int = 8192
) -> int:
    """Lightning's ``_run_binary_scaling`` (batch_size_scaling.py, Lightning 2.0-2.4), statement by statement."""
    new_size = init_val
    low, high, count = 1, None, 0
    while True:
        ok, _, _ = dev.run(new_size, steps_per_trial)
        if ok:
            count += 1
            if count > max_trials:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                midval = (high + low) // 2
                changed = midval != new_size
                new_size = midval
            else:
                target = min(int(new_size * 2.0), max_val)
                changed = target != new_size
                new_size = target
            if not changed:
                break
        else:  # is_oom_error(exception)
            high = new_size
            midval = (high + low) // 2
            new_size = midval
            if high - low <= 1:
                break
    return new_size


def accelerate_finder(dev: Device, start: int = 128) -> int:
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        ok, _, msg = dev.run(batch_size)
        if not ok:
            raise torch.OutOfMemoryError(msg)  # what a real CUDA step raises; accelerate matches " out of memory."
        return batch_size

    try:
        return train()
    except RuntimeError as exc:  # "No executable batch size found, reached zero."
        print(f"  accelerate: {exc}", file=sys.stderr)
        return 0


# ---------------------------------------------------------------------------------------------- driver


def exact_for(micro: int, g: int) -> bool:
    return micro >= 1 and g % micro == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engine",
        default=None,
        help="memory model for oomdoctor: analytic | simulate (default; analytic with --quick)",
    )
    ap.add_argument("--margin", type=float, default=0.02, help="oomdoctor safety margin (fraction of the cap)")
    ap.add_argument("--global-batch", type=int, default=64, help="effective batch to keep exact")
    ap.add_argument("--steps", type=int, default=2, help="training steps per oomdoctor / accelerate trial")
    ap.add_argument("--quick", action="store_true", help="one case, analytic engine unless given (a smoke run)")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: tiny ops do not gain from threads, and a busy machine stalls them)",
    )
    args = ap.parse_args(argv)
    args.engine = args.engine or ("analytic" if args.quick else "simulate")
    torch.set_num_threads(args.threads)

    import transformers

    from oomdoctor.engines.probe import build_for_probe

    transformers.utils.logging.set_verbosity_error()
    cases = [
        # (model, method, precision, seq_len, target true max: the cap is set from the model's own estimate)
        ("tiny", "full", "fp32", 128, 6),
        ("tiny", "full", "fp32", 128, 24),
        ("tiny", "full", "fp32", 256, 12),
        ("tiny", "lora", "fp32", 256, 40),
        ("small", "full", "fp32", 128, 10),
        ("small", "full", "fp32", 256, 20),
        ("small", "lora", "fp32", 128, 48),
        ("small", "full", "fp32", 64, 70),
    ]
    if args.quick:
        cases = cases[:1]
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="oomdoctor-bench-"))
    for name, method, precision, seq, target in cases:
        cfg_path = tmp / f"{name}.json"
        cfg_path.write_text(json.dumps(MODELS[name]))
        spec = spec_from_config(MODELS[name], name=name)
        plan = Plan(method=method, precision=precision, optimizer="adamw", seq_len=seq, micro_batch=1, lora_dropout=0.0)
        torch.manual_seed(0)
        loaded = build_for_probe(str(cfg_path), plan, "cpu")
        # cap: halfway between the measured peaks at target and target+1 (measured once, not counted)
        probe_dev = Device(loaded, plan, cap=10**12, steps=args.steps)
        _, p_t, _ = probe_dev.run(target)
        _, p_t1, _ = probe_dev.run(target + 1)
        cap = (p_t + p_t1) // 2
        dev = Device(loaded, plan, cap=cap, steps=args.steps)
        t0 = time.perf_counter()
        tmax = true_max(dev)
        t_true = time.perf_counter() - t0
        row = {
            "model": name,
            "method": method,
            "seq_len": seq,
            "cap_bytes": cap,
            "true_max": tmax,
            "true_max_trials": dev.trials,
            "true_max_s": round(t_true, 1),
        }
        g = args.global_batch
        best_div = max(d for d in divisors(g) if d <= tmax) if tmax else 0
        row["best_exact_micro"] = best_div
        for label, fn in (
            ("oomdoctor", lambda d, spec=spec: oomdoctor_finder(d, spec, args.engine, args.margin)),
            ("lightning", lambda d: (lightning_binsearch(d), None)),
            ("accelerate", lambda d: (accelerate_finder(d), None)),
        ):
            dev.reset()
            t0 = time.perf_counter()
            chosen, evals = fn(dev)
            dt = time.perf_counter() - t0
            micro_g = max(d for d in divisors(g) if d <= chosen) if label == "oomdoctor" and chosen else chosen
            # every chosen size must really fit (Lightning's result is not always re-checked by Lightning)
            fits_check = Device(loaded, plan, cap=cap, steps=args.steps).run(chosen)[0] if chosen else False
            row[label] = {
                "trials": dev.trials,
                "steps": dev.steps_run,
                "chosen": chosen,
                "pct_true_max": round(100.0 * chosen / tmax, 1) if tmax else None,
                "chosen_fits": fits_check,
                "micro_for_global": micro_g,
                "grad_accum": (g // micro_g) if label == "oomdoctor" and micro_g else None,
                "exact_global": exact_for(micro_g, g) if label == "oomdoctor" else exact_for(chosen, g),
                "seconds": round(dt, 2),
                "model_evaluations": evals,
                "log": dev.log,
            }
        rows.append(row)
        o, l_, a = row["oomdoctor"], row["lightning"], row["accelerate"]
        print(
            f"{name:5s} {method:4s} seq {seq:4d} cap {format_bytes(cap):>10s} true max {tmax:3d} | "
            f"oomdoctor {o['trials']} trials -> {o['chosen']} ({o['pct_true_max']}%), {o['micro_for_global']}x"
            f"{o['grad_accum']} | lightning {l_['trials']} -> {l_['chosen']} | accelerate {a['trials']} -> "
            f"{a['chosen']}",
            flush=True,
        )

    print()
    print(_table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


def meets_goal(row: dict) -> bool:
    """oomdoctor's result in ``row`` meets the goal (module docstring)."""
    o = row["oomdoctor"]
    return (
        o["trials"] <= GOAL_TRIALS
        and o["chosen_fits"]
        and row["true_max"] > 0
        and o["chosen"] >= GOAL_SHARE * row["true_max"]
        and o["exact_global"]
    )


def _table(rows: list[dict], args) -> str:
    g = args.global_batch
    out = [
        f"oomdoctor: engine={args.engine}, margin={args.margin:.0%}, {args.steps} steps/trial; Lightning binsearch: "
        f"init 2, 3 steps/trial; accelerate find_executable_batch_size: start 128, {args.steps} steps/trial. "
        f"G = global batch {g}.",
        "",
        "| model | method | seq | cap | true max | oomdoctor trials (steps) | oomdoctor micro (% true) | "
        f"oomdoctor G={g} | Lightning trials (steps) | Lightning micro (% true) | Lightning fits? | Lightning G exact? | "
        "accelerate trials (steps) | accelerate micro (% true) | accelerate G exact? | goal (oomdoctor) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, l_, a = r["oomdoctor"], r["lightning"], r["accelerate"]
        out.append(
            f"| {r['model']} | {r['method']} | {r['seq_len']} | {format_bytes(r['cap_bytes'])} | {r['true_max']} | "
            f"{o['trials']} ({o['steps']}) | {o['chosen']} ({o['pct_true_max']}%) | "
            f"{o['micro_for_global']} x {o['grad_accum']} (best possible {r['best_exact_micro']}) | "
            f"{l_['trials']} ({l_['steps']}) | {l_['chosen']} ({l_['pct_true_max']}%) | "
            f"{'yes' if l_['chosen_fits'] else 'NO (OOM)'} | {'yes' if l_['exact_global'] else 'no'} | "
            f"{a['trials']} ({a['steps']}) | {a['chosen']} ({a['pct_true_max']}%) | "
            f"{'yes' if a['exact_global'] else 'no'} | <= {GOAL_TRIALS} trials, >= {GOAL_SHARE:.0%} of true, G exact | "
            f"{'PASS' if meets_goal(r) else 'MISS'} |"
        )
    n = len(rows)
    avg = lambda k, f: sum(r[k][f] for r in rows) / n  # noqa: E731 - a one-line local helper
    out.append("")
    out.append(
        f"mean trials: oomdoctor {avg('oomdoctor', 'trials'):.2f}, Lightning {avg('lightning', 'trials'):.2f}, "
        f"accelerate {avg('accelerate', 'trials'):.2f}; mean % of true max: oomdoctor "
        f"{avg('oomdoctor', 'pct_true_max'):.1f}%, Lightning {avg('lightning', 'pct_true_max'):.1f}%, accelerate "
        f"{avg('accelerate', 'pct_true_max'):.1f}%; effective batch exact: oomdoctor "
        f"{sum(r['oomdoctor']['exact_global'] for r in rows)}/{n}, Lightning "
        f"{sum(r['lightning']['exact_global'] for r in rows)}/{n}, accelerate "
        f"{sum(r['accelerate']['exact_global'] for r in rows)}/{n}"
    )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
