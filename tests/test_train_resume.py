"""Checkpoints: atomic and resumable; a run killed with SIGKILL and resumed ends where an uninterrupted one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from train_util import ROOT, cli, load_weights, max_abs_diff, tiny_cfg, write_yaml

from oomdoctor.train.checkpoint import list_checkpoints
from oomdoctor.train.loop import STEP_DELAY_ENV, train

STEPS = 8


def _cfg(out, **kw):
    # dropout-free tiny model, shuffled data, cosine schedule with warm-up: every piece of state matters on resume
    return tiny_cfg(
        out, max_steps=STEPS, save_steps=2, save_total_limit=None, warmup_steps=2, lr_scheduler_type="cosine", **kw
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, method):
    extra = {"method": "lora", "r": 4, "lora_alpha": 8, "learning_rate": 1e-2} if method == "lora" else {}
    ref = train(_cfg(tmp_path / "ref", **extra))
    assert ref.optimizer_steps == STEPS

    out = tmp_path / "killed"
    cfg_path = write_yaml(tmp_path / "c.yaml", _cfg(out, **extra))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", STEP_DELAY_ENV: "0.4"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "oomdoctor", "train", str(cfg_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 150
    try:
        while time.time() < deadline:
            steps = [s for s, _ in list_checkpoints(out)]
            if steps and steps[-1] >= 2:
                break
            if proc.poll() is not None:
                pytest.fail(f"run ended before it could be killed: {proc.stderr.read()}")
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint appeared")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    done = [s for s, _ in list_checkpoints(out)]
    assert done and max(done) < STEPS, done  # killed mid-run

    if method == "full":  # through the CLI
        p = cli("train", cfg_path, "--resume", "--json")
        assert p.returncode == 0, p.stderr
        res = json.loads(p.stdout)
    else:  # in-process (saves one interpreter start-up)
        from oomdoctor.train.config import load_train_config

        res = train(load_train_config(cfg_path), resume=True).to_dict()
    assert res["optimizer_steps"] == STEPS
    assert res["resumed_from"].endswith(f"checkpoint-{max(done)}")
    assert res["losses"] == pytest.approx(ref.losses, rel=1e-5)
    assert max_abs_diff(load_weights(res["checkpoint"]), load_weights(ref.checkpoint)) < 1e-6
    if method == "lora":
        assert all("lora_" in k for k in load_weights(res["checkpoint"]))


def test_atomic_save_never_exposes_partial_checkpoint(tmp_path):
    """A temp dir left by a crash is ignored; a complete checkpoint is the only thing --resume reads."""
    res = train(tiny_cfg(tmp_path, max_steps=2, save_steps=1, save_total_limit=1))
    cps = list_checkpoints(tmp_path)
    assert [s for s, _ in cps] == [2]  # rotation kept only the newest
    partial = tmp_path / ".tmp-checkpoint-3-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    (tmp_path / "checkpoint-4").mkdir()  # no trainer_state.json: incomplete, never listed
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    res2 = train(tiny_cfg(tmp_path, max_steps=3, save_steps=1, save_total_limit=1), resume=True)
    assert res2.resumed_from.endswith("checkpoint-2") and res2.optimizer_steps == 3
    assert res.losses == res2.losses[:2]


def test_resume_refuses_a_different_run(tmp_path):
    from oomdoctor.errors import BadInput

    train(tiny_cfg(tmp_path, max_steps=1))
    with pytest.raises(BadInput, match="different run"):
        train(tiny_cfg(tmp_path, max_steps=2, seq_len=32), resume=True)
    with pytest.raises(BadInput, match="no checkpoint"):
        train(tiny_cfg(tmp_path / "empty", max_steps=2), resume=True)


def test_a_setting_added_after_the_checkpoint_was_written_counts_at_its_default():
    """Checkpoints of an earlier oomdoctor lack newer fingerprint keys (adapter_dtype): they resume unless the
    config moves that setting away from its default."""
    from dataclasses import replace

    from oomdoctor.train.config import TrainConfig
    from oomdoctor.train.resume import fingerprint, fingerprint_changes

    now = fingerprint(TrainConfig())
    older = {k: v for k, v in now.items() if k != "adapter_dtype"}
    assert fingerprint_changes(older, now) == []
    assert fingerprint_changes(older, fingerprint(replace(TrainConfig(), adapter_dtype="bf16"))) == [
        "adapter_dtype: 'fp32' -> 'bf16'"
    ]
    # kbit_upcast (peft's k-bit upcast, added later): checkpoints without it ran with the upcast
    older = {k: v for k, v in now.items() if k != "kbit_upcast"}
    assert fingerprint_changes(older, now) == []
    assert fingerprint_changes(older, fingerprint(replace(TrainConfig(), kbit_upcast=False))) == [
        "kbit_upcast: True -> False"
    ]
