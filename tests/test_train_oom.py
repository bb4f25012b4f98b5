"""The OOM guard under a real cap (--gpu-mem on CPU counts live tensor bytes and raises torch.OutOfMemoryError)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_util import cli, load_weights, max_abs_diff, tiny_cfg, write_yaml

from oomdoctor.errors import UnrecoverableOOM
from oomdoctor.execute.oom import GradTouch, OOMAtMicroBatchOne, OOMGuard
from oomdoctor.train.loop import train


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Undisturbed runs at micro-batch 8 (x2) and 4 (x4): same data, same effective batch 16."""
    base = tmp_path_factory.mktemp("oomref")
    r8 = train(tiny_cfg(base / "mb8", micro_batch_size=8, gradient_accumulation_steps=2))
    r4 = train(tiny_cfg(base / "mb4", micro_batch_size=4, gradient_accumulation_steps=4))
    return r8, r4


def test_split_accumulation_is_exact_without_oom(reference):
    """Token-weighted normalisation: 8x2 and 4x4 give the same step (the premise of splitting)."""
    r8, r4 = reference
    assert r8.losses == pytest.approx(r4.losses, rel=1e-5)
    assert max_abs_diff(load_weights(r8.checkpoint), load_weights(r4.checkpoint)) < 1e-5
    assert r4.measured_peak_bytes < r8.measured_peak_bytes


def test_recovered_run_equals_undisturbed_run(tmp_path, reference):
    r8, r4 = reference
    cap = (r8.measured_peak_bytes + r4.measured_peak_bytes) // 2  # micro-batch 8 cannot fit, 4 can
    res = train(tiny_cfg(tmp_path, micro_batch_size=8, gradient_accumulation_steps=2), gpu_mem=cap)
    assert res.oom_recoveries >= 1
    assert res.recoveries[0]["failed_micro_batch"] == 8 and res.recoveries[0]["new_micro_batch"] == 4
    assert res.optimizer_steps == r8.optimizer_steps == 3
    assert res.effective_batch_size == 16  # unchanged
    assert (res.micro_batch_size, res.gradient_accumulation_steps) == (4, 4)  # remembered for later steps
    assert res.oom_recoveries == 1  # step 2 and 3 ran at 4 directly
    assert res.measured_peak_bytes <= cap
    assert res.losses == pytest.approx(r8.losses, rel=1e-5)
    assert max_abs_diff(load_weights(res.checkpoint), load_weights(r8.checkpoint)) < 1e-5


@pytest.mark.slow
def test_guard_replays_step_after_partial_backward():
    """An OOM in the middle of backward (some .grad already accumulated) replays the step at the smaller size:
    the final gradient equals the unsplit one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    data = [torch.randn(8) for _ in range(8)]
    target = [torch.randn(1) for _ in range(8)]
    n = len(data)
    touch = GradTouch()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: setattr(touch, "touched", True))

    def run_chunk(idx, fail_above=None):
        x = torch.stack([data[i] for i in idx])
        y = torch.stack([target[i] for i in idx])
        h = model[1](model[0](x))
        if fail_above is not None and len(idx) > fail_above:

            def boom(g):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (test)")

            h.register_hook(boom)  # fires after the last layer's weight grad has landed
        loss = ((model[2](h) - y) ** 2).sum() / n
        touch.in_backward = True
        loss.backward()
        return float(loss.detach())

    def zero():
        model.zero_grad(set_to_none=True)

    guard = OOMGuard(micro_batch=8)
    total, _ = guard.run_step(1, list(range(8)), run_chunk, zero, touch)
    ref = [p.grad.clone() for p in model.parameters()]
    zero()
    guard = OOMGuard(micro_batch=4)
    total2, chunks = guard.run_step(1, list(range(8)), lambda c: run_chunk(c, fail_above=2), zero, touch)
    assert guard.micro_batch == 2 and chunks == 4
    rec = guard.recoveries[0]
    assert rec.replayed and rec.phase == "backward" and rec.failed_micro_batch == 4
    assert total2 == pytest.approx(total, rel=1e-6)
    for a, b in zip(ref, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # retry cap and micro-batch 1
    zero()
    with pytest.raises(OOMAtMicroBatchOne) as ei:
        OOMGuard(micro_batch=4).run_step(1, list(range(8)), lambda c: run_chunk(c, fail_above=0), zero, touch)
    assert ei.value.reason == "micro-batch 1"
    zero()
    with pytest.raises(OOMAtMicroBatchOne, match="out of memory") as ei:
        OOMGuard(micro_batch=8, max_retries=1).run_step(
            1, list(range(8)), lambda c: run_chunk(c, fail_above=1), zero, touch
        )
    assert "retry cap" in ei.value.reason


@pytest.mark.slow
def test_micro_batch_one_fails_saves_checkpoint_and_exits_4(tmp_path, reference):
    _, r4 = reference
    cap = r4.measured_peak_bytes // 3  # the weights fit, one sample's step does not
    with pytest.raises(UnrecoverableOOM) as ei:
        train(tiny_cfg(tmp_path, micro_batch_size=4, gradient_accumulation_steps=4), gpu_mem=cap)
    assert ei.value.exit_code == 4
    msg = ei.value.message
    assert "micro-batch 1" in msg and "checkpoint saved:" in msg
    ck = Path(msg.split("checkpoint saved: ")[1].splitlines()[0])
    assert ck.is_dir() and (ck / "trainer_state.json").exists()
    # fix the plan (here: a budget that fits) and resume from that checkpoint: the run completes all its steps
    saved_step = json.loads((ck / "trainer_state.json").read_text())["step"]
    res = train(tiny_cfg(tmp_path, micro_batch_size=2, gradient_accumulation_steps=8), resume=True)
    assert res.resumed_from == str(ck) and res.optimizer_steps == 3 and res.micro_batch_size == 2
    assert len(res.losses) == 3 and saved_step < 3


@pytest.mark.slow
def test_cli_gpu_mem_cap_json(tmp_path, reference):
    r8, r4 = reference
    cap = (r8.measured_peak_bytes + r4.measured_peak_bytes) // 2
    cfg_path = write_yaml(
        tmp_path / "c.yaml", tiny_cfg(tmp_path / "out", micro_batch_size=8, gradient_accumulation_steps=2)
    )
    p = cli("train", cfg_path, "--gpu-mem", f"{cap}B", "--json", "--max-steps", "2")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in (
        "optimizer_steps",
        "effective_batch_size",
        "micro_batch_size",
        "oom_recoveries",
        "measured_peak_bytes",
        "memory",
        "final_loss",
        "checkpoint",
    ):
        assert key in out
    assert out["optimizer_steps"] == 2 and out["effective_batch_size"] == 16
    assert out["micro_batch_size"] == 4 and out["oom_recoveries"] == 1
    assert "OOM at step 1" in p.stderr and "same effective batch" in p.stderr
    # unrecoverable: exit 4, one clear message, no traceback, checkpoint left behind
    p = cli("train", cfg_path, "--gpu-mem", f"{r4.measured_peak_bytes // 3}B", "--overwrite")
    assert p.returncode == 4, p.stderr
    assert "Traceback" not in p.stderr and "micro-batch 1" in p.stderr and "--resume" in p.stderr
