"""Training speed: ``oomdoctor train`` against Hugging Face ``Trainer`` on the same CPU setup (tokens/s).

Same model (the bundled tiny Llama config and a ~3.4M-parameter widening of it, random init from the same seed),
same packed data (the bundled tiny dataset, tokenized once by oomdoctor and handed to both), same batch (micro 8 x
accumulation 2), fp32, AdamW (``adamw_torch``), cosine schedule, no checkpoints, same intra-op thread count.
Each side runs ``--steps`` optimizer steps after ``--warmup`` untimed ones; tokens/s = tokens of the timed steps /
their wall time (HF: ``train_runtime`` of a run of warmup + steps minus a run of warmup steps). Goal: oomdoctor >=
0.95x HF. Run: ``python benchmarks/train_vs_hf.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL = 0.95


def _cfg(out: str, steps: int, widen: bool):
    from oomdoctor.train.config import load_train_config

    cfg = load_train_config(ROOT / "configs" / "train" / "tiny-cpu.yaml")
    cfg = replace(cfg, max_steps=steps, save_steps=0, logging_steps=10**6, output_dir=out, micro_batch_size=8,
                  gradient_accumulation_steps=2, warmup_steps=0, optim="adamw_torch", optim_impl="foreach")
    if widen:
        import json

        c = json.loads(Path(cfg.model.config).read_text())
        c.update(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=8)
        p = Path(out).parent / "wide-config.json"
        p.write_text(json.dumps(c))
        cfg = replace(cfg, model=replace(cfg.model, config=str(p)))
    return cfg


def ours(steps: int, warmup: int, widen: bool) -> tuple[float, int, int]:
    """(tokens/s, params, threads) of oomdoctor's loop over ``steps`` timed steps."""
    from oomdoctor.train.loop import train

    with tempfile.TemporaryDirectory() as d:
        events: list[dict] = []
        cfg = _cfg(str(Path(d) / "run"), warmup + steps, widen)
        marks: dict[int, float] = {}

        def on_event(e: dict) -> None:
            events.append(e)
            if e["type"] == "step":
                marks[e["step"]] = time.perf_counter()

        import torch

        cfg = replace(cfg, logging_steps=1)
        res = train(cfg, on_event=on_event)
        threads = torch.get_num_threads() if res.num_params >= 5_000_000 or "OMP_NUM_THREADS" in os.environ else 1
        per_step = res.tokens / res.optimizer_steps
        wall = marks[warmup + steps] - marks[warmup]
        return per_step * steps / wall, res.num_params, threads


def hf(steps: int, warmup: int, widen: bool, threads: int) -> float:
    """tokens/s of ``transformers.Trainer`` on the same model, data and batch."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from oomdoctor.execute.load import ModelSource, load_tokenizer
    from oomdoctor.train.data import tokenize

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        cfg = _cfg(str(Path(d) / "run"), steps, widen)
        tok = load_tokenizer(ModelSource(path=None, config=cfg.model.config, init="random",
                                         tokenizer=cfg.model.tokenizer))
        data = tokenize(cfg.dataset, tok, cfg.seq_len)
        rows = [{"input_ids": torch.tensor(s[0]), "labels": torch.tensor(s[1])} for s in data.samples]
        runtimes = []
        for n in (warmup, warmup + steps):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.config),
                                                     attn_implementation="sdpa")
            model.resize_token_embeddings(len(tok))
            args = TrainingArguments(output_dir=str(Path(d) / "hf"), per_device_train_batch_size=8,
                                     gradient_accumulation_steps=2, max_steps=n, learning_rate=cfg.learning_rate,
                                     lr_scheduler_type="cosine", warmup_steps=0, logging_steps=10**6,
                                     save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                                     optim="adamw_torch", seed=cfg.seed, disable_tqdm=True)
            out = Trainer(model=model, args=args, train_dataset=rows).train()
            runtimes.append(out.metrics["train_runtime"])
        tokens = steps * 16 * cfg.seq_len
        return tokens / (runtimes[1] - runtimes[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for widen in (False, True):
        tps, params, threads = ours(a.steps, a.warmup, widen)
        hps = hf(a.steps, a.warmup, widen, threads)
        rows.append((f"{params / 1e6:.2f}M params", threads, tps, hps, tps / hps))
    print(f"{'model':<16}{'threads':>8}{'oomdoctor tok/s':>18}{'HF Trainer tok/s':>18}{'ratio':>8}  goal >= {GOAL}")
    for name, threads, tps, hps, r in rows:
        print(f"{name:<16}{threads:>8}{tps:>18,.0f}{hps:>18,.0f}{r:>8.2f}  {'ok' if r >= GOAL else 'BELOW GOAL'}")


if __name__ == "__main__":
    main()
