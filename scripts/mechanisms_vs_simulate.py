"""Analytic vs simulate on the plans where one mechanism sets the peak (the README's "found op by op" list and its
long-context accuracy).

    python scripts/mechanisms_vs_simulate.py

One row per case: a bundled model or a model type (``MODEL@N``: cut to N blocks, all replayed; a model type alone:
transformers' default config cut to 8 blocks), the plan, peak allocated by each engine and the analytic error. The tied-head
case also replays every block (``layers="full"``): the simulated engine extrapolates from 2 and 3 blocks otherwise.
Takes a few minutes on 2 cores (the 32k-token Mistral case most).
"""

from __future__ import annotations

CASES = (
    [
        (
            "tied head, full bf16 + GC",
            "google/gemma-2b",
            dict(method="full", precision="bf16", seq_len=1024, gradient_checkpointing=True, optimizer="adamw-8bit"),
        ),
        (
            "tied head, full bf16 + GC",
            "meta-llama/Llama-3.2-1B",
            dict(method="full", precision="bf16", seq_len=2048, gradient_checkpointing=True),
        ),
        ("sliding window, SDPA 32k", "mistralai/Mistral-7B-v0.1", dict(method="lora", precision="bf16", seq_len=32768)),
        (
            "eager + GC, 4k",
            "meta-llama/Llama-3.2-1B",
            dict(method="lora", precision="bf16", attn="eager", seq_len=4096, gradient_checkpointing=True),
        ),
        ("gelu_new under autocast", "microsoft/phi-2", dict(method="full", precision="bf16-mixed", seq_len=2048)),
        ("attention dropout (SDPA)", "seed_oss", dict(method="lora", precision="bf16", seq_len=1024)),
        (
            "fp32 down-adapter cast",
            "meta-llama/Llama-3.2-1B@2",
            dict(method="lora", precision="bf16-mixed", seq_len=16384, loss="chunked", gradient_checkpointing=True),
        ),
        (
            "  with offloaded activations",
            "meta-llama/Llama-3.2-1B@2",
            dict(
                method="lora",
                precision="bf16-mixed",
                seq_len=16384,
                loss="chunked",
                gradient_checkpointing=True,
                offload_activations=True,
            ),
        ),
        (
            "up adapter, top block recompute",
            "meta-llama/Llama-3.2-1B@2",
            dict(method="lora", precision="bf16", seq_len=16384, loss="chunked", gradient_checkpointing=True),
        ),
        (
            "down adapter cast + dropout",
            "meta-llama/Llama-3.2-1B@2",
            dict(
                method="lora",
                precision="bf16",
                lora_dropout=0.05,
                seq_len=16384,
                loss="chunked",
                gradient_checkpointing=True,
            ),
        ),
        (
            "product backward, QLoRA",
            "meta-llama/Llama-3.2-1B@2",
            dict(method="qlora", precision="bf16-mixed", seq_len=16384, loss="chunked", gradient_checkpointing=True),
        ),
        (
            "  offloaded (input unpacked)",
            "meta-llama/Llama-3.2-1B@2",
            dict(
                method="qlora",
                precision="bf16-mixed",
                seq_len=16384,
                loss="chunked",
                gradient_checkpointing=True,
                offload_activations=True,
            ),
        ),
        (
            "int8 inputs kept, offloaded",
            "meta-llama/Llama-3.2-1B@4",
            dict(
                method="qlora",
                quant="int8",
                precision="bf16",
                seq_len=4096,
                gradient_checkpointing=True,
                offload_activations=True,
            ),
        ),
    ]
    + [  # vision-language models fine-tuned on text: towers frozen, never run (the README's vision-language section)
        (f"VLM, {name}", "Qwen/Qwen2.5-VL-7B-Instruct@2", dict(seq_len=4096, **kw))
        for name, kw in (
            ("full bf16", dict(method="full", precision="bf16")),
            ("full bf16 + GC", dict(method="full", precision="bf16", gradient_checkpointing=True)),
            ("LoRA bf16", dict(method="lora", precision="bf16")),
            ("LoRA mixed + GC", dict(method="lora", precision="bf16-mixed", gradient_checkpointing=True)),
            ("QLoRA + GC", dict(method="qlora", precision="bf16-mixed", gradient_checkpointing=True)),
            (
                "QLoRA chunked",
                dict(method="qlora", precision="bf16-mixed", gradient_checkpointing=True, loss="chunked"),
            ),
        )
    ]
    + [("vision adapter, full bf16", "mllama@40", dict(method="full", precision="bf16", seq_len=1024))]
    + [  # long contexts, chunked loss + GC: the blocks set the peak (the README's long-context accuracy)
        (
            f"long context, {name}",
            "meta-llama/Llama-3.1-8B",
            dict(seq_len=32768, loss="chunked", gradient_checkpointing=True, **kw),
        )
        for name, kw in (
            ("LoRA bf16", dict(method="lora", precision="bf16")),
            ("QLoRA", dict(method="qlora", precision="bf16-mixed")),
            ("QLoRA offloaded", dict(method="qlora", precision="bf16-mixed", offload_activations=True)),
            ("QLoRA tiled MLP", dict(method="qlora", precision="bf16-mixed", tiled_mlp=True)),
        )
    ]
    + [  # 100k+ tokens on 2 blocks (MODEL@N: a bundled model cut to N blocks, every block replayed)
        (
            f"{tokens // 1024}k, {name}",
            "meta-llama/Llama-3.1-8B@2",
            dict(seq_len=tokens, loss="chunked", gradient_checkpointing=True, **kw),
        )
        for tokens, name, kw in (
            (65536, "tiled QLoRA", dict(method="qlora", precision="bf16-mixed", tiled_mlp=True)),
            (131072, "tiled QLoRA", dict(method="qlora", precision="bf16-mixed", tiled_mlp=True)),
            (
                262144,
                "tiled QLoRA offloaded",
                dict(method="qlora", precision="bf16-mixed", tiled_mlp=True, offload_activations=True),
            ),
            (
                131072,
                "tiled LoRA offloaded",
                dict(method="lora", precision="bf16", tiled_mlp=True, offload_activations=True),
            ),
            (131072, "full offloaded", dict(method="full", precision="bf16", offload_activations=True)),
            (
                131072,
                "tiled full offloaded",
                dict(method="full", precision="bf16", tiled_mlp=True, offload_activations=True),
            ),
        )
    ]
)


