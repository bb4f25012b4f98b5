"""oomdoctor.hf: the OOM guard inside HF Trainer / TRL SFTTrainer, on CPU under a LiveBytes cap (as train --gpu-mem).

Every guarded run is compared with an undisturbed run at the same micro-batch (8) and accumulation: same data, same
effective batch, so the final weights and the logged losses must match.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from oomdoctor.execute.oom import OOMAtMicroBatchOne
from oomdoctor.execute.tracking import LiveBytes
from oomdoctor.hf import GuardedTrainer, batch_rows, guard_trainer, slice_rows, target_tokens
from oomdoctor.resources import tiny_dir

TINY = tiny_dir()
MB, GA, STEPS = 8, 2, 2


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY / "tokenizer"))


@pytest.fixture(scope="module")
def init_state():
    """One random init of the tiny Llama, shared by every run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY / "model")))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _model(init_state):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY / "model")))
    model.load_state_dict(init_state)
    return model


def _texts(n: int) -> list[str]:
    lines = (TINY / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines[:n]]


def _common(mb: int, **over) -> dict:
    args = dict(
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=GA * MB // mb,
        max_steps=STEPS,
        learning_rate=1e-3,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return {**args, **over}


def hf_trainer(tmp, init_state, tok, *, guarded: bool, mb: int = MB):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    data = [tok(t, truncation=True, max_length=48) for t in _texts(MB * GA * STEPS)]
    cls = GuardedTrainer if guarded else Trainer
    return cls(
        model=_model(init_state),
        args=TrainingArguments(output_dir=str(tmp), **_common(mb)),
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )


def _run(trainer, cap: int | None = None) -> LiveBytes:
    with LiveBytes(cap_bytes=cap, history=False) as meter:
        meter.track_module(trainer.model, grad_hooks=True)
        trainer.train()
    return meter


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory, init_state, tok):
    """Undisturbed Trainer runs at micro-batch 8 and 4 (their metered peaks place the cap) — the 8 run is the
    reference the guarded run must equal."""
    base = tmp_path_factory.mktemp("hfref")
    t8 = hf_trainer(base / "mb8", init_state, tok, guarded=False)
    peak8 = _run(t8).peak
    t4 = hf_trainer(base / "mb4", init_state, tok, guarded=False, mb=4)
    peak4 = _run(t4).peak
    assert peak4 < peak8
    return t8, peak8, peak4


# ------------------------------------------------------------------------------------------------ unit
def test_slicing_keeps_rows_and_flags():
    ids = torch.arange(12).reshape(4, 3)
    labels = torch.tensor([[-100, 1, 2], [-100, -100, 5], [6, 7, 8], [-100, -100, -100]])
    inputs = {"input_ids": ids, "labels": labels, "use_cache": False, "names": ["a", "b", "c", "d"]}
    assert batch_rows(inputs) == 4
    half = slice_rows(inputs, 2, 4)
    assert torch.equal(half["input_ids"], ids[2:]) and half["names"] == ["c", "d"] and half["use_cache"] is False
    assert target_tokens(inputs, shifted=True) == 2 + 1 + 2 + 0  # labels[..., 1:] != -100
    assert target_tokens(inputs, shifted=False) == 2 + 1 + 3 + 0
    assert target_tokens({"input_ids": ids}, shifted=True) is None
    with pytest.raises(ValueError, match="batch dimension"):
        batch_rows({"use_cache": False})


# ------------------------------------------------------------------------------------------------ HF Trainer
@pytest.mark.slow
def test_trainer_under_cap_equals_unsplit_run(tmp_path, init_state, tok, hf_reference, caplog):
    ref, peak8, peak4 = hf_reference
    cap = (peak8 + peak4) // 2  # micro-batch 8 cannot fit, 4 can
    trainer = hf_trainer(tmp_path, init_state, tok, guarded=True)
    with caplog.at_level(logging.WARNING, logger="oomdoctor.hf"):
        meter = _run(trainer, cap)
    g = trainer.oom_guard
    assert meter.peak <= cap
    assert [(r.failed_micro_batch, r.new_micro_batch) for r in g.recoveries] == [(8, 4)]  # later steps start at 4
    assert g.micro_batch == 4 and trainer.state.global_step == STEPS  # no optimizer step lost
    assert "same effective batch" in caplog.text
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-5)
    assert _max_diff(trainer.model, ref.model) < 1e-5
    assert trainer.state.log_history[0]["oom_recoveries"] == 1


class _FailOnce:
    """Raises CUDA's OOM once, in the ``nth`` forward (or its backward) if its batch has more than ``rows`` rows, at
    the output of decoder layer ``layer``: in backward, after the gradients of everything above it landed."""

    def __init__(self, model, nth: int, rows: int, backward: bool, layer: int = 0):
        self.calls, self.fired, self.nth, self.rows, self.backward = 0, False, nth, rows, backward
        model.model.layers[layer].register_forward_hook(self.hook)

    def hook(self, _module, _args, out):
        h = out[0] if isinstance(out, tuple) else out
        if not torch.is_grad_enabled():
            return
        self.calls += 1
        if self.fired or self.calls != self.nth or h.shape[0] <= self.rows:
            return
        self.fired = True

        def boom(*_):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (test)")

        if self.backward:
            h.register_hook(boom)
        else:
            boom()


