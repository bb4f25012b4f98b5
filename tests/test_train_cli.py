"""`oomdoctor train`: --dry-run exit codes (0 fits, 3 does not, with advice), the bundled run, --json summary."""

from __future__ import annotations

import json

import pytest
from train_util import TINY_YAML, cli, tiny_cfg

pytest.importorskip("oomdoctor.memory.analytic", reason="the analytic memory engine is not in this tree yet")


def test_dry_run_fits_exit_0():
    p = cli("train", TINY_YAML, "--dry-run", "--gpu-mem", "1GB", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["fits"] is True and d["capacity_bytes"] == 10**9 and d["compared"] == "peak_allocated"
    assert d["micro_batch_size"] == 8 and d["effective_batch_size"] == 16
    assert d["memory"]["peak_allocated_bytes"] == d["needed_bytes"] > 0


def test_dry_run_does_not_fit_exit_3_with_advice():
    cfg = "configs/train/tinyllama-full-24gb.yaml"
    p = cli("train", cfg, "--dry-run")  # the config's own budget (24 GB): fits
    assert p.returncode == 0, p.stdout + p.stderr
    assert "fits" in p.stdout
    p = cli("train", cfg, "--dry-run", "--gpu-mem", "12GB")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "does not fit" in p.stdout and "largest component" in p.stdout
    p = cli("train", cfg, "--dry-run", "--gpu-mem", "12GB", "--json")
    assert p.returncode == 3
    d = json.loads(p.stdout)
    assert d["fits"] is False and d["needed_bytes"] > 12 * 10**9 * 0.9
    assert d["advice"]["changes"], d["advice"]
    assert any(c["fits"] for c in d["advice"]["changes"])


def test_dry_run_bad_inputs_exit_2():
    p = cli("train", TINY_YAML, "--dry-run", "--gpu-mem", "lots")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--gpu-mem" in p.stderr
    p = cli("train", TINY_YAML, "--dry-run", "--engine", "guess")
    assert p.returncode == 2 and "--engine" in p.stderr
    p = cli("train", "no/such/config.yaml")
    assert p.returncode == 2 and "cannot read" in p.stderr


@pytest.mark.slow
def test_bundled_tiny_run_json_summary(tmp_path):
    """The bundled config trains (loss goes down) and the --json summary carries the documented keys; the
    measured peak is close to the memory model's prediction."""
    from train_util import write_yaml

    cfg_path = write_yaml(
        tmp_path / "tiny.yaml",
        tiny_cfg(
            tmp_path / "out",
            max_steps=12,
            micro_batch_size=8,
            gradient_accumulation_steps=2,
            warmup_steps=2,
            save_steps=6,
        ),
    )
    p = cli("train", cfg_path, "--json", "--max-steps", "10")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
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
        assert key in d, key
    assert d["optimizer_steps"] == 10  # --max-steps overrides the config
    assert (d["effective_batch_size"], d["micro_batch_size"], d["oom_recoveries"]) == (16, 8, 0)
    assert d["final_loss"] < d["first_loss"] - 0.5
    assert d["checkpoint"].endswith("checkpoint-10")
    pred = d["memory"]["peak_allocated_bytes"]
    assert abs(d["measured_peak_bytes"] - pred) / d["measured_peak_bytes"] < 0.25, (d["measured_peak_bytes"], pred)
    # plain progress lines when stderr is not a terminal
    assert "step 10/10" in p.stderr and "tok/s" in p.stderr and "peak" in p.stderr


def test_micro_batch_auto_uses_the_tune_search(tmp_path):
    """micro_batch_size: auto picks the largest micro-batch whose predicted live bytes fit the budget (the one rule,
    default margin 0 B), keeps the global batch exact, and the run then fits without an OOM."""
    from oomdoctor.plan.budget import resolve_budget
    from oomdoctor.train.loop import train
    from oomdoctor.train.sizing import auto_micro_batch

    cfg = tiny_cfg(tmp_path, micro_batch_size="auto", global_batch_size=16)
    picks = [
        auto_micro_batch(cfg, resolve_budget(cap, None, None, on_cpu=True))
        for cap in (6_000_000, 8_000_000, 12_000_000, 10**9)
    ]
    assert picks == sorted(picks) and picks[-1] == 16 and all(16 % m == 0 for m in picks)
    res = train(cfg, gpu_mem=8_000_000)
    assert res.micro_batch_size == picks[1] and res.effective_batch_size == 16
    assert res.oom_recoveries == 0 and res.measured_peak_bytes <= 8_000_000
    from oomdoctor.errors import BadInput

    with pytest.raises(BadInput, match="needs a memory budget"):
        train(tiny_cfg(tmp_path / "nobudget", micro_batch_size="auto", global_batch_size=16))
