"""Nothing a user made is ever lost: the run directory, resume checks, Ctrl-C, outputs that load.

Real tiny runs on CPU (``tests/train_util.py``) and real subprocesses (signals, exit codes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from train_util import ROOT, cli, tiny_cfg, write_yaml

from oomdoctor.errors import BadInput
from oomdoctor.train.rundir import LOCK_NAME, check_space, open_run_dir


def _train(cfg, **kw):
    from oomdoctor.train.loop import train

    return train(cfg, **kw)


# -- the run directory (unit level: no training) -------------------------------------------------------------------


def test_output_dir_that_is_a_file_or_under_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("mine")
    with pytest.raises(BadInput, match="is a file"):
        open_run_dir(f, resume=False, overwrite=False)
    with pytest.raises(BadInput, match="cannot be created"):
        open_run_dir(f / "sub", resume=False, overwrite=False)
    assert f.read_text() == "mine"


def test_non_empty_run_dir_refused_overwrite_keeps_foreign_files(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "notes.txt").write_text("my notes")
    (out / ".tmp-checkpoint-7").mkdir()
    with pytest.raises(BadInput, match="already holds a run") as e:
        open_run_dir(out, resume=False, overwrite=False)
    assert "--resume" in e.value.hint and "--overwrite" in e.value.hint
    assert (out / "checkpoint-5").is_dir() and not (out / LOCK_NAME).exists()  # nothing touched, lock released
    said: list[str] = []
    with open_run_dir(out, resume=False, overwrite=True, emit=said.append):
        assert (out / LOCK_NAME).exists()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert any("temporary" in m for m in said) and any("--overwrite" in m for m in said)


def test_a_checkpoint_an_interrupted_re_save_moved_aside_is_put_back(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / ".old-checkpoint-6-4242").mkdir()  # the re-save of step 6 died between its two renames
    (out / ".old-checkpoint-6-4242" / "model.safetensors").write_text("weights")
    (out / ".old-checkpoint-5-4242").mkdir()  # checkpoint-5 landed: this copy is garbage
    said: list[str] = []
    with open_run_dir(out, resume=True, overwrite=False, emit=said.append):
        pass
    assert (out / "checkpoint-6" / "model.safetensors").read_text() == "weights"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5", "checkpoint-6"]
    assert any("restored checkpoint-6" in m for m in said)


def test_a_moved_aside_checkpoint_counts_as_the_run_it_belongs_to(tmp_path):
    """Put back before the directory is judged: alone it is a run to refuse, and --overwrite removes it with the
    rest (left in place, the old run's step 5 would outrank the new run's checkpoints in the rotation)."""
    out = tmp_path / "out"
    (out / ".old-checkpoint-5-999").mkdir(parents=True)
    with pytest.raises(BadInput, match="already holds a run"):
        open_run_dir(out, resume=False, overwrite=False)
    assert (out / "checkpoint-5").is_dir()
    (out / "summary.json").write_text("{}")
    (out / ".old-checkpoint-7-999").mkdir()
    with open_run_dir(out, resume=False, overwrite=True):
        pass
    assert [p.name for p in out.iterdir()] == []


def test_lock_refuses_a_live_run_and_takes_over_a_dead_ones(tmp_path):
    out = tmp_path / "out"
    with open_run_dir(out, resume=False, overwrite=False):
        with pytest.raises(BadInput, match="in use by another run"):
            open_run_dir(out, resume=True, overwrite=False)
    assert not (out / LOCK_NAME).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (out / LOCK_NAME).write_text(f"{dead.pid} {socket.gethostname()}\n")
    said: list[str] = []
    with open_run_dir(out, resume=True, overwrite=False, emit=said.append):
        assert (out / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    assert any("stale lock" in m for m in said)
    # after a torchrun restart the dead holder is the previous attempt: taken over without a word
    (out / LOCK_NAME).write_text(f"{dead.pid} {socket.gethostname()}\n")
    quiet: list[str] = []
    with open_run_dir(out, resume=True, overwrite=False, emit=quiet.append, restarted=True):
        assert (out / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    assert not any("stale lock" in m for m in quiet)


def test_not_enough_space_for_one_checkpoint_is_refused(tmp_path):
    check_space(tmp_path, 1)
    with pytest.raises(BadInput, match="one checkpoint needs"):
        check_space(tmp_path, 2**62)


# -- real runs ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_second_run_refused_then_overwrite_and_outputs_load(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    cfg = tiny_cfg(out, max_steps=2)
    r = _train(cfg)
    assert r.loss_tokens > 0 and r.output_dir == str(out)
    # the final model is HF-loadable from output_dir: model + config + tokenizer
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.num_parameters() == r.num_params and tok("hello")["input_ids"]
    assert (out / "checkpoint-2" / "trainer_state.json").exists()
    with pytest.raises(BadInput, match="already holds a run"):
        _train(cfg)
    r2 = _train(cfg, overwrite=True)
    assert r2.optimizer_steps == 2


@pytest.mark.slow
def test_lora_output_is_a_peft_adapter(tmp_path):
    from peft import PeftConfig, PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "out"
    cfg = tiny_cfg(out, max_steps=1, method="lora")
    _train(cfg)
    pc = PeftConfig.from_pretrained(out)
    assert pc.peft_type.value == "LORA"
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / cfg.model.config))
    model = PeftModel.from_pretrained(base, out)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0


@pytest.mark.slow
def test_resume_lists_changed_settings_allows_max_steps_and_falls_back_past_a_corrupt_checkpoint(tmp_path):
    out = tmp_path / "out"
    cfg = tiny_cfg(out, max_steps=2, save_steps=1, save_total_limit=None)
    _train(cfg)
    with pytest.raises(BadInput) as e:
        _train(replace(cfg, learning_rate=cfg.learning_rate * 2, seed=cfg.seed + 1), resume=True)
    assert "learning_rate" in str(e.value) and "seed" in str(e.value) and "different run" in str(e.value)
    # the newest checkpoint is truncated (a full disk, a killed copy): the one before is used, with a message
    (out / "checkpoint-2" / "model.safetensors").write_bytes(b"")
    (out / "checkpoint-1" / "rng_state.pth").write_bytes(b"")
    said: list = []
    with pytest.raises(BadInput, match="no readable checkpoint|unreadable"):
        _train(replace(cfg, max_steps=3), resume=True, on_event=said.append)
    # a good older checkpoint is used when only the newest is broken
    _train(replace(cfg, max_steps=2), overwrite=True)
    (out / "checkpoint-2" / "model.safetensors").write_bytes(b"")
    said = []
    r = _train(replace(cfg, max_steps=3), resume=True, on_event=said.append)
    assert r.resumed_from.endswith("checkpoint-1") and r.optimizer_steps == 3
    assert any("unreadable" in m.get("message", "") for m in said)


@pytest.mark.slow
def test_ctrl_c_saves_at_the_step_boundary_exits_130_and_resume_finishes(tmp_path):
    out = tmp_path / "out"
    cfg_path = write_yaml(tmp_path / "c.yaml", tiny_cfg(out, max_steps=400, save_steps=0, logging_steps=1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "oomdoctor", "train", str(cfg_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = ""
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stderr.readline()
        seen += line
        if "step 2/400" in line:
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    err = seen + err
    assert p.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and not (out / LOCK_NAME).exists()
    step = int(ckpts[0].name.split("-")[1])
    assert step >= 2
    r = cli("train", cfg_path, "--resume", "--max-steps", str(step + 1), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["optimizer_steps"] == step + 1


@pytest.mark.slow
def test_cli_messages_for_a_taken_dir_and_bad_numbers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-3").mkdir()
    cfg_path = write_yaml(tmp_path / "c.yaml", tiny_cfg(out))
    p = cli("train", cfg_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--overwrite" in p.stderr
    assert (out / "checkpoint-3").is_dir()
    text = Path(cfg_path).read_text()
    for bad in (".nan", ".inf"):
        bad_path = tmp_path / f"bad{bad}.yaml"
        bad_path.write_text(text.replace("learning_rate: ", f"learning_rate: {bad} #"))
        p = cli("train", bad_path, "--dry-run")
        assert p.returncode == 2 and "learning_rate" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_resume_after_editing_the_model_config_is_refused_before_loading(tmp_path):
    import json
    import shutil

    conf = tmp_path / "config.json"
    shutil.copy(ROOT / tiny_cfg(tmp_path).model.config, conf)
    out = tmp_path / "out"
    cfg = tiny_cfg(out, max_steps=1)
    cfg = replace(cfg, model=replace(cfg.model, config=str(conf)))
    _train(cfg)
    c = json.loads(conf.read_text())
    c["intermediate_size"] = 2 * c["intermediate_size"]
    conf.write_text(json.dumps(c))
    with pytest.raises(BadInput, match="different run") as e:
        _train(replace(cfg, max_steps=2), resume=True)
    assert "model.shape" in str(e.value) and "intermediate_size" in str(e.value)


@pytest.mark.slow
def test_fp16_skipped_updates_neither_count_nor_move_the_scheduler(tmp_path, monkeypatch):
    """A GradScaler starting at 2^40 overflows the fp16 backward for the first steps: those updates are skipped
    by the scaler, and the run still does exactly max_steps real updates with the scheduler moved once per update."""
    import torch

    real_init = torch.amp.GradScaler.__init__

    def huge_scale(self, *a, **kw):
        kw["init_scale"] = 2.0**40
        real_init(self, *a, **kw)

    monkeypatch.setattr(torch.amp.GradScaler, "__init__", huge_scale)
    lrs: list[float] = []
    res = _train(
        tiny_cfg(tmp_path / "out", max_steps=3, precision="fp16-mixed", lr_scheduler_type="linear", logging_steps=1),
        on_event=lambda e: lrs.append(e["lr"]) if e["type"] == "step" else None,
    )
    skipped = [n for n in res.notes if "skipped" in n]
    assert skipped and int(skipped[0].split()[0]) >= 1
    assert res.optimizer_steps == 3 and len(res.losses) == 3
    lr0 = tiny_cfg(tmp_path).learning_rate
    assert lrs == pytest.approx([lr0 * 2 / 3, lr0 / 3, 0.0])  # linear decay over 3 real updates, no warm-up


def test_a_restart_without_this_launchs_oom_marker_continues_nothing(tmp_path, monkeypatch):
    """torchrun restarts a job after any failure. Only an OOM marker of this launch makes the restart resume; a
    restart after anything else (a rank killed before rank 0 checked the directory) opens the directory as a first
    attempt does: an earlier run there is refused, not continued and rotated away. A marker left by an earlier
    launch under a reused run id is not this launch's."""
    from oomdoctor.train import restart

    out = tmp_path / "out"
    first = _train(tiny_cfg(out, max_steps=2))
    restart.write_marker(
        out,
        restart.OOMRestart(
            step=1,
            failed_micro_batch=4,
            new_micro_batch=2,
            phase="forward",
            message="CUDA out of memory",
            rank=0,
            run_id="old",
            attempt=0,
        ),
    )
    before = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "new")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(BadInput, match="already holds a run"):
        _train(tiny_cfg(out, max_steps=4))
    assert {
        str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")
    } == before and first.optimizer_steps == 2


def test_a_home_relative_output_dir_is_one_directory(tmp_path, monkeypatch):
    """``output_dir: ~/...`` names one directory for the lock, the checkpoints and the outputs (checkpoints went to
    a literal ``./~`` while the lock and outputs went to $HOME)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    r = _train(tiny_cfg("~/run", max_steps=2))
    run = tmp_path / "home" / "run"
    assert r.output_dir == str(run) and (run / "checkpoint-2").is_dir() and not (tmp_path / "~").exists()
