"""`oomdoctor tune`: capacity, margins, divisibility, verification, the JSON contract, the emitted config, the CLI."""

from __future__ import annotations

import json

import pytest

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput, DoesNotFit
from oomdoctor.gpu import GpuInfo
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.plan import Plan
from oomdoctor.plan.budget import resolve_budget
from oomdoctor.tune.emit import default_output_path, write_config
from oomdoctor.tune.result import ALLOC_CONF
from oomdoctor.tune.tuner import tune
from oomdoctor.tune.verify import Trial, verify


def _gpu(free: int, total: int = 24 * 10**9, others: int = 0) -> GpuInfo:
    return GpuInfo(
        index=0,
        name="NVIDIA GeForce RTX 4090",
        total_bytes=total,
        free_bytes=free,
        used_bytes=total - free,
        used_by_others_bytes=others,
        other_processes=((4242, others),) if others else (),
    )


# ------------------------------------------------------------------------------------------- capacity


def test_tune_without_capacity_is_bad_input(tiny_spec):
    with pytest.raises(BadInput) as e:
        tune(tiny_spec, gpu=None, verify_mode="none")
    assert "--gpu-mem" in e.value.message + (e.value.hint or "")


def test_tune_uses_free_memory_of_the_detected_gpu(tiny_spec):
    r = tune(tiny_spec, gpu=_gpu(free=2 * 10**9, others=3 * 10**9), seq_len=128, global_batch=8, verify_mode="none")
    assert r.capacity_bytes == 2 * 10**9 and r.capacity_source == "nvml free"
    assert any("other process" in n for n in r.notes)
    r = tune(tiny_spec, gpu_mem=80 * 10**9, gpu=_gpu(free=2 * 10**9), seq_len=128, global_batch=8, verify_mode="none")
    assert r.capacity_bytes == 80 * 10**9 and any("more than" in n for n in r.notes)


# ------------------------------------------------------------------------------------------- search + divisibility


