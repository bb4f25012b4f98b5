"""CPU plans priced as CPU plans: no CUDA context, cuBLAS workspace, NCCL buffers or caching-allocator slack on a CPU
device, in both engines and every verb (diagnose, tune, train --dry-run, the run's prediction); the JSON says which
device was priced; a plan tune makes for a small CPU budget trains on the CPU within it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from train_util import cli, run_main, tiny_cfg

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput
from oomdoctor.plan import Plan, validate

TINY = "bundled:tiny/model/config.json"
OVERHEADS = ("allocator_slack", "cuda_context", "cublas_workspace", "nccl_buffers")


@pytest.mark.parametrize("engine", ["analytic", "simulate"])
def test_a_cpu_plan_carries_no_cuda_overheads_and_both_engines_agree(tiny_spec, engine):
    plan = validate(Plan(method="lora", precision="bf16-mixed", seq_len=64, micro_batch=2))
    gpu = estimate(tiny_spec, plan, engine)
    cpu = estimate(tiny_spec, plan, engine, "cpu")
    assert all(getattr(gpu, k) > 0 for k in ("allocator_slack", "cuda_context", "cublas_workspace"))
    assert all(getattr(cpu, k) == 0 for k in OVERHEADS)
    assert cpu.peak_reserved == cpu.peak_allocated and cpu.peak_device == cpu.peak_allocated + cpu.paged_optimizer
    if engine == "simulate":  # the simulated step's overheads come from the same runtime rules as the formulas'
        from oomdoctor.engines.simulate import device_overheads

        assert device_overheads(tiny_spec, plan, cpu.activations, "cpu") == dict.fromkeys(OVERHEADS, 0)


def test_several_cpu_ranks_hold_no_nccl_buffers(tiny_spec):
    plan = validate(Plan(method="full", seq_len=64, world_size=2, strategy="ddp"))
    assert estimate(tiny_spec, plan, "analytic").nccl_buffers > 0
    assert estimate(tiny_spec, plan, "analytic", "cpu").nccl_buffers == 0


def test_measure_and_unknown_devices_are_refused(tiny_spec):
    with pytest.raises(BadInput, match="--engine measure runs the step on the local CUDA GPU"):
        estimate(tiny_spec, validate(Plan(seq_len=64)), "measure", "cpu")
    with pytest.raises(BadInput, match="--device 'tpu'"):
        estimate(tiny_spec, validate(Plan(seq_len=64)), "analytic", "tpu")


def test_diagnose_device_cpu_prices_live_tensor_bytes_and_says_so(capsys):
    args = [
        "diagnose",
        TINY,
        "--method",
        "full",
        "--precision",
        "fp32",
        "--optimizer",
        "adamw",
        "--seq-len",
        "64",
        "--micro-batch",
        "4",
        "--mem",
        "8MB",
        "--json",
    ]
    code, out, err = run_main(args + ["--device", "cpu"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["device"] == "cpu" and d["budget"]["counted"] == "peak_allocated"
    for plan in d["plans"]:
        assert all(plan["memory"][f"{k}_bytes"] == 0 for k in OVERHEADS)
        assert plan["fits"] is (plan["memory"]["peak_allocated_bytes"] <= 8 * 10**6)
    plan = d["plans"][0]
    assert plan["fits"] is True
    code, out, _ = run_main(args, capsys)  # the same card as a GPU: its CUDA context alone is 512 MiB
    gpu = json.loads(out)
    assert gpu["device"] == "cuda" and not any(p["fits"] for p in gpu["plans"])
    code, out, _ = run_main(["diagnose", TINY, "--device", "cpu", "--seq-len", "64"], capsys)
    assert code == 0 and "RAM budget: none given" in out
    code, _, err = run_main(["diagnose", TINY, "--device", "tpu"], capsys)
    assert code == 2 and "--device 'tpu'" in err


def test_tune_needs_the_ram_of_a_cpu_plan_and_never_probes_a_gpu_for_it(tiny_spec):
    from oomdoctor.tune.tuner import tune

    with pytest.raises(BadInput, match="--device cpu: tune needs the RAM"):
        tune(tiny_spec, device="cpu", seq_len=64, verify_mode="none")
    with pytest.raises(BadInput, match="--verify gpu probes a CUDA GPU"):
        tune(tiny_spec, device="cpu", gpu_mem=10**8, seq_len=64, verify_mode="gpu")


def test_train_dry_run_prices_the_device_of_the_config(tmp_path):
    from oomdoctor.train.dryrun import dry_run

    cpu = dry_run(tiny_cfg(tmp_path / "o"), gpu_mem=8 * 10**6)  # tiny-cpu.yaml: device: cpu
    assert cpu.device == "cpu" and cpu.memory.cuda_context == 0 and cpu.fits is True
    assert cpu.to_dict()["device"] == "cpu" and cpu.compared == "peak_allocated"
    gpu = dry_run(replace(tiny_cfg(tmp_path / "o"), device="cuda"), gpu_mem=8 * 10**6)
    assert gpu.device == "cuda" and gpu.memory.cuda_context > 0 and gpu.fits is False


@pytest.mark.slow
def test_tune_for_a_small_cpu_budget_then_train_runs_on_the_cpu_within_it(tmp_path, capsys, monkeypatch):
    """The tiny model with 48 MB of RAM for tensors: as a GPU plan nothing fits (the CUDA context alone is 512 MiB);
    as a CPU plan tune picks one, verified by the simulated step, writes device: cpu, and `oomdoctor train` runs it
    on the CPU under that cap (the live-byte meter raises an OOM past it: none happens)."""
    monkeypatch.chdir(tmp_path)
    base = [
        "tune",
        TINY,
        "--mem",
        "48MB",
        "--seq-len",
        "64",
        "--global-batch",
        "16",
        "--dataset",
        "bundled:tiny/train.jsonl",
    ]
    code, _, err = run_main(base + ["--verify", "none"], capsys)
    assert code == 3 and "no plan fits" in err
    code, out, err = run_main(base + ["--device", "cpu", "--json", "-o", str(tmp_path / "cpu.yaml")], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["device"] == "cpu" and d["verification"] == "simulate" and d["memory"]["cuda_context_bytes"] == 0
    assert d["memory"]["peak_allocated_bytes"] <= 48 * 10**6
    assert not d["command"].startswith("PYTORCH_CUDA_ALLOC_CONF")
    text = (tmp_path / "cpu.yaml").read_text()
    assert "\ndevice: cpu" in text and "\ngpu_mem: 48000000B" in text
    (tmp_path / "cpu.yaml").write_text(text.replace("\noutput_dir: runs/train", f"\noutput_dir: {tmp_path / 'run'}"))
    p = cli("train", tmp_path / "cpu.yaml", "--max-steps", "2", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["device"] == "cpu" and s["cap_bytes"] == 48 * 10**6 and s["oom_recoveries"] == 0
    assert s["measured_peak_bytes"] <= 48 * 10**6 and s["memory"]["cuda_context_bytes"] == 0
    assert s["optimizer_steps"] == 2


def test_the_runs_own_prediction_is_for_its_device(tmp_path):
    from oomdoctor.train.loop import train

    res = train(tiny_cfg(tmp_path / "run", max_steps=1))
    assert res.device == "cpu" and res.memory["cuda_context_bytes"] == 0 and res.memory["allocator_slack_bytes"] == 0
