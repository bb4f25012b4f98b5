#!/usr/bin/env python3
"""Benchmark: a cold `oomdoctor diagnose` of each kind of architecture oomdoctor prices, against the 120 s goal.

Cold = a fresh interpreter (imports included) and an empty measurement cache (``OOMDOCTOR_CACHE``, a new directory per
row): what a new user's first `oomdoctor diagnose MODEL` costs. One representative config per kind: a bundled id, or
transformers' default config of a model type (its released shape for most: ``default:jamba`` is Jamba-v0.1), written
with ``AutoConfig.for_model(type).to_json_file`` exactly as transformers saves it. The full technique matrix is priced
(the CLI's defaults: 60 plans on one GPU). Columns: wall seconds (the goal), the child's CPU seconds (what the machine's
load does not inflate), the block measurements the run made (``engines/blocks.py``; 0 where formulas price every
block), the goal and the verdict (PASS/MISS; a run that fails is an error and the script exits 1).

    python benchmarks/cold_diagnose.py [--only jamba,mamba] [--quick]

``--quick`` (what the test suite runs): two small kinds, a pinned method and precision at 256 tokens.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 120.0

#: (kind, config reference): a bundled id, ``default:<model_type>`` (transformers' default config) or
#: ``tiny:<model_type>`` (transformers' default at a test size, --quick).
KINDS: list[tuple[str, str]] = [
    ("dense decoder, formulas (Llama)", "meta-llama/Llama-2-7b-hf"),
    ("parallel block, multi-query (Falcon)", "tiiuae/falcon-7b"),
    ("encoder classifier (BERT)", "google-bert/bert-base-uncased"),
    ("encoder-decoder (T5)", "google-t5/t5-base"),
    ("MoE, formulas (Qwen3-MoE)", "Qwen/Qwen3-30B-A3B"),
    ("MoE, 256 experts (DeepSeek-V3)", "deepseek-ai/DeepSeek-V3"),
    ("sliding + global, measured (Command R7B)", "CohereLabs/c4ai-command-r7b-12-2024"),
    ("MoE, eager experts measured (gpt-oss)", "openai/gpt-oss-20b"),
    ("vision-language towers (Qwen2.5-VL)", "Qwen/Qwen2.5-VL-7B-Instruct"),
    ("per-layer head_dim (Gemma 4)", "default:gemma4_text"),
    ("Mamba: selective scan loop", "default:mamba"),
    ("Mamba-2: chunked scan", "default:mamba2"),
    ("attention + Mamba + MoE (Jamba)", "default:jamba"),
    ("parallel attention + Mamba-2 (Falcon-H1)", "default:falcon_h1"),
    ("Mamba-2 + attention + MoE (Nemotron-H)", "default:nemotron_h"),
    ("Mamba-2 + MoE (GraniteMoE-hybrid)", "default:granitemoehybrid"),
    ("gated delta net + MoE (Qwen3-Next)", "default:qwen3_next"),
    ("short convolutions (LFM2)", "default:lfm2"),
    ("chunked attention + MoE (Llama 4)", "default:llama4_text"),
]
QUICK: list[tuple[str, str]] = [
    ("dense decoder, formulas (tiny Llama)", "bundled:tiny/model/config.json"),
    ("Mamba: selective scan loop (tiny)", "tiny:mamba"),
]
QUICK_ARGS = ["--method", "lora", "--precision", "bf16", "--seq-len", "256"]
#: ``tiny:`` configs: transformers' defaults at a CPU test size.
TINY = {"mamba": dict(hidden_size=64, state_size=16, num_hidden_layers=2, vocab_size=512, time_step_rank=8)}


def config_path(ref: str, workdir: Path) -> str:
    """The MODEL argument for ``ref``: bundled ids as they are; ``default:``/``tiny:`` configs written by
    transformers into ``workdir``."""
    if not ref.startswith(("default:", "tiny:")):
        return ref
    from transformers import AutoConfig

    prefix, model_type = ref.split(":", 1)
    path = workdir / f"{prefix}-{model_type}" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(model_type, **(TINY[model_type] if prefix == "tiny" else {})).to_json_file(str(path))
    return str(path)


def cold_run(model: str, extra: list[str]) -> tuple[float, float, int, int, str]:
    """(wall s, CPU s, block measurements, exit code, last error line) of one cold `oomdoctor diagnose`."""
    cache = tempfile.mkdtemp(prefix="oomdoctor-cold-")
    env = {**os.environ, "OOMDOCTOR_CACHE": cache, "HF_HUB_OFFLINE": "1", "OOMDOCTOR_OFFLINE": "1", "COLUMNS": "200"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "oomdoctor", "diagnose", model, *extra], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    blocks = Path(cache) / "blocks"
    measured = len(list(blocks.glob("*.json"))) if blocks.is_dir() else 0
    shutil.rmtree(cache, ignore_errors=True)
    error = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1][:60]
    return wall, cpu, measured, proc.returncode, error


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small kinds, a pinned plan family (the test suite)")
    ap.add_argument("--only", default="", help="comma-separated substrings of the kinds or configs to run")
    args = ap.parse_args()
    kinds, extra = (QUICK, QUICK_ARGS) if args.quick else (KINDS, [])
    if args.only:
        wanted = [w.strip().lower() for w in args.only.split(",") if w.strip()]
        kinds = [(k, r) for k, r in kinds if any(w in k.lower() or w in r.lower() for w in wanted)]
    workdir = Path(tempfile.mkdtemp(prefix="oomdoctor-cold-configs-"))
    print(
        f"cold `oomdoctor diagnose {' '.join(extra) or '(full matrix)'}`, fresh process, empty cache; goal "
        f"{GOAL_S:.0f} s wall"
    )
    print(f"{'kind':44} {'config':38} {'wall s':>7} {'cpu s':>7} {'measured':>8} {'goal s':>7}  verdict")
    failed = 0
    try:
        for kind, ref in kinds:
            wall, cpu, measured, code, error = cold_run(config_path(ref, workdir), extra)
            verdict = f"error: {error}" if code else ("PASS" if wall <= GOAL_S else "MISS")
            failed += bool(code)
            print(f"{kind:44} {ref:38} {wall:7.1f} {cpu:7.1f} {measured:8d} {GOAL_S:7.0f}  {verdict}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