def test_tune_tiny_exact_global_batch_and_budget(tiny_spec):
    cap = estimate(tiny_spec, Plan(method="full", seq_len=256, micro_batch=5, grad_accum=2), "analytic").peak_device
    r = tune(tiny_spec, gpu_mem=cap, seq_len=256, global_batch=24, margin=0.0, gpu=None, verify_mode="none")
    assert r.plan.micro_batch * r.plan.grad_accum == 24
    assert 24 % r.plan.micro_batch == 0
    assert r.memory.resident_device <= r.budget_bytes == cap
    assert r.batch.max_micro_batch >= r.plan.micro_batch
    # the memory model agrees: one more divisor up would not fit (or the micro-batch is the whole global batch)
    bigger = [d for d in (1, 2, 3, 4, 6, 8, 12, 24) if d > r.plan.micro_batch]
    if bigger:
        nxt = estimate(tiny_spec, r.plan.with_(micro_batch=bigger[0], grad_accum=24 // bigger[0]), "analytic")
        assert nxt.resident_device > r.budget_bytes or r.batch.max_micro_batch < bigger[0]


def test_tune_says_when_divisibility_costs_size(tiny_spec):
    plan = Plan(method="full", precision="fp32", seq_len=256)
    # a capacity where the memory model's largest micro-batch (at accumulation >= 2) is 7
    cap7 = estimate(tiny_spec, plan.with_(micro_batch=7, grad_accum=2), "analytic").peak_device
    cap8 = estimate(tiny_spec, plan.with_(micro_batch=8, grad_accum=2), "analytic").peak_device
    r = tune(
        tiny_spec,
        gpu_mem=(cap7 + cap8) // 2,
        margin=0.0,
        seq_len=256,
        global_batch=32,
        pins={"method": "full", "precision": "fp32", "optimizer": "adamw", "gradient_checkpointing": False},
        gpu=None,
        verify_mode="none",
    )
    assert r.batch.max_micro_batch == 7
    assert (r.plan.micro_batch, r.plan.grad_accum) == (4, 8)
    assert any("largest micro-batch that fits is 7" in n for n in r.notes)


def test_tune_global_smaller_than_max_and_no_global(tiny_spec):
    r = tune(tiny_spec, gpu_mem=10**9, seq_len=64, global_batch=3, gpu=None, verify_mode="none")
    assert (r.plan.micro_batch, r.plan.grad_accum) == (3, 1)
    r = tune(tiny_spec, gpu_mem=10**9, seq_len=64, gpu=None, verify_mode="none", micro_limit=64)
    assert r.plan.grad_accum == 1 and r.global_batch is None
    assert any("no --global-batch" in n for n in r.notes)


@pytest.mark.parametrize("bad", [0, -1, True])
def test_tune_rejects_bad_global_batch(tiny_spec, bad):
    with pytest.raises(BadInput):
        tune(tiny_spec, gpu_mem=10**9, global_batch=bad, gpu=None, verify_mode="none")


def test_margin_shrinks_the_plan(tiny_spec):
    plan = Plan(method="full", precision="fp32", seq_len=256, micro_batch=32, grad_accum=2)
    cap = estimate(tiny_spec, plan, "analytic").peak_device
    kw = dict(
        gpu_mem=cap,
        seq_len=256,
        global_batch=64,
        gpu=None,
        verify_mode="none",
        pins={"method": "full", "precision": "fp32", "gradient_checkpointing": False, "optimizer": "adamw"},
    )
    small = tune(tiny_spec, **kw)  # the default margin: 0 bytes
    large = tune(tiny_spec, margin=0.03, **kw)
    assert small.budget.margin_bytes == 0 and small.budget_bytes == cap
    assert small.batch.max_micro_batch == 32
    assert large.budget.margin_bytes == round(0.03 * cap) and large.budget_bytes == cap - round(0.03 * cap)
    assert large.batch.max_micro_batch < small.batch.max_micro_batch
    # the same margin as a percentage or a size: the same bytes, the same plan
    pct = tune(tiny_spec, margin="3%", **kw)
    size = tune(tiny_spec, margin=f"{round(0.03 * cap)}B", **kw)
    assert pct.budget_bytes == size.budget_bytes == large.budget_bytes
    assert (pct.budget.margin_form, size.budget.margin_form) == ("percent", "size")
    assert pct.plan == size.plan == large.plan
    with pytest.raises(BadInput):
        tune(tiny_spec, margin=0.95, **kw)


def test_does_not_fit_is_exit_3(tiny_spec):
    with pytest.raises(DoesNotFit) as e:
        tune(tiny_spec, gpu_mem=10**5, seq_len=256, gpu=None, verify_mode="none")
    assert e.value.exit_code == 3 and "--seq-len" in (e.value.hint or "")


def test_method_pin_and_prefer_speed(tiny_spec):
    r = tune(tiny_spec, gpu_mem=10**9, seq_len=128, global_batch=8, method="qlora", gpu=None, verify_mode="none")
    assert r.plan.method == "qlora"
    q = tune(tiny_spec, gpu_mem=10**9, seq_len=128, global_batch=8, gpu=None, verify_mode="none")
    s = tune(tiny_spec, gpu_mem=10**9, seq_len=128, global_batch=8, gpu=None, verify_mode="none", prefer="speed")
    assert q.plan.method == "full"
    assert s.throughput.tokens_per_s >= q.throughput.tokens_per_s


# ------------------------------------------------------------------------------------------- verification


def test_simulated_verification_is_recorded(tiny_spec):
    r = tune(
        tiny_spec,
        gpu_mem=10**9,
        seq_len=128,
        global_batch=8,
        gpu=None,
        verify_mode="simulate",
        pins={"method": "lora", "precision": "bf16-mixed", "optimizer": "adamw", "gradient_checkpointing": True},
    )
    assert r.verification == "simulate"
    assert r.trials and r.trials[-1].outcome == "fits" and r.trials[-1].verified_by == "simulate"
    assert r.trials[-1].measured_peak_bytes <= r.budget_bytes
    assert any("simulated engine" in n for n in r.notes)
    assert r.measured_peak_bytes == r.trials[-1].measured_peak_bytes


def test_verify_steps_down_and_falls_back_with_a_real_engine_prober(tiny_spec):
    """A prober whose per-sample memory is 30% above the analytic model's: verification must step down to a
    divisor that really fits (by that measurement), recording every trial."""
    from oomdoctor.tune.search import search

    plans = [Plan(method="full", precision="fp32", seq_len=128)]
    budget = estimate(tiny_spec, plans[0].with_(micro_batch=16, grad_accum=2), "analytic").peak_device
    res = search(
        tiny_spec,
        plans,
        resolve_budget(budget, None, None),
        global_batch=32,
        estimator=lambda s, p: estimate(s, p, "analytic"),
    )

    def pred(p):
        return estimate(tiny_spec, p.with_(grad_accum=min(p.grad_accum, 2)), "analytic").peak_device

    def real_peak(plan):
        base = pred(plan.with_(micro_batch=1, grad_accum=2))
        return int(base + 1.3 * (pred(plan) - base))

    def prober(plan, micro):
        real = real_peak(plan)
        ok = real <= budget
        return Trial(
            micro,
            plan.grad_accum,
            "fits" if ok else "oom",
            "test",
            plan.label(),
            pred(plan),
            measured_peak_bytes=real if ok else None,
        )

    cand, plan, trials = verify(
        res.fitting, prober, global_batch=32, limit=budget, capacity=budget, predicted_peak=pred
    )
    assert trials[0].outcome == "oom" and trials[-1].outcome == "fits"
    assert plan.micro_batch < res.best.plan.micro_batch and 32 % plan.micro_batch == 0
    assert plan.micro_batch * plan.grad_accum == 32
    assert real_peak(plan) <= budget
    assert real_peak(plan.with_(micro_batch=plan.micro_batch * 2)) > budget  # the largest divisor that fits


def test_probe_in_process_on_cpu_with_cap(tiny_config_path):
    """What the probe's child runs, in-process on CPU with the LiveBytes cap: failures become results, not raises."""
    from oomdoctor.engines.probe import probe_in_process

    plan = Plan(method="full", precision="fp32", seq_len=64, micro_batch=2, grad_accum=2)
    ok = probe_in_process(tiny_config_path, plan, device="cpu", cap_bytes=10**9)
    assert ok.outcome == "fits" and ok.steps == 2 and ok.peak_allocated_bytes > 0
    oom = probe_in_process(tiny_config_path, plan, device="cpu", cap_bytes=ok.peak_allocated_bytes // 2)
    assert oom.outcome == "oom" and "out of memory" in oom.message and oom.steps < 2
    bad = probe_in_process(tiny_config_path + ".missing", plan, device="cpu", cap_bytes=10**9)
    assert bad.outcome == "error"


@pytest.mark.slow
def test_probe_child_process_on_cpu_with_cap(tiny_config_path):
    """The GPU probe's child-process path, run on CPU with the LiveBytes cap (a fresh interpreter per trial)."""
    from oomdoctor.engines.probe import run_probe

    plan = Plan(method="full", precision="fp32", seq_len=64, micro_batch=2, grad_accum=2)
    ok = run_probe(tiny_config_path, plan, device="cpu", cap_bytes=10**9, timeout_s=300)
    assert ok.outcome == "fits" and ok.steps == 2 and ok.peak_allocated_bytes > 0
    crashed = run_probe(tiny_config_path, plan, device="cpu", python="false", timeout_s=30)  # child dies: no result
    assert crashed.outcome == "error" and "exit code" in crashed.message


@pytest.mark.gpu
def test_gpu_verification_probes_in_a_child(tiny_config_path):
    """On a CUDA machine: the chosen plan runs for real in a child process, capped at the planned capacity."""
    from oomdoctor.gpu import detect_gpu

    gpu = detect_gpu()
    assert gpu is not None
    r = tune(
        tiny_config_path,
        gpu_mem=min(gpu.free_bytes, 4 * 10**9),
        seq_len=128,
        global_batch=8,
        gpu=gpu,
        verify_mode="gpu",
        margin=0.1,
    )
    assert r.verification == "gpu"
    t = r.trials[-1]
    assert t.verified_by == "gpu" and t.outcome == "fits" and t.steps == 2
    assert t.measured_peak_bytes and t.measured_peak_allocated_bytes
    assert t.measured_peak_bytes <= r.capacity_bytes


# ------------------------------------------------------------------------------------------- JSON contract + emit


def test_json_contract(tiny_spec, tmp_path):
    r = tune(
        tiny_spec,
        gpu_mem=10**9,
        seq_len=128,
        global_batch=16,
        gpu=None,
        verify_mode="simulate",
        pins={"method": "lora", "gradient_checkpointing": False, "optimizer": "adamw", "precision": "bf16-mixed"},
    )
    write_config(r, "bundled:tiny/model/config.json", tmp_path / "plan.yaml")
    d = json.loads(json.dumps(r.to_dict()))
    assert {"plan", "memory", "trials", "config_path"} <= set(d)
    assert d["budget"] == {
        "capacity_bytes": 10**9,
        "source": "--gpu-mem",
        "margin_bytes": 0,
        "margin_form": "default",
        "limit_bytes": 10**9,
        "counted": "resident_device",
    }
    assert d["margin_bytes"] == 0 and d["budget_bytes"] == 10**9
    assert d["plan"]["micro_batch_size"] * d["plan"]["gradient_accumulation_steps"] == 16
    assert d["plan"]["effective_batch_size"] == 16
    dummy = MemoryBreakdown(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0).to_dict()
    assert set(d["memory"]) == set(dummy)  # same keys as diagnose
    for t in d["trials"]:
        assert {"micro_batch", "outcome", "measured_peak_bytes"} <= set(t)
    assert d["config_path"] == str(tmp_path / "plan.yaml")
    assert d["pytorch_cuda_alloc_conf"] == ALLOC_CONF
    assert d["command"].startswith(f"PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} oomdoctor train ")


def test_emitted_config_loads_and_matches_the_plan(tiny_spec, tmp_path):
    from oomdoctor.train.config import load_train_config

    r = tune(tiny_spec, gpu_mem=10**9, seq_len=128, global_batch=12, gpu=None, verify_mode="none", method="lora")
    out = write_config(r, "bundled:tiny/model/config.json", tmp_path / "sub" / "plan.yaml")
    cfg = load_train_config(out)
    assert cfg.micro_batch_size == r.plan.micro_batch
    assert cfg.gradient_accumulation_steps == r.plan.grad_accum
    assert cfg.global_batch_size == 12
    assert cfg.gpu_mem == 10**9
    assert cfg.model.init == "random"  # a bare config: random-init smoke run
    p = cfg.to_plan()
    assert (p.method, p.precision, p.optimizer, p.gradient_checkpointing) == (
        r.plan.method,
        r.plan.precision,
        r.plan.optimizer,
        r.plan.gradient_checkpointing,
    )
    text = out.read_text()
    assert "oomdoctor tune" in text and "point it at your data" in text
    # bundled files keep their bundled: names (they resolve after a wheel install, from any directory)
    assert "config: bundled:tiny/model/config.json" in text and "path: bundled:tiny/train.jsonl" in text
    # never overwrite silently
    with pytest.raises(BadInput):
        write_config(r, "bundled:tiny/model/config.json", out)
    write_config(r, "bundled:tiny/model/config.json", out, overwrite=True)
    assert not list(out.parent.glob(".*.tmp"))  # atomic write leaves no temp file


def test_default_output_path_never_overwrites(tmp_path):
    p1 = default_output_path(tmp_path)
    assert p1.name == "oomdoctor-plan.yaml"
    p1.write_text("x")
    assert default_output_path(tmp_path).name == "oomdoctor-plan-2.yaml"


# ------------------------------------------------------------------------------------------- CLI


def _cli(args, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from oomdoctor.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("oomdoctor.tune.tuner.detect_gpu", lambda: None)
    return CliRunner().invoke(app, args)


def test_cli_llama7b_24gb_json_and_train_dry_run(monkeypatch, tmp_path):
    """The issue's done-when command (offline, bundled config), then `oomdoctor train CONFIG --dry-run`."""
    res = _cli(
        [
            "tune",
            "meta-llama/Llama-2-7b-hf",
            "--gpu-mem",
            "24GB",
            "--seq-len",
            "1024",
            "--global-batch",
            "32",
            "--verify",
            "none",
            "--json",
        ],
        monkeypatch,
        tmp_path,
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["plan"]["micro_batch_size"] * d["plan"]["gradient_accumulation_steps"] == 32
    assert d["memory"]["resident_device_bytes"] <= d["budget_bytes"]
    path = tmp_path / "oomdoctor-plan.yaml"
    assert d["config_path"] == "oomdoctor-plan.yaml" and path.exists()
    dry = _cli(["train", str(path), "--dry-run"], monkeypatch, tmp_path)
    assert dry.exit_code == 0, dry.output


def test_seq_len_max_finds_the_longest_context_and_the_yaml_passes_the_dry_run(monkeypatch, tmp_path):
    from oomdoctor.engines import estimate as price
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan.budget import resolve_budget as rb

    # --no-tiled-mlp: the formulas alone (tiled plans replay blocks: test_seq_len_max_tiles_the_mlp_past_the_longest)
    res = _cli(
        [
            "tune",
            "meta-llama/Llama-3.1-8B",
            "--gpu-mem",
            "80GB",
            "--seq-len",
            "max",
            "--verify",
            "none",
            "--no-tiled-mlp",
            "--json",
        ],
        monkeypatch,
        tmp_path,
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    s, plan = d["plan"]["seq_len"], d["plan"]
    assert s > 32768 and s % 64 == 0 and plan["micro_batch_size"] == 1 and plan["loss"] == "chunked"
    # the boundary: 64 more tokens of the same plan do not fit
    spec, budget = load_spec("meta-llama/Llama-3.1-8B"), rb(80 * 10**9, None, None)
    from oomdoctor.plan.techniques import TECHNIQUES

    chosen = Plan(
        **{
            t.name: (tuple(plan[t.setting]) if isinstance(plan[t.setting], list) else plan[t.setting])
            for t in TECHNIQUES
        }
    )
    assert budget.fits(price(spec, chosen)) and not budget.fits(price(spec, chosen.with_(seq_len=s + 64)))
    dry = _cli(["train", str(tmp_path / "oomdoctor-plan.yaml"), "--dry-run"], monkeypatch, tmp_path)
    assert dry.exit_code == 0, dry.output
    bad = _cli(["tune", "meta-llama/Llama-3.1-8B", "--gpu-mem", "80GB", "--seq-len", "long"], monkeypatch, tmp_path)
    assert isinstance(bad.exception, BadInput)  # exit 2 through oomdoctor.cli.main


def test_host_mem_lets_offload_plans_reach_longer_contexts(monkeypatch, tmp_path):
    """Offload plans must fit the training machine's CPU RAM: this machine's unless --host-mem names another's.
    Offloading the checkpointed activations (unsloth's offloaded gradient checkpointing) needs host RAM for every
    block input of a long sequence; with it the longest context grows."""
    monkeypatch.setattr("oomdoctor.tune.tuner.host_ram_bytes", lambda: 16 * 2**30)
    args = [
        "tune",
        "meta-llama/Llama-3.1-8B",
        "--gpu-mem",
        "80GB",
        "--method",
        "qlora",
        "--seq-len",
        "max",
        "--verify",
        "none",
        "--no-tiled-mlp",
        "--json",
    ]
    here = _cli(args, monkeypatch, tmp_path)
    big = _cli(args + ["--host-mem", "512GB", "--output", str(tmp_path / "big.yaml")], monkeypatch, tmp_path)
    assert here.exit_code == 0 and big.exit_code == 0, (here.output, big.output)
    small, large = json.loads(here.stdout)["plan"], json.loads(big.stdout)["plan"]
    assert not small["offload_activations"] and large["offload_activations"]
    # longer by half, or as far as the model's positions go (131,072 on Llama-3.1-8B)
    assert large["seq_len"] > 1.5 * small["seq_len"] or large["seq_len"] == 131072 > small["seq_len"]
    text = _cli(
        [a for a in args if a != "--json"] + ["--host-mem", "512GB", "--force", "--output", str(tmp_path / "big.yaml")],
        monkeypatch,
        tmp_path,
    )
    assert "of host RAM per node (checked against --host-mem)" in " ".join(text.stdout.split()), text.stdout
    assert isinstance(_cli(args + ["--host-mem", "512"], monkeypatch, tmp_path).exception, BadInput)  # no unit


@pytest.mark.heavy  # --seq-len max from the CLI: the test before; tiles on every stack: test_search_pins.py
def test_seq_len_max_tiles_the_mlp_past_the_longest_untiled_context(monkeypatch, tmp_path):
    """The longest plans are bisected again with tiled MLPs (their blocks replayed): on Llama-3.2-1B QLoRA with a
    24 GB card the tiled plan reaches further than any untiled one, within the host RAM its offload needs; the
    emitted YAML runs the tiled MLP (train --dry-run accepts it)."""
    monkeypatch.setattr("oomdoctor.tune.tuner.host_ram_bytes", lambda: 64 * 2**30)
    args = [
        "tune",
        "meta-llama/Llama-3.2-1B",
        "--gpu-mem",
        "24GB",
        "--method",
        "qlora",
        "--seq-len",
        "max",
        "--verify",
        "none",
        "--json",
    ]
    plain = _cli(args + ["--no-tiled-mlp", "--output", str(tmp_path / "plain.yaml")], monkeypatch, tmp_path)
    tiled = _cli(args, monkeypatch, tmp_path)
    assert plain.exit_code == 0 and tiled.exit_code == 0, (plain.output, tiled.output)
    a, b = json.loads(plain.stdout)["plan"], json.loads(tiled.stdout)["plan"]
    assert not a["tiled_mlp"] and b["tiled_mlp"] and b["seq_len"] > 1.3 * a["seq_len"]
    dry = _cli(["train", str(tmp_path / "oomdoctor-plan.yaml"), "--dry-run"], monkeypatch, tmp_path)
    assert dry.exit_code == 0, dry.output


def test_a_longest_context_that_fails_verification_is_calibrated_down():
    """--seq-len max when the replay finds the memory model's longest context over the budget: the overshoot it
    measured scales the model, and the longest sequence that fits then is searched again (below the failed one, at
    the boundary: 64 tokens more do not fit); tune verifies that length in a second pass."""
    from oomdoctor.engines import estimate as price
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan.budget import resolve_budget as rb
    from oomdoctor.tune.longest import calibrated_context

    spec, budget = load_spec("meta-llama/Llama-3.1-8B"), rb(80 * 10**9, None, None)
    plan = Plan(method="qlora", precision="bf16", gradient_checkpointing=True, loss="chunked").with_()
    failed = 65536
    predicted = budget.needed(price(spec, plan.with_(seq_len=failed)))
    trial = Trial(1, 1, "oom", "simulate", plan.label(), predicted, int(predicted * 1.1))
    s = calibrated_context(spec, plan, budget, price, [trial], failed)
    assert 0 < s < failed and s % 64 == 0
    assert budget.fits(price(spec, plan.with_(seq_len=s)), 1.1)
    assert not budget.fits(price(spec, plan.with_(seq_len=s + 64)), 1.1)


def test_cli_errors_are_one_line_exit_codes(monkeypatch, tmp_path, capsys):
    from oomdoctor.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("oomdoctor.tune.tuner.detect_gpu", lambda: None)
    for argv, code in (
        (["tune", "meta-llama/Llama-2-7b-hf", "--seq-len", "1024"], 2),  # no --gpu-mem, no GPU
        (["tune", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "lots"], 2),
        (["tune", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB", "--prefer", "fast"], 2),
        (["tune", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB", "--margin", "2"], 2),
        (["tune", "meta-llama/Llama-2-70b-hf", "--gpu-mem", "4GB", "--seq-len", "4096", "--verify", "none"], 3),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == code, argv
        err = capsys.readouterr().err
        assert "error: " in err and "Traceback" not in err
    (tmp_path / "exists.yaml").write_text("keep me")
    with pytest.raises(SystemExit) as e:
        main(["tune", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB", "--output", "exists.yaml"])
    assert e.value.code == 2 and (tmp_path / "exists.yaml").read_text() == "keep me"


def test_host_ram_reported_is_the_host_ram_the_search_checked():
    """One host-RAM rule (``search.host_bytes``): a paged AdamW whose state the card cannot hold next to the resident
    peak pages it out to the host, and ``host_per_node_bytes`` counts it, as the search did against the host RAM."""
    from oomdoctor.model.load import load_spec
    from oomdoctor.tune.search import host_bytes

    r = tune(
        load_spec("meta-llama/Llama-2-7b-hf"),
        gpu_mem=24 * 10**9,
        seq_len=1024,
        global_batch=16,
        gpu=None,
        verify_mode="none",
        host_mem=512 * 2**30,
        pins={"method": "full", "optimizer": "paged-adamw-8bit", "optimizer_in_backward": True},
    )
    spill = r.memory.paged_optimizer - r.budget.headroom(r.memory)
    assert r.memory.cpu_offloaded == 0 and spill > 0
    assert r.host_per_node_bytes == host_bytes(r.memory, r.budget, r.plan) == spill
    assert r.to_dict()["host_per_node_bytes"] == spill
