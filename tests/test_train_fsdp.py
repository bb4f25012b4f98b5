"""Sharded ``train`` (strategy fsdp: FSDP2) through torch's own launcher: real 2-process gloo runs on CPU, the OOM
restart across ranks, DCP checkpoints, offload_params at world size 1, and the topology checks."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
from train_util import cli, load_weights, max_abs_diff, run_json, scaleout_cfg, write_yaml

pytestmark = pytest.mark.slow


_cfg = scaleout_cfg
_run = run_json


def test_fsdp_equals_one_process_and_restarts_smaller_after_an_oom(tmp_path):
    """The same global batch gives the same losses on one process and under FSDP2 on two (both divide by the global
    token count; DDP equals one process: test_train_ddp.py); the final model is a plain HF directory with the same
    weights; an OOM on one rank (injected: OOMDOCTOR_INJECT_OOM, the mechanism of multi-gpu.md §6) restarts every
    rank from the last sharded checkpoint with half the micro-batch: same steps, same losses."""
    one = write_yaml(tmp_path / "one.yaml", _cfg(tmp_path, "one", gradient_accumulation_steps=4))
    sharded = _cfg(tmp_path, "fsdp", strategy="fsdp", save_steps=1, save_total_limit=None)
    fsdp = write_yaml(tmp_path / "fsdp.yaml", sharded)
    a, _ = _run(one)
    b, _ = _run(fsdp, "--nproc-per-node", "2")
    assert (b["world_size"], b["strategy"], b["restarts"]) == (2, "fsdp", 0)
    assert a["effective_batch_size"] == b["effective_batch_size"] == 32
    assert b["losses"] == pytest.approx(a["losses"], abs=1e-5)
    assert max_abs_diff(load_weights(tmp_path / "one"), load_weights(tmp_path / "fsdp")) < 1e-5
    assert (tmp_path / "fsdp" / "checkpoint-2" / "sharded" / ".metadata").exists()

    o, err = _run(fsdp, "--nproc-per-node", "2", "--overwrite", env_extra={"OOMDOCTOR_INJECT_OOM": "2:1"})
    assert "rank 1: out of memory at step 2" in err
    assert (o["restarts"], o["oom_recoveries"], o["optimizer_steps"]) == (1, 1, 3)
    assert (o["micro_batch_size"], o["gradient_accumulation_steps"], o["effective_batch_size"]) == (4, 4, 32)
    assert o["recoveries"][0]["restart"] and o["resumed_from"].endswith("checkpoint-1")
    assert o["losses"] == pytest.approx(b["losses"], abs=1e-5)
    assert not (tmp_path / "fsdp" / "oom-restart.json").exists()


@pytest.mark.heavy  # the restart across ranks: the test before (an injected OOM)
def test_a_per_rank_memory_cap_restarts_smaller_and_dcp_resumes_on_another_shard_layout(tmp_path):
    """A real per-rank cap (the live-bytes meter counts FSDP's resize_): micro 8 peaks at 9.3 MB per rank, micro 4
    at 5.4 MB; under 7 MiB both ranks run out in step 1's forward and torchrun restarts them with micro 4: the
    losses of the uncapped run. Its sharded checkpoint resumes exactly on another shard layout (DCP reshards;
    shard_group is safe to change)."""
    one = write_yaml(tmp_path / "one.yaml", _cfg(tmp_path, "one", gradient_accumulation_steps=4))
    sharded = _cfg(tmp_path, "fsdp", strategy="fsdp", save_steps=1, save_total_limit=None)
    fsdp = write_yaml(tmp_path / "fsdp.yaml", sharded)
    hsdp = write_yaml(tmp_path / "hsdp.yaml", replace(sharded, shard_group=1))  # same run, 2 replicas x 1 shard
    a, _ = _run(one)
    c, err = _run(fsdp, "--nproc-per-node", "2", "--gpu-mem", "7MiB")
    assert "out of memory at step 1 (forward) with micro-batch 8" in err
    assert (c["restarts"], c["micro_batch_size"], c["gradient_accumulation_steps"]) == (1, 4, 4)
    assert c["optimizer_steps"] == 3 and c["measured_peak_bytes"] <= 7 * 2**20
    assert c["losses"] == pytest.approx(a["losses"], abs=1e-5)
    shutil.rmtree(tmp_path / "fsdp" / "checkpoint-3")  # resume from the DCP checkpoint of step 2, resharded (HSDP)
    r, _ = _run(hsdp, "--nproc-per-node", "2", "--resume")
    assert r["resumed_from"].endswith("checkpoint-2") and r["losses"] == pytest.approx(c["losses"], abs=1e-6)


@pytest.mark.heavy  # FSDP2's step and DCP checkpoints: test_fsdp_equals_one_process...
def test_fsdp_lora_gradient_checkpointing_hsdp_output_loads_with_peft(tmp_path):
    """FSDP2 + LoRA + GC on an HSDP mesh (2 replicas x 1 shard) trains and saves a peft adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from oomdoctor.execute.load import ModelSource, hf_config

    cfg = _cfg(
        tmp_path,
        "lora",
        strategy="fsdp",
        method="lora",
        gradient_checkpointing=True,
        shard_group=1,
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        lora_dropout=0.1,
        save_steps=1,
        save_total_limit=None,
    )
    yaml_path = write_yaml(tmp_path / "lora.yaml", cfg)
    res, _ = _run(yaml_path, "--nproc-per-node", "2")
    assert "hsdp 2x1" in res["plan"] and res["losses"][-1] < res["losses"][0]
    shutil.rmtree(tmp_path / "lora" / "checkpoint-3")  # adapters-only DCP checkpoint; dropout RNG per rank
    again, _ = _run(yaml_path, "--nproc-per-node", "2", "--resume")
    assert again["resumed_from"].endswith("checkpoint-2") and again["losses"] == pytest.approx(res["losses"], abs=1e-6)
    base = AutoModelForCausalLM.from_config(hf_config(ModelSource(config=cfg.model.config, init="random")))
    model = PeftModel.from_pretrained(base, tmp_path / "lora")
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) == res["num_trainable_params"]


