"""Analytic vs the replay of the trainer's own step (TRL's SFTTrainer, transformers' Trainer) on released shapes cut
to a few blocks: the price ``diagnose --trainer trl|hf`` gives against ``oomdoctor.engines.trainers.trainer_run``,
which builds the trainer from the file ``tune --emit`` writes and runs two of its steps on fake tensors.

    python scripts/trainers_vs_replay.py [--models meta-llama/Llama-3.1-8B,...] [--layers 2] [--seq-len 2048]
                                         [--trainers trl,hf] [--plans "lora bf16,qlora,..."]

Each model is its bundled config cut to ``--layers`` blocks (the replay then runs every block of the model priced).
Prints one row per (model, trainer, plan): the replayed peak, the analytic peak and the error, and each one's
phase. A few minutes: every row is a replay of a 7B-wide model.
"""

from __future__ import annotations

import argparse
import time

MODELS = "meta-llama/Llama-3.1-8B,Qwen/Qwen2.5-7B,mistralai/Mistral-7B-v0.3"
#: Plans a TRL / HF user runs (the trainer fixes the rest: ``oomdoctor.plan.targets.adapt``).
PLANS = {
    "full bf16": dict(method="full", precision="bf16"),
    "full bf16-mixed GC": dict(method="full", precision="bf16-mixed", gradient_checkpointing=True),
    "lora bf16": dict(method="lora", precision="bf16"),
    "lora bf16 GC": dict(method="lora", precision="bf16", gradient_checkpointing=True),
    "lora bf16-mixed": dict(method="lora", precision="bf16-mixed"),
    "qlora": dict(method="qlora", precision="bf16", gradient_checkpointing=True),
    "qlora no-upcast": dict(method="qlora", precision="bf16", gradient_checkpointing=True, kbit_upcast=False),
    "lora bf16 offload": dict(method="lora", precision="bf16", offload_activations=True),
    "full bf16 8-bit": dict(method="full", precision="bf16", optimizer="adamw-8bit", gradient_checkpointing=True),
}


def cut(spec, layers: int):
    """``spec``'s model with ``layers`` blocks."""
    from oomdoctor.execute.build import config_with_layers
    from oomdoctor.model.load import spec_from_config

    return spec_from_config(config_with_layers(spec.config, layers), name=f"{spec.name} ({layers} blocks)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--trainers", default="trl,hf")
    ap.add_argument("--plans", default=",".join(PLANS))
    args = ap.parse_args()

    from oomdoctor.engines.trainers import not_replayed, trainer_run
    from oomdoctor.errors import BadInput
    from oomdoctor.memory.analytic import estimate_analytic
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan import Plan
    from oomdoctor.plan.targets import adapt, refusals

    print(
        f"{'model':34} {'trainer':7} {'plan':20} {'replay GiB':>10} {'analytic':>9} {'error':>8}  phases "
        f"(replay/analytic) {'s':>5}"
    )
    for model in args.models.split(","):
        spec = cut(load_spec(model), args.layers)
        for trainer in args.trainers.split(","):
            for name in args.plans.split(","):
                plan = Plan(seq_len=args.seq_len, micro_batch=args.micro_batch, lora_dropout=0.05, **PLANS[name])
                try:
                    plan = adapt(plan, trainer)
                except BadInput as exc:
                    print(f"{model:34} {trainer:7} {name:20} {exc.message[:80]}")
                    continue
                why = not_replayed(plan) or "; ".join(map(str, refusals(plan)))
                if why:
                    print(f"{model:34} {trainer:7} {name:20} not replayed: {why[:80]}")
                    continue
                t0 = time.perf_counter()
                replay = trainer_run(spec, plan)
                a = estimate_analytic(spec, plan)
                err = 100 * (a.peak_allocated - replay.peak) / replay.peak
                print(
                    f"{model:34} {trainer:7} {name:20} {replay.peak / 2**30:10.3f} {a.peak_allocated / 2**30:9.3f} "
                    f"{err:+7.2f}%  {replay.peak_phase}/{a.peak_phase} {time.perf_counter() - t0:5.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
