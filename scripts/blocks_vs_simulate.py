"""Analytic vs simulate on model types without a hand-written builder: the formulas alone, then with the blocks
measured (oomdoctor/engines/blocks.py), against the replayed step (--engine simulate).

    python scripts/blocks_vs_simulate.py [--types cohere2,seed_oss,...] [--layers 8] [--seq-len 1024]

Each type is transformers' default config (the released model for most) cut to ``--layers`` blocks (the simulated
engine then replays every block of a model as deep as the one priced). Prints one row per type and plan: peak
allocated by each engine and the two errors. Takes minutes: the simulated engine runs every plan.
"""

from __future__ import annotations

import argparse
import time

TYPES = (
    "cohere2,seed_oss,apertus,exaone4,olmo3,ernie4_5,smollm3,gemma3_text,starcoder2,gpt_neox,glm4,ministral3,"
    "mamba,mamba2,falcon_h1,lfm2,granitemoehybrid,nemotron_h,jamba,qwen3_next,llama4_text,qwen2_moe,olmoe,"
    "glm4_moe,deepseek_v2,mllama"
)
PLANS = {
    "lora bf16 GC": dict(method="lora", precision="bf16", gradient_checkpointing=True),
    "lora bf16": dict(method="lora", precision="bf16", gradient_checkpointing=False),
    "full bf16 GC 8-bit": dict(method="full", precision="bf16", gradient_checkpointing=True, optimizer="adamw-8bit"),
}


def shrink(cfg: dict, layers: int) -> dict:
    """``cfg`` with at most ``layers`` blocks (per-layer lists cut, index lists filtered)."""
    tc = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    if tc.get("num_hidden_layers", 0) > layers:
        tc["num_hidden_layers"] = layers
        for k in ("layer_types", "layers_block_type", "no_rope_layers"):
            if isinstance(tc.get(k), list):
                tc[k] = tc[k][:layers]
        for k in ("full_attn_idxs", "attn_layer_indices", "moe_layers", "mlp_only_layers"):
            if isinstance(tc.get(k), list):
                tc[k] = [i for i in tc[k] if i < layers]
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()

    from transformers import AutoConfig

    from oomdoctor.engines import estimate
    from oomdoctor.errors import BadInput
    from oomdoctor.memory.analytic import estimate_analytic
    from oomdoctor.model.architectures import build_spec
    from oomdoctor.plan import Plan, validate

    print(f"{'type':18} {'plan':20} {'simulate GiB':>12} {'formulas':>9} {'measured':>9} {'sim s':>6}")
    for t in args.types.split(","):
        try:
            spec = build_spec(shrink(AutoConfig.for_model(t).to_dict(), args.layers), t)
        except (BadInput, ValueError, KeyError) as exc:
            print(f"{t:18} {'-':20} cannot build: {str(exc)[:80]}")
            continue
        for name, kw in PLANS.items():
            plan = validate(Plan(seq_len=args.seq_len, **kw))
            try:
                formulas = estimate_analytic(spec, plan).peak_allocated
                measured = estimate(spec, plan, "analytic").peak_allocated
                t0 = time.perf_counter()
                sim = estimate(spec, plan, "simulate").peak_allocated
            except BadInput as exc:
                print(f"{t:18} {name:20} {str(exc)[:90]}")
                continue
            print(
                f"{t:18} {name:20} {sim / 2**30:12.2f} {100 * (formulas - sim) / sim:+8.2f}% "
                f"{100 * (measured - sim) / sim:+8.2f}% {time.perf_counter() - t0:6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