@pytest.mark.heavy  # an OOM at micro-batch 1 on one process: tests/test_train_oom.py
def test_fsdp_oom_at_micro_batch_one_exits_4_with_one_message(tmp_path):
    cfg = write_yaml(tmp_path / "m1.yaml", _cfg(tmp_path, "m1", strategy="fsdp", micro_batch_size=1))
    p = cli("train", cfg, "--nproc-per-node", "2", env_extra={"OOMDOCTOR_INJECT_OOM": "1:0"}, timeout=300)
    assert p.returncode == 4, p.stderr
    assert p.stderr.count("error: out of memory at step 1") == 1 and "Traceback" not in p.stderr


@pytest.mark.heavy  # FSDP2 on two ranks: test_fsdp_equals_one_process...
def test_offload_params_runs_fsdp_at_world_size_one(tmp_path):
    """offload_params on one process: the plan runs FSDP2 with CPUOffloadPolicy on a one-rank group; same losses as
    the plain single-process run (CPU: the offload moves nothing)."""
    one, _ = _run(write_yaml(tmp_path / "one.yaml", _cfg(tmp_path, "one")))
    off, _ = _run(write_yaml(tmp_path / "off.yaml", _cfg(tmp_path, "off", offload_params=True)))
    assert (off["strategy"], off["world_size"]) == ("fsdp", 1) and "offload:opt+params" in off["plan"]
    assert off["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert max_abs_diff(load_weights(tmp_path / "one"), load_weights(tmp_path / "off")) < 1e-5
    # one rank has no peer blocked in a collective: the guard splits in-process (FSDP reset after the OOM); the cap
    # is below the single-process peak (9.5 MiB), which FSDP at world size 1 cannot undercut
    capped, _ = _run(tmp_path / "off.yaml", "--overwrite", "--gpu-mem", "7MiB")
    assert capped["oom_recoveries"] >= 1 and capped["restarts"] == 0
    assert capped["losses"] == pytest.approx(one["losses"], abs=1e-5)


@pytest.mark.parametrize(
    "changes, flags, message",
    [
        (dict(strategy="fsdp", shard_group=3), ["--nproc-per-node", "2"], "shard_group must be a positive divisor"),
        (dict(world_size=4), ["--nproc-per-node", "2"], "world_size: 4 in the config, but this job has 2"),
        (dict(strategy="fsdp", precision="fp16-mixed"), [], "use bf16-mixed"),
    ],
)
def test_bad_topology_is_one_message_before_any_rank_starts(tmp_path, changes, flags, message):
    cfg = write_yaml(tmp_path / "bad.yaml", _cfg(tmp_path, "bad", **changes))
    p = cli("train", cfg, *flags)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and p.stderr.count("error:") == 1 and "Traceback" not in p.stderr
    assert not (tmp_path / "bad").exists()
