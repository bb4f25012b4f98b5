"""scripts/validate_gpu.py: the GPU matrix is as specified, and the harness runs end to end on the CPU (--dry-run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "validate_gpu.py"


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("validate_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_matrix_covers_the_issue():
    vg = _load()
    rows = vg.matrix()
    assert len(rows) >= 40
    plans = [vg._plan(kw) for _m, kw in rows]
    from oomdoctor.model.load import load_spec

    sizes = {load_spec(m).num_params for m, _ in rows}
    assert min(sizes) < 1.5e9 and max(sizes) > 7.5e9
    assert {p.method for p in plans} == {"full", "lora", "qlora"}
    assert {p.gradient_checkpointing for p in plans} == {True, False}
    assert {"adamw", "adamw-8bit", "paged-adamw-8bit", "paged-adamw"} <= {p.optimizer for p in plans}
    assert min(p.seq_len for p in plans) == 512 and max(p.seq_len for p in plans) == 4096
    assert min(p.micro_batch for p in plans) == 1 and max(p.micro_batch for p in plans) == 8


@pytest.mark.slow
def test_real_bnb_layers_from_random_weights_train(tiny_spec):
    """The GPU path builds real bitsandbytes layers quantized from random weights; check it on the CPU."""
    from oomdoctor.engines.simulate import real_cpu_run
    from oomdoctor.execute.build import build_model
    from oomdoctor.plan import Plan, validate

    plan = validate(Plan(method="qlora", quant="nf4", double_quant=True, seq_len=16, lora_dropout=0.0))
    b = build_model(tiny_spec, plan, device="meta", real_quant_device="cpu")
    import bitsandbytes as bnb

    assert isinstance(b.model.get_base_model().model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    assert {p.device.type for p in b.model.parameters()} == {"cpu"}
    r = real_cpu_run(tiny_spec, plan, model=b.model, head=b.head_module, bnb_decompose=False)
    assert r.peak > r.param_bytes > 0


@pytest.mark.slow
def test_dry_run_writes_json_and_table(tmp_path):
    cp = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--limit", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert "median |err|" in cp.stdout and "simulate" in cp.stdout
    data = json.loads((tmp_path / "cpu-dry-run.json").read_text())
    assert data["summary"]["measured_plans"] == 1
    for row in data["rows"]:
        assert row["measured"]["max_allocated_bytes"] > 0
        # on the CPU the simulation replays exactly what the child measured
        assert row["predicted"]["simulate"]["error_allocated"] == 0
        assert abs(row["predicted"]["analytic"]["error_allocated"]) < 0.10


def test_refuses_without_gpu_unless_dry_run(monkeypatch):
    import torch

    vg = _load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vg.main([]) == 2