def spec_of(model: str):
    """A bundled model (``org/name``) or a model type (transformers' default config cut to 8 blocks); ``MODEL@N``:
    cut to N blocks."""
    from blocks_vs_simulate import shrink
    from transformers import AutoConfig

    from oomdoctor.model.architectures import build_spec
    from oomdoctor.model.load import load_spec

    repo, _, cut = model.partition("@")
    if not cut and "/" in repo:
        return load_spec(repo)
    cfg = load_spec(repo).config if "/" in repo else AutoConfig.for_model(repo).to_dict()
    return build_spec(shrink(dict(cfg), int(cut or 8)), model)


def main() -> None:
    from oomdoctor.engines import estimate
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.plan import Plan, validate

    print(f"{'mechanism':28} {'model':34} {'analytic GiB':>12} {'simulate GiB':>12} {'error':>8}")
    for name, model, kw in CASES:
        cut = "@" in model
        spec = spec_of(model)
        plan = validate(Plan(**kw))
        a = estimate(spec, plan, "analytic").peak_allocated
        s = (
            simulate_plan(spec, plan, layers="full").breakdown if cut else estimate(spec, plan, "simulate")
        ).peak_allocated
        print(f"{name:28} {model:34} {a / 2**30:12.3f} {s / 2**30:12.3f} {100 * (a - s) / s:+7.2f}%", flush=True)
        if name.startswith("tied"):
            full = simulate_plan(spec, plan, layers="full").breakdown.peak_allocated
            print(
                f"{'  every block replayed':28} {model:34} {a / 2**30:12.3f} {full / 2**30:12.3f} "
                f"{100 * (a - full) / full:+7.2f}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
