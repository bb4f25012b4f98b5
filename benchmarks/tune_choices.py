"""What ``oomdoctor tune`` chooses for bundled models on 8/16/24/48/80 GB cards, and how long it takes to decide.

For each (model, card): the chosen plan, micro-batch x accumulation, predicted resident peak, predicted tokens/s
(reference profile) and the wall time of the decision (analytic search, no verification: the part that runs
without a GPU), next to what the anchors publish for the same model and card where they do. Goal: <= 3 s per
decision (a verdict per row, and for the median). Run: ``python benchmarks/tune_choices.py`` (``--seq-len``,
``--models a,b``; ``--quick``: one model on a 24 GB card, a smoke run).

Anchors (public recipes, seq_len 2048 unless noted):
* unsloth notebooks: QLoRA of 7-8B models on a 16 GB T4 (Llama-3.1-8B, Mistral-7B, Qwen2.5-7B);
* torchtune ``llama2/7B_full_low_memory``: full fine-tune of Llama-2-7B on one 24 GB card (pure bf16, paged/8-bit
  optimizer, optimizer in backward);
* QLoRA paper (Dettmers et al. 2023): 65B/70B QLoRA on one 48 GB card; 7B on 24 GB comfortably;
* axolotl examples: Llama-3-8B LoRA on 24 GB (``examples/llama-3/lora-8b.yml``), QLoRA 70B on 2x24 GB (FSDP).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CARDS_GB = (8, 16, 24, 48, 80)
#: Seconds one decision may take.
GOAL_S = 3.0
MODELS = (
    "HuggingFaceTB/SmolLM2-360M",
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "Qwen/Qwen2.5-1.5B",
    "HuggingFaceTB/SmolLM2-1.7B",
    "google/gemma-2-2b",
    "microsoft/phi-2",
    "meta-llama/Llama-3.2-3B",
    "Qwen/Qwen2.5-3B",
    "microsoft/Phi-3-mini-4k-instruct",
    "Qwen/Qwen3-4B",
    "meta-llama/Llama-2-7b-hf",
    "mistralai/Mistral-7B-v0.3",
    "Qwen/Qwen2.5-7B",
    "meta-llama/Llama-3.1-8B",
    "Qwen/Qwen3-8B",
    "google/gemma-2-9b",
    "meta-llama/Llama-2-13b-hf",
    "Qwen/Qwen2.5-14B",
    "google/gemma-2-27b",
    "Qwen/Qwen2.5-32B",
    "mistralai/Mixtral-8x7B-v0.1",
    "meta-llama/Llama-2-70b-hf",
    "meta-llama/Llama-3.1-70B",
)
#: (model, card GB) -> what a public recipe runs there.
ANCHORS = {
    ("meta-llama/Llama-3.1-8B", 16): "unsloth: QLoRA nf4 (T4)",
    ("mistralai/Mistral-7B-v0.3", 16): "unsloth: QLoRA nf4 (T4)",
    ("Qwen/Qwen2.5-7B", 16): "unsloth: QLoRA nf4 (T4)",
    ("meta-llama/Llama-2-7b-hf", 24): "torchtune: full, pure bf16, 8-bit/paged AdamW",
    ("meta-llama/Llama-2-7b-hf", 80): "full fine-tune on device",
    ("meta-llama/Llama-3.1-8B", 24): "axolotl: LoRA",
    ("meta-llama/Llama-2-70b-hf", 48): "QLoRA paper: 65B QLoRA nf4 on 48 GB (their seq 512; --seq-len 512)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="one model, one card (smoke run)")
    a = ap.parse_args()
    if a.quick:
        a.models = "meta-llama/Llama-2-7b-hf"

    from oomdoctor.errors import OomDoctorError
    from oomdoctor.tune.tuner import tune
    from oomdoctor.units import format_bytes

    print(
        f"{'model':<44}{'card':>5}  {'plan':<52}{'micro x acc':>12}{'peak':>11}{'tok/s':>8}{'s':>6}{'goal':>6}  "
        f"verdict  anchor"
    )
    times = []
    for model in a.models.split(","):
        for gb in (24,) if a.quick else CARDS_GB:
            t0 = time.perf_counter()
            try:
                r = tune(model, gpu_mem=gb * 10**9, seq_len=a.seq_len, verify_mode="none")
                plan = r.plan.label()
                shape = f"{r.plan.micro_batch} x {r.plan.grad_accum}"
                peak = format_bytes(r.budget.needed(r.memory))
                tps = f"{r.throughput.tokens_per_s:,.0f}" if r.throughput else "-"
            except OomDoctorError:
                plan, shape, peak, tps = "no plan fits", "-", "-", "-"
            dt = time.perf_counter() - t0
            times.append(dt)
            print(
                f"{model:<44}{gb:>4}G  {plan:<52}{shape:>12}{peak:>11}{tps:>8}{dt:>6.2f}{GOAL_S:>6.1f}  "
                f"{'PASS' if dt <= GOAL_S else 'MISS':<7}  {ANCHORS.get((model, gb), '')}"
            )
    times.sort()
    med = times[len(times) // 2]
    print(
        f"\ndecisions: {len(times)}; median {med:.2f} s, max {times[-1]:.2f} s (goal <= {GOAL_S:g} s): "
        f"{'PASS' if med <= GOAL_S else 'MISS'}"
    )


if __name__ == "__main__":
    main()
