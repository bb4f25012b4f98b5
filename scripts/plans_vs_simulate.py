"""Analytic vs simulate over a grid of plans on one model: device peak and, with offloaded activations, host bytes
(the README's long-context, offloading, LLM.int8() and eager-attention figures).

    python scripts/plans_vs_simulate.py --grid long-context [--model meta-llama/Llama-3.2-1B@2] [--seq-len 16384]
    python scripts/plans_vs_simulate.py --grid offload      [--model meta-llama/Llama-3.2-1B@4] [--seq-len 4096]
    python scripts/plans_vs_simulate.py --grid int8         [--model meta-llama/Llama-3.2-1B@4] [--seq-len 4096]
    python scripts/plans_vs_simulate.py --grid eager        [--model microsoft/phi-2@2] [--seq-len 4096]
    python scripts/plans_vs_simulate.py --grid tests

``MODEL@N``: a bundled model (or a model type) cut to N blocks, every block replayed. Grids: ``long-context`` —
the chunked loss + gradient checkpointing, LoRA (bf16, bf16-mixed, bf16 adapters, dropout, fp32), QLoRA and full
fine-tuning, on the device and offloaded (16 plans); ``offload`` — activations offloaded with and without
checkpointing, standard and chunked loss (20 plans); ``int8`` — LLM.int8() QLoRA, bf16 and bf16-mixed, with and
without checkpointing, chunked loss and offloading (16 plans); ``eager`` — eager attention, LoRA/QLoRA/full, with
and without checkpointing (8 plans); ``tests`` — the grid ``tests/test_simulate_vs_analytic.py`` holds within 5 %
(small Llama and Phi-3 shapes, its own models and plans: ``--model``/``--seq-len`` do not apply). Takes minutes (Llama-3.1-8B@2 at 16k: ~10 min).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

GRIDS = {
    "long-context": [
        dict(loss="chunked", gradient_checkpointing=True, offload_activations=off, **kw)
        for kw in (
            dict(method="lora", precision="bf16"),
            dict(method="lora", precision="bf16-mixed"),
            dict(method="qlora", precision="bf16-mixed"),
            dict(method="qlora", precision="bf16"),
            dict(method="lora", precision="bf16", adapter_dtype="bf16"),
            dict(method="full", precision="bf16"),
            dict(method="lora", precision="bf16", lora_dropout=0.05),
            dict(method="lora", precision="fp32"),
        )
        for off in (False, True)
    ],
    "offload": [
        dict(offload_activations=True, gradient_checkpointing=gc, loss=loss, **kw)
        for gc in (True, False)
        for kw in (
            dict(method="lora", precision="bf16"),
            dict(method="lora", precision="bf16-mixed"),
            dict(method="qlora", precision="bf16-mixed"),
            dict(method="full", precision="bf16"),
            dict(method="full", precision="bf16-mixed"),
        )
        for loss in ("standard", "chunked")
    ],
    "int8": [
        dict(method="qlora", quant="int8", precision=precision, gradient_checkpointing=gc, **extra)
        for precision in ("bf16", "bf16-mixed")
        for gc in (True, False)
        for extra in (
            dict(),
            dict(loss="chunked"),
            dict(offload_activations=True),
            dict(loss="chunked", offload_activations=True),
        )
    ],
    "eager": [
        dict(attn="eager", gradient_checkpointing=gc, **kw)
        for kw in (
            dict(method="lora", precision="bf16"),
            dict(method="qlora", precision="bf16-mixed"),
            dict(method="full", precision="bf16"),
            dict(method="full", precision="fp32"),
        )
        for gc in (False, True)
    ],
}
DEFAULTS = {
    "long-context": ("meta-llama/Llama-3.2-1B@2", 16384),
    "offload": ("meta-llama/Llama-3.2-1B@4", 4096),
    "int8": ("meta-llama/Llama-3.2-1B@4", 4096),
    "eager": ("microsoft/phi-2@2", 4096),
}


def _label(kw: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items() if v not in (False, "standard"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=sorted(GRIDS) + ["tests"], required=True)
    ap.add_argument("--model")
    ap.add_argument("--seq-len", type=int)
    args = ap.parse_args()

    from mechanisms_vs_simulate import spec_of

    from oomdoctor.engines import estimate
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.plan import Plan, validate

    if args.grid == "tests":
        _test_grid()
        return
    model = args.model or DEFAULTS[args.grid][0]
    seq_len = args.seq_len or DEFAULTS[args.grid][1]
    spec = spec_of(model)
    print(f"{model} at {seq_len} tokens")
    print(f"{'plan':96} {'analytic':>9} {'simulate':>9} {'error':>8} {'host a.':>8} {'host s.':>8} {'error':>8}")
    for kw in GRIDS[args.grid]:
        plan = validate(Plan(seq_len=seq_len, **kw))
        a = estimate(spec, plan, "analytic")
        s = simulate_plan(spec, plan, layers="full").breakdown
        row = (
            f"{_label(kw):96} {a.peak_allocated / 2**30:9.3f} {s.peak_allocated / 2**30:9.3f} "
            f"{100 * (a.peak_allocated - s.peak_allocated) / s.peak_allocated:+7.2f}%"
        )
        if plan.offload_activations:
            row += (
                f" {a.cpu_offloaded / 2**30:8.3f} {s.cpu_offloaded / 2**30:8.3f} "
                f"{100 * (a.cpu_offloaded - s.cpu_offloaded) / s.cpu_offloaded:+7.2f}%"
            )
        print(row, flush=True)


def _test_grid() -> None:
    """Each cell of the test suite's analytic-vs-simulate grid, as the test computes it (in MiB)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_simulate_vs_analytic as t

    from oomdoctor.engines import estimate
    from oomdoctor.model.load import spec_from_config
    from oomdoctor.plan import validate

    print(f"{'model':6} {'plan':80} {'analytic':>9} {'simulate':>9} {'error':>8}")
    for model, plan in t.GRID:
        plan = validate(plan)
        spec = spec_from_config(t.MODELS[model], name=model)
        a, s = estimate(spec, plan, "analytic").peak_allocated, estimate(spec, plan, "simulate").peak_allocated
        print(f"{model:6} {t._id(plan):80} {a / 2**20:9.1f} {s / 2**20:9.1f} {100 * (a - s) / s:+7.2f}%", flush=True)


if __name__ == "__main__":
    main()
