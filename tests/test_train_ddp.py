"""Data-parallel ``train`` through torch's own launcher: real 2-process gloo runs on CPU."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from train_util import cli, tiny_cfg, write_yaml

pytestmark = pytest.mark.slow


def _cfg(tmp_path, name: str, accum: int):
    return tiny_cfg(
        tmp_path / name,
        max_steps=3,
        micro_batch_size=8,
        gradient_accumulation_steps=accum,
        dataset=replace(tiny_cfg(tmp_path).dataset, packing=True, packing_strategy="wrapped"),
    )


def test_ddp_on_two_processes_equals_one_process_with_the_same_effective_batch(tmp_path):
    """effective batch = micro x accumulation x world size: 8 x 2 x 2 processes == 8 x 4 x 1, and the losses (which
    divide by the global token count) agree to float rounding."""
    ddp = write_yaml(tmp_path / "ddp.yaml", _cfg(tmp_path, "ddp", 2))
    one = write_yaml(tmp_path / "one.yaml", _cfg(tmp_path, "one", 4))
    p = cli("train", ddp, "--nproc-per-node", "2", "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    a = json.loads(p.stdout)
    b = json.loads(cli("train", one, "--json").stdout)
    assert (a["world_size"], a["strategy"], a["restarts"]) == (2, "ddp", 0)
    assert a["effective_batch_size"] == b["effective_batch_size"] == 32 and a["gradient_accumulation_steps"] == 2
    assert a["losses"] == pytest.approx(b["losses"], abs=1e-5)


@pytest.mark.heavy  # the split of one process: tests/test_train_oom.py
def test_a_per_rank_cap_splits_micro_batches_inside_no_sync_without_a_hang(tmp_path):
    ddp = write_yaml(tmp_path / "ddp.yaml", _cfg(tmp_path, "ddp", 2))
    one = write_yaml(tmp_path / "one.yaml", _cfg(tmp_path, "one", 4))
    b = json.loads(cli("train", one, "--json").stdout)
    c = cli("train", ddp, "--nproc-per-node", "2", "--json", "--gpu-mem", "8MB", timeout=300)
    assert c.returncode == 0, c.stderr
    capped = json.loads(c.stdout)
    assert capped["oom_recoveries"] >= 1 and capped["micro_batch_size"] < 8
    assert capped["losses"] == pytest.approx(b["losses"], abs=1e-5)


@pytest.mark.heavy  # torchrun itself runs every rank in test_ddp_on_two_processes...
def test_torchrun_module_entry_and_a_failing_rank_is_one_message(tmp_path):
    import os
    import subprocess

    from train_util import ROOT

    cfg = write_yaml(tmp_path / "c.yaml", _cfg(tmp_path, "run", 1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "oomdoctor",
            "train",
            str(cfg),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["world_size"] == 2
    # the run directory now holds a run: every rank refuses before training, one clear message, exit 2
    q = cli("train", cfg, "--nproc-per-node", "2", timeout=300)
    assert q.returncode == 2 and "already holds a run" in q.stderr and "Traceback" not in q.stderr


@pytest.mark.heavy  # Ctrl-C of one process: tests/test_train_rundir.py
def test_ctrl_c_under_the_launcher_saves_once_and_exits_130(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from train_util import ROOT

    cfg = write_yaml(tmp_path / "c.yaml", replace(_cfg(tmp_path, "run", 1), max_steps=400, logging_steps=1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "oomdoctor", "train", str(cfg), "--nproc-per-node", "2"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 180
    while time.time() < deadline and "step 2/400" not in p.stderr.readline():
        pass
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 130, err
    ckpts = list((tmp_path / "run").glob("checkpoint-*"))
    assert len(ckpts) == 1 and "--resume" in err
