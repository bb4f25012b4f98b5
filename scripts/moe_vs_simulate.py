"""Analytic vs simulate on MoE models in every precision: transformers' grouped experts (bf16 weights) and its eager
experts (fp32 master weights, ``*-mixed``, QLoRA's fp32-upcast experts; replayed under a balanced router,
oomdoctor/engines/routing.py).

    python scripts/moe_vs_simulate.py [--types qwen3_moe,mixtral,olmoe,deepseek_v3] [--seq-len 1024]

Each type at a tiny CPU size, with narrow experts (8 of them: the tokens dominate) and wide ones (32 experts of
256: the expert weights, their merged LoRA W' and their gradients dominate), for LoRA, QLoRA and full fine-tuning,
with and without gradient checkpointing. Prints peak allocated by each engine and the error. Takes minutes.
"""

from __future__ import annotations

import argparse

TINY = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    "olmoe": dict(
        model_type="olmoe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=2048,
        pad_token_id=1,
        eos_token_id=0,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=1,
        topk_group=1,
        vocab_size=256,
    ),
}
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
PLANS = (
    ("lora", "bf16"),
    ("lora", "fp32"),
    ("lora", "bf16-mixed"),
    ("qlora", "bf16-mixed"),
    ("full", "fp32"),
    ("full", "bf16-mixed"),
)


def wide(cfg: dict) -> dict:
    """32 experts of 256: the expert weights dominate the tokens."""
    key = next(k for k in EXPERT_KEYS if k in cfg)
    inter = "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"
    return dict(cfg, **{key: 32, inter: 256})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TINY))
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()

    from oomdoctor.engines import estimate
    from oomdoctor.execute.build import runs_eager_experts
    from oomdoctor.model.load import spec_from_config
    from oomdoctor.plan import Plan, validate

    print(
        f"{'type':12} {'experts':8} {'plan':17} {'GC':3} {'kernel':7} {'simulate B':>11} {'analytic B':>11} "
        f"{'error':>7}"
    )
    for t in args.types.split(","):
        for shape, cfg in (("narrow", TINY[t]), ("wide", wide(TINY[t]))):
            spec = spec_from_config(dict(cfg), name=t)
            seq = args.seq_len if shape == "narrow" else args.seq_len // 2
            for method, precision in PLANS:
                for gc in (False, True):
                    plan = validate(
                        Plan(
                            method=method, precision=precision, seq_len=seq, lora_dropout=0.0, gradient_checkpointing=gc
                        )
                    )
                    sim = estimate(spec, plan, "simulate").peak_allocated
                    ana = estimate(spec, plan, "analytic").peak_allocated
                    kernel = "eager" if runs_eager_experts(spec, plan) else "grouped"
                    print(
                        f"{t:12} {shape:8} {method + ' ' + precision:17} {'yes' if gc else 'no':3} {kernel:7} "
                        f"{sim:>11,} {ana:>11,} {100 * (ana - sim) / sim:>+6.2f}%",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
