"""Regenerate the README pictures from the memory model (no GPU, no weights, no network).

    python scripts/readme_pictures.py            # writes docs/img/diagnose-llama2-7b.png (+ the timeline if possible)

``diagnose-llama2-7b.png``: the analytic breakdown of six representative plans for Llama-2-7B at micro-batch 1 x 1024
tokens against a 24 GB card. ``timeline-tiny-llama.png``: live tensor bytes by category over two training steps of a
tiny Llama (2 layers, hidden 64) from the simulate engine, when it is present.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OOMDOCTOR_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oomdoctor.diagnose.plot import plot_plans, plot_timeline  # noqa: E402 - after the environment set-up above
from oomdoctor.engines import estimate  # noqa: E402 - after the environment set-up above
from oomdoctor.model.load import load_spec  # noqa: E402 - after the environment set-up above
from oomdoctor.plan import Plan  # noqa: E402 - after the environment set-up above
from oomdoctor.plan.budget import Budget  # noqa: E402 - after the environment set-up above

OUT = ROOT / "docs" / "img"


def diagnose_picture() -> Path:
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    base = Plan(seq_len=1024, micro_batch=1)
    plans = [
        base,
        base.with_(gradient_checkpointing=True, optimizer="paged-adamw-8bit"),
        base.with_(method="lora"),
        base.with_(method="lora", gradient_checkpointing=True),
        base.with_(method="qlora", quant="nf4", double_quant=True),
        base.with_(method="qlora", quant="nf4", double_quant=True, gradient_checkpointing=True),
    ]
    rows = [(p.label(), estimate(spec, p, "analytic")) for p in plans]
    return plot_plans(
        rows,
        Budget(24 * 10**9, "--gpu-mem"),
        OUT / "diagnose-llama2-7b.png",
        title="Llama-2-7B, micro-batch 1 x 1024 tokens: peak device memory by component (analytic)",
    )


def timeline_picture() -> Path | None:
    try:
        from oomdoctor.engines.simulate import simulate_plan
        from oomdoctor.model.load import spec_from_config
    except ImportError:
        return None
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    spec = spec_from_config(cfg, "tiny-llama")
    result = simulate_plan(spec, Plan(precision="fp32", micro_batch=4, seq_len=128), timeline=True)
    return plot_timeline(
        result.timeline,
        OUT / "timeline-tiny-llama.png",
        title="tiny Llama (2 layers, hidden 64), fp32 AdamW, 4 x 128 tokens: live bytes, 2 steps",
    )


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    print(diagnose_picture())
    t = timeline_picture()
    print(t if t else "simulate engine not present: timeline picture skipped")