@pytest.mark.slow
def test_oom_mid_backward_replays_the_step(tmp_path, init_state, tok, hf_reference):
    """OOM in the 2nd micro-batch's backward after gradients landed: the step's first micro-batch is replayed at
    the smaller size; weights and logged losses equal the unsplit run (the replayed loss is not counted twice)."""
    ref, _, _ = hf_reference
    trainer = hf_trainer(tmp_path, init_state, tok, guarded=True)
    fault = _FailOnce(trainer.model, nth=2, rows=4, backward=True)
    trainer.train()
    assert fault.fired
    (rec,) = trainer.oom_guard.recoveries
    assert rec.replayed and rec.phase == "backward" and (rec.failed_micro_batch, rec.new_micro_batch) == (8, 4)
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-5)
    assert _max_diff(trainer.model, ref.model) < 1e-5


@pytest.mark.slow
def test_split_of_a_per_micro_batch_mean_loss_is_token_weighted(tmp_path, init_state, tok):
    """A model without loss kwargs gets no num_items_in_batch: the loss is a per-micro-batch token mean and each half
    is weighted by its share of target tokens (the halves hold different token counts)."""
    runs = []
    for guarded in (False, True):
        trainer = hf_trainer(tmp_path / str(guarded), init_state, tok, guarded=guarded)
        trainer.model_accepts_loss_kwargs = False
        if guarded:
            _FailOnce(trainer.model, nth=1, rows=4, backward=False)
        trainer.train()
        runs.append(trainer)
    ref, got = runs
    (rec,) = got.oom_guard.recoveries
    assert rec.phase == "forward" and not rec.replayed
    assert _losses(got) == pytest.approx(_losses(ref), rel=1e-5)
    assert _max_diff(got.model, ref.model) < 1e-5


def test_one_row_that_does_not_fit_is_a_clear_error(tmp_path, init_state, tok):
    trainer = guard_trainer(hf_trainer(tmp_path, init_state, tok, guarded=False))  # a built trainer, guarded in place
    assert type(trainer) is GuardedTrainer and guard_trainer(trainer) is trainer
    trainer.args.max_steps = 1

    def always(_module, _args, out):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (test)")

    trainer.model.model.layers[1].register_forward_hook(always)
    with pytest.raises(OOMAtMicroBatchOne, match="micro-batch 1") as ei:
        trainer.train()
    assert ei.value.reason == "micro-batch 1" and "gradient_checkpointing" in str(ei.value)
    assert [r.new_micro_batch for r in trainer.oom_guard.recoveries] == [4, 2, 1]
    assert trainer.state.global_step == 0


# ------------------------------------------------------------------------------------------------ TRL SFTTrainer
def sft_trainer(tmp, init_state, tok, *, guarded: bool, mb: int = MB):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from oomdoctor.hf import GuardedSFTTrainer

    cls = GuardedSFTTrainer if guarded else trl.SFTTrainer
    # fp32 like the Trainer runs (SFTConfig defaults to bf16 autocast, whose rounding differs between a batch of 8
    # and two of 4 by ~1e-4 on the gradient, with or without the guard)
    args = trl.SFTConfig(output_dir=str(tmp), max_length=48, packing=False, bf16=False, **_common(mb))
    return cls(
        model=_model(init_state),
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_list([{"text": t} for t in _texts(MB * GA * STEPS)]),
    )


@pytest.mark.slow
def test_sft_trainer_under_cap_equals_unsplit_run(tmp_path, init_state, tok):
    ref = sft_trainer(tmp_path / "ref", init_state, tok, guarded=False)
    peak8 = _run(ref).peak
    small = sft_trainer(tmp_path / "mb4", init_state, tok, guarded=False, mb=4)
    peak4 = _run(small).peak
    trainer = sft_trainer(tmp_path / "guarded", init_state, tok, guarded=True)
    meter = _run(trainer, (peak8 + peak4) // 2)
    assert meter.peak <= (peak8 + peak4) // 2
    assert [(r.failed_micro_batch, r.new_micro_batch) for r in trainer.oom_guard.recoveries] == [(8, 4)]
    assert trainer.state.global_step == STEPS
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-5)
    assert _max_diff(trainer.model, ref.model) < 1e-5
    # TRL's metrics survive the split: the token count is exact, the accuracy a mean over the pieces
    logs, ref_logs = trainer.state.log_history[:STEPS], ref.state.log_history[:STEPS]
    assert [h["num_tokens"] for h in logs] == [h["num_tokens"] for h in ref_logs]
    for h, r in zip(logs, ref_logs):
        assert 0.0 <= h["mean_token_accuracy"] <= 1.0 and h["entropy"] == pytest.approx(r["entropy"], rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("frozen_head", [False, True], ids=["replay", "split-in-backward"])
def test_sft_oom_in_backward_undoes_trl_metric_side_effects(tmp_path, init_state, tok, frozen_head):
    """An OOM in the 2nd micro-batch's backward, after TRL counted its tokens and metrics in compute_loss. With
    gradients landed the step's first micro-batch is replayed; with a frozen head (no gradient lands above the last
    layer) the micro-batch is only split. Either way the guard undoes the counts: num_tokens stays exact."""
    runs = []
    for guarded in (False, True):
        trainer = sft_trainer(tmp_path / str(guarded), init_state, tok, guarded=guarded)
        if frozen_head:
            for p in [*trainer.model.model.norm.parameters(), *trainer.model.lm_head.parameters()]:
                p.requires_grad_(False)
        if guarded:
            fault = _FailOnce(trainer.model, nth=2, rows=4, backward=True, layer=1 if frozen_head else 0)
        trainer.train()
        runs.append(trainer)
    ref, trainer = runs
    (rec,) = trainer.oom_guard.recoveries
    assert fault.fired and rec.phase == "backward" and rec.replayed is not frozen_head
    logs, ref_logs = trainer.state.log_history[:STEPS], ref.state.log_history[:STEPS]
    assert [h["num_tokens"] for h in logs] == [h["num_tokens"] for h in ref_logs]
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-5)
    assert _max_diff(trainer.model, ref.model) < 1e-5
