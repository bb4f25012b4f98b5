#!/usr/bin/env python
"""Measure real training-step memory on a CUDA GPU and put both engines' predictions next to it.

    python scripts/validate_gpu.py                       # the full matrix (>= 40 plans, 1B-8B), on a CUDA GPU
    python scripts/validate_gpu.py --limit 5             # the first 5 plans only
    python scripts/validate_gpu.py --dry-run --out /tmp  # the same harness on a tiny model on the CPU (no GPU)

Each plan runs in its own child process (a clean allocator and CUDA context per plan): the child builds a
random-init model of the real shape (no weights needed: memory does not depend on values; QLoRA/int8 layers are real
bitsandbytes layers quantized from random weights), runs two training steps (``oomdoctor.engines.measure.measure_plan``) and
prints ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` / NVML's process usage as one JSON line.
A plan that does not fit is recorded as ``oom`` with the CUDA message.

The parent computes the analytic and simulated predictions, writes ``benchmarks/gpu/<gpu-name>.json`` (raw rows) and
prints a table and the median / max absolute error per engine on peak allocated, reserved and device memory.

Comparison note: the cuBLAS workspace is an allocator block, so a real ``max_memory_allocated`` includes it while
the engines keep it out of ``peak_allocated`` (the tensor-bytes invariant) and add it to ``peak_reserved``; the
allocated comparison therefore uses ``peak_allocated + cublas_workspace``.

``--dry-run`` replaces the GPU by the CPU and the matrix by a few plans of a 2-block model: the child runs the step on
real CPU tensors counted by ``LiveBytes`` and the predictions use CPU semantics (``simulate`` with ``target="cpu"``,
``analytic`` with ``device="cpu"``). It exercises every part of the harness (children, JSON, table) without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OOMDOCTOR_OFFLINE", "1")

#: 1B-8B models (bundled configs).
MODELS = {
    "1b": "meta-llama/Llama-3.2-1B",
    "1.1b": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "3b": "meta-llama/Llama-3.2-3B",
    "7b": "mistralai/Mistral-7B-v0.1",
    "8b": "meta-llama/Llama-3.1-8B",
}

TINY = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def matrix() -> list[tuple[str, dict]]:
    """(model id, plan kwargs) of the GPU matrix: >= 40 plans across 1B-8B; full / LoRA / QLoRA; GC on/off;
    AdamW / 8-bit / paged; seq 512-4096; micro-batch 1-8."""
    rows: list[tuple[str, dict]] = []
    # full fine-tuning: the small models (an 8B full fine-tune needs ~130 GB with AdamW)
    for m in ("1b", "1.1b"):
        rows += [
            (m, dict(method="full", seq_len=512, micro_batch=1)),
            (m, dict(method="full", seq_len=1024, micro_batch=4, gradient_checkpointing=True)),
            (m, dict(method="full", seq_len=2048, micro_batch=2, optimizer="adamw-8bit")),
            (
                m,
                dict(
                    method="full",
                    seq_len=4096,
                    micro_batch=1,
                    gradient_checkpointing=True,
                    optimizer="paged-adamw-8bit",
                ),
            ),
            (m, dict(method="full", seq_len=1024, micro_batch=2, optimizer_impl="fused")),
        ]
    rows += [
        ("3b", dict(method="full", seq_len=512, micro_batch=2, gradient_checkpointing=True, optimizer="adamw-8bit")),
        ("3b", dict(method="full", seq_len=1024, micro_batch=1, precision="bf16", optimizer="adamw")),
    ]
    # LoRA
    for m in ("1b", "3b", "7b", "8b"):
        rows += [
            (m, dict(method="lora", seq_len=512, micro_batch=4)),
            (m, dict(method="lora", seq_len=2048, micro_batch=1, gradient_checkpointing=True)),
            (m, dict(method="lora", seq_len=1024, micro_batch=8, gradient_checkpointing=True, optimizer="adamw-8bit")),
        ]
    rows += [
        ("8b", dict(method="lora", seq_len=4096, micro_batch=2, gradient_checkpointing=True, precision="bf16")),
        ("7b", dict(method="lora", seq_len=1024, micro_batch=2, lora_targets=("q_proj", "v_proj"), lora_r=64)),
    ]
    # QLoRA
    for m in ("1b", "3b", "7b", "8b"):
        rows += [
            (m, dict(method="qlora", quant="nf4", seq_len=1024, micro_batch=2)),
            (
                m,
                dict(
                    method="qlora",
                    quant="nf4",
                    double_quant=True,
                    seq_len=2048,
                    micro_batch=4,
                    gradient_checkpointing=True,
                    optimizer="paged-adamw-8bit",
                ),
            ),
            (
                m,
                dict(
                    method="qlora",
                    quant="nf4",
                    seq_len=4096,
                    micro_batch=1,
                    gradient_checkpointing=True,
                    optimizer="paged-adamw",
                ),
            ),
        ]
    rows += [
        ("8b", dict(method="qlora", quant="nf4", seq_len=512, micro_batch=8, gradient_checkpointing=True)),
        ("7b", dict(method="qlora", quant="int8", seq_len=1024, micro_batch=2, gradient_checkpointing=True)),
        ("1.1b", dict(method="qlora", quant="fp4", seq_len=2048, micro_batch=2, attn="eager")),
    ]
    return [(MODELS[m], kw) for m, kw in rows]


def dry_matrix() -> list[tuple[str, dict]]:
    return [
        ("tiny", dict(method="full", seq_len=64, micro_batch=2)),
        ("tiny", dict(method="lora", seq_len=64, gradient_checkpointing=True)),
        ("tiny", dict(method="qlora", quant="nf4", seq_len=64, lora_dropout=0.0)),
    ]


def _plan(kw: dict):
    from oomdoctor.plan import Plan, validate

    kw = dict(kw)
    if "lora_targets" in kw:
        kw["lora_targets"] = tuple(kw["lora_targets"])
    return validate(Plan(**kw))


def _spec(model: str, dry: bool):
    from oomdoctor.model.load import load_spec, spec_from_config

    return spec_from_config(TINY, name="tiny") if dry else load_spec(model)


# ------------------------------------------------------------------------------------------------ child


def child(payload: str) -> int:
    """Run one plan; print one JSON line (the measurement or the OOM)."""
    job = json.loads(payload)
    dry = job.get("dry", False)
    spec, plan = _spec(job["model"], dry), _plan(job["plan"])
    out: dict
    try:
        if dry:
            from oomdoctor.engines.simulate import real_cpu_run

            r = real_cpu_run(spec, plan, target="cpu")
            out = {
                "max_allocated_bytes": r.peak,
                "max_reserved_bytes": None,
                "nvml_process_used_bytes": None,
                "tracked_peak_bytes": r.peak,
                "phases": r.phase_peaks,
                "peak_phase": r.peak_phase,
                "gpu": {"name": "cpu-dry-run"},
            }
        else:
            from oomdoctor.engines.measure import measure_plan

            m = measure_plan(spec, plan)
            out = m.to_dict()
            out["phases"] = m.breakdown.phases
            out["peak_phase"] = m.breakdown.peak_phase
    except Exception as exc:  # noqa: BLE001 - OOM is a result here, anything else is reported as an error
        import torch

        kind = "oom" if isinstance(exc, torch.OutOfMemoryError) else "error"
        out = {kind: True, "message": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ parent


def predictions(spec, plan, dry: bool) -> dict:
    from oomdoctor.engines.simulate import simulate_plan, simulate_run
    from oomdoctor.memory.analytic import estimate_analytic

    out = {}
    if dry:
        a = estimate_analytic(spec, plan, device="cpu")
        s = simulate_run(spec, plan, target="cpu")
        out["analytic"] = {
            "peak_allocated": a.peak_allocated,
            "cublas_workspace": 0,
            "peak_reserved": None,
            "peak_device": None,
        }
        out["simulate"] = {"peak_allocated": s.peak, "cublas_workspace": 0, "peak_reserved": None, "peak_device": None}
        return out
    from oomdoctor.engines import estimate

    t = time.perf_counter()
    s = simulate_plan(spec, plan).breakdown
    st = time.perf_counter() - t
    a = estimate(spec, plan, "analytic")
    for name, b in (("analytic", a), ("simulate", s)):
        out[name] = {
            "peak_allocated": b.peak_allocated,
            "cublas_workspace": b.cublas_workspace,
            "peak_reserved": b.peak_reserved,
            "peak_device": b.peak_device,
            "peak_phase": b.peak_phase,
            "breakdown": b.to_dict(),
        }
    out["simulate"]["seconds"] = round(st, 2)
    return out


def _err(pred, meas):
    if pred is None or not meas:
        return None
    return (pred - meas) / meas


def run(args) -> int:
    dry = args.dry_run
    if not dry:
        import torch

        if not torch.cuda.is_available():
            print("validate_gpu: no CUDA GPU found; use --dry-run to exercise the harness on the CPU", file=sys.stderr)
            return 2
    jobs = dry_matrix() if dry else matrix()
    if args.limit:
        jobs = jobs[: args.limit]
    gpu_name = "cpu-dry-run"
    if not dry:
        from oomdoctor.gpu import detect_gpu

        g = detect_gpu()
        import torch

        gpu_name = g.name if g else torch.cuda.get_device_name(0)
    rows = []
    print(f"{len(jobs)} plans on {gpu_name}", flush=True)
    for i, (model, kw) in enumerate(jobs):
        spec, plan = _spec(model, dry), _plan(kw)
        payload = json.dumps({"model": model, "plan": kw, "dry": dry})
        t = time.perf_counter()
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        try:
            cp = subprocess.run(
                [sys.executable, __file__, "--child", payload],
                capture_output=True,
                text=True,
                timeout=args.timeout,
                env=env,
            )
            line = next((ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")), None)
            meas = json.loads(line[7:]) if line else {"error": True, "message": (cp.stderr or "no output")[-300:]}
        except subprocess.TimeoutExpired:
            meas = {"error": True, "message": f"timed out after {args.timeout} s"}
        wall = time.perf_counter() - t
        pred = predictions(spec, plan, dry)
        row = {
            "model": model if not dry else "tiny",
            "plan": plan.label(),
            "settings": plan.settings(),
            "measured": meas,
            "predicted": pred,
            "wall_seconds": round(wall, 1),
        }
        if "max_allocated_bytes" in meas:
            ma = meas["max_allocated_bytes"]
            for p in pred.values():
                p["error_allocated"] = _err(p["peak_allocated"] + (p.get("cublas_workspace") or 0), ma)
                p["error_reserved"] = _err(p.get("peak_reserved"), meas.get("max_reserved_bytes"))
                p["error_device"] = _err(p.get("peak_device"), meas.get("nvml_process_used_bytes"))
        rows.append(row)
        print(_row_line(i, row), flush=True)
    summary = _summary(rows)
    print(_summary_table(summary))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-").lower() or "gpu"
    path = out_dir / f"{slug}.json"
    env_info = _env_info()
    path.write_text(
        json.dumps({"gpu": gpu_name, "environment": env_info, "summary": summary, "rows": rows}, indent=2, default=str)
    )
    print(f"wrote {path}")
    return 0


def _row_line(i, row) -> str:
    from oomdoctor.units import format_bytes

    m = row["measured"]
    if "max_allocated_bytes" not in m:
        return f"{i + 1:3d} {row['model'][:34]:34s} {row['plan'][:60]:60s} {'OOM' if m.get('oom') else 'ERROR'}: {m.get('message', '')[:80]}"
    a, s = row["predicted"]["analytic"], row["predicted"]["simulate"]
    fe = lambda e: "   -   " if e is None else f"{e * 100:+6.1f}%"  # noqa: E731 - a one-line local helper
    return (
        f"{i + 1:3d} {row['model'][:34]:34s} {row['plan'][:60]:60s} meas {format_bytes(m['max_allocated_bytes']):>11s}"
        f"  analytic {fe(a.get('error_allocated'))}  simulate {fe(s.get('error_allocated'))}"
    )


def _summary(rows) -> dict:
    out = {}
    for eng in ("analytic", "simulate"):
        out[eng] = {}
        for key in ("error_allocated", "error_reserved", "error_device"):
            errs = [abs(r["predicted"][eng][key]) for r in rows if r["predicted"][eng].get(key) is not None]
            out[eng][key] = {
                "n": len(errs),
                "median": statistics.median(errs) if errs else None,
                "max": max(errs) if errs else None,
            }
    out["measured_plans"] = sum(1 for r in rows if "max_allocated_bytes" in r["measured"])
    out["oom_plans"] = sum(1 for r in rows if r["measured"].get("oom"))
    out["error_plans"] = sum(1 for r in rows if r["measured"].get("error"))
    return out


def _summary_table(summary) -> str:
    lines = [f"{'engine':10s} {'metric':18s} {'n':>4s} {'median |err|':>13s} {'max |err|':>10s}"]
    for eng in ("analytic", "simulate"):
        for key, v in summary[eng].items():
            med = "-" if v["median"] is None else f"{v['median'] * 100:.2f}%"
            mx = "-" if v["max"] is None else f"{v['max'] * 100:.2f}%"
            lines.append(f"{eng:10s} {key:18s} {v['n']:4d} {med:>13s} {mx:>10s}")
    lines.append(f"measured {summary['measured_plans']}, OOM {summary['oom_plans']}, errors {summary['error_plans']}")
    return "\n".join(lines)


def _env_info() -> dict:
    import platform

    info = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing or broken package is recorded as None
            info[mod] = None
    try:
        import torch

        info["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001 - no CUDA version to record
        pass
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (tests the harness without a GPU)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "gpu"), help="folder for <gpu-name>.json")
    ap.add_argument("--limit", type=int, default=0, help="run only the first N plans")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per plan (child process)")
    ap.add_argument("--list", action="store_true", help="print the matrix and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child)
    if args.list:
        for i, (m, kw) in enumerate(dry_matrix() if args.dry_run else matrix()):
            print(f"{i + 1:3d} {m:52s} {_plan(kw).label()}")
        return 0
    return run(args)


_ = asdict
if __name__ == "__main__":
    raise SystemExit(main())
