#!/usr/bin/env python3
"""Training speed: ``oomdoctor train`` against Hugging Face ``Trainer`` on the same CPU setup (tokens/s; goal >= 0.95x).

Same model (the bundled tiny Llama config and a ~3.4M-parameter widening of it, random init from the same seed),
same data (the bundled tiny dataset packed into 64-token blocks, tokenized once by oomdoctor; HF Trainer gets the
same rows and oomdoctor's own collate, so both run identical batches), same batch (micro 8 x accumulation 2), fp32,
AdamW (``adamw_torch``) stepped as HF Trainer steps it on a CPU (torch's default there, one tensor at a time:
``optim_impl: for-loop`` on both sides, so the loops are compared, not the kernels: on the wider model ``foreach``
takes 1.6-1.8x and ``fused``, oomdoctor's default, 0.35-0.4x the for-loop's time per optimizer step), cosine schedule,
no checkpoints, the same intra-op thread count. Each side runs
``--warmup`` untimed optimizer steps, then ``--steps`` timed ones, in one run: tokens/s = tokens of the timed steps /
the wall time between the end of the last warm-up step and the end of the last timed one (oomdoctor: its step
events; HF: a ``TrainerCallback``'s ``on_step_end``). The pair is measured ``--repeats`` times, alternating, and the
medians are compared. Run: ``python benchmarks/train_vs_hf.py`` (a few minutes on 2 cores); ``--quick`` is a smoke
run (a few steps, one repeat: the ratio is indicative only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GOAL = 0.95
MICRO, ACCUM = 8, 2


def _file(ref: str) -> Path:
    """A config path or a ``bundled:`` name as a file path."""
    from oomdoctor.resources import bundled_path, is_bundled

    return bundled_path(ref) if is_bundled(ref) else Path(ref)


def _cfg(out: str, steps: int, widen: bool):
    from oomdoctor.train.config import load_train_config

    cfg = load_train_config(ROOT / "configs" / "train" / "tiny-cpu.yaml")
    cfg = replace(
        cfg,
        max_steps=steps,
        save_steps=0,
        logging_steps=1,
        output_dir=out,
        micro_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        warmup_steps=0,
        optim="adamw_torch",
        optim_impl="for-loop",
    )
    if widen:
        import json

        c = json.loads(_file(cfg.model.config).read_text())
        c.update(
            hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8
        )
        p = Path(out).parent / "wide-config.json"
        p.write_text(json.dumps(c))
        cfg = replace(cfg, model=replace(cfg.model, config=str(p)))
    return cfg


def ours(steps: int, warmup: int, widen: bool) -> tuple[float, int, int]:
    """(tokens/s, params, threads) of oomdoctor's loop over ``steps`` timed steps."""
    import torch

    from oomdoctor.train.loop import train

    with tempfile.TemporaryDirectory() as d:
        cfg = _cfg(str(Path(d) / "run"), warmup + steps, widen)
        marks: dict[int, float] = {}
        threads: list[int] = []

        def on_event(e: dict) -> None:
            if e["type"] == "step":
                marks[e["step"]] = time.perf_counter()
                threads.append(torch.get_num_threads())

        res = train(cfg, on_event=on_event)
        per_step = res.tokens / res.optimizer_steps
        return per_step * steps / (marks[warmup + steps] - marks[warmup]), res.num_params, threads[-1]


def hf(steps: int, warmup: int, widen: bool, threads: int) -> float:
    """tokens/s of ``transformers.Trainer`` on the same model, rows, batches and thread count."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from oomdoctor.execute.load import ModelSource, load_tokenizer
    from oomdoctor.train.data import collate, tokenize

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        cfg = _cfg(str(Path(d) / "run"), warmup + steps, widen)
        tok = load_tokenizer(
            ModelSource(path=None, config=cfg.model.config, init="random", tokenizer=cfg.model.tokenizer)
        )
        data = tokenize(cfg.dataset, tok, cfg.seq_len)
        tokens: list[int] = []

        def collator(rows):
            batch = collate(rows, data.pad_id, cfg.dataset.pad_to_multiple_of, data.reset_positions)
            tokens.append(int(batch["input_ids"].numel()))
            return batch

        marks: dict[int, float] = {}

        class Marks(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                marks[state.global_step] = time.perf_counter()

        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(_file(cfg.model.config)), attn_implementation="sdpa"
        )
        model.resize_token_embeddings(len(tok))
        args = TrainingArguments(
            output_dir=str(Path(d) / "hf"),
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUM,
            max_steps=warmup + steps,
            learning_rate=cfg.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=0,
            logging_steps=10**6,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            optim="adamw_torch",
            seed=cfg.seed,
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=data.samples, data_collator=collator, callbacks=[Marks()]
        )
        trainer.remove_callback(PrinterCallback)  # its end-of-run metrics line is not this table
        trainer.train()
    torch.set_num_threads(before)
    per_step = sum(tokens) / len(tokens) * ACCUM  # every packed row is a full block: each micro-batch the same
    return per_step * steps / (marks[warmup + steps] - marks[warmup])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each side (medians compared)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 timed steps, 2 warm-up, one repeat")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup, a.repeats = 4, 2, 1
    import transformers

    transformers.utils.logging.set_verbosity_error()
    rows = []
    for widen in (False, True):
        mine, theirs = [], []
        for _ in range(a.repeats):
            tps, params, threads = ours(a.steps, a.warmup, widen)
            mine.append(tps)
            theirs.append(hf(a.steps, a.warmup, widen, threads))
        tps, hps = statistics.median(mine), statistics.median(theirs)
        rows.append((f"{params / 1e6:.2f}M params", threads, tps, hps, tps / hps))
    print(f"{'model':<16}{'threads':>8}{'oomdoctor tok/s':>18}{'HF Trainer tok/s':>18}{'ratio':>8}{'goal':>8}  verdict")
    for name, threads, tps, hps, r in rows:
        verdict = "PASS" if r >= GOAL else "MISS"
        print(f"{name:<16}{threads:>8}{tps:>18,.0f}{hps:>18,.0f}{r:>8.2f}{GOAL:>7.2f}x  {verdict}")
    print(
        f"\n{a.steps} timed steps after {a.warmup} warm-up steps, median of {a.repeats} alternating run(s) per side; "
        f"machine load {os.getloadavg()[0]:.1f} (1-minute average)"
    )


if __name__ == "__main__":
    main()
