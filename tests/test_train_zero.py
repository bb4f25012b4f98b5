"""DeepSpeed ZeRO-2/3 ``train`` (the optional ``deepspeed`` extra) through torch's own launcher: real 2-process gloo
runs on CPU against DDP, DeepSpeed checkpoints inside checkpoint-N, the OOM restart, and the bad inputs. The first
ZeRO run on a machine JIT-builds DeepSpeed's shm comm op (~45 s, cached in ~/.cache/torch_extensions)."""

from __future__ import annotations

import shutil
import sys

import pytest
from train_util import cli, load_weights, max_abs_diff, run_json, scaleout_cfg, write_yaml


def _cfg(tmp_path, name: str, **kw):
    return scaleout_cfg(tmp_path, name, **kw)


def _run(*args, env_extra=None):
    out, err = run_json(*args, env_extra=env_extra)
    assert "FutureWarning" not in err, err  # DeepSpeed's deprecated-collective warnings are filtered
    return out, err


@pytest.mark.slow
def test_zero2_and_zero3_equal_ddp_resume_and_restart_smaller_after_an_oom(tmp_path):
    """The same global batch gives DDP's losses and weights under ZeRO-2 and ZeRO-3 (DeepSpeed averages over the
    ranks, each rank's loss is scaled by the world size over the global token count; engine.step() is our optimizer
    step); the final model is a plain HF directory; a DeepSpeed checkpoint in checkpoint-N resumes exactly; an OOM
    on one rank (injected) restarts every rank from it with half the micro-batch: same steps, same losses."""
    pytest.importorskip("deepspeed")
    a, _ = _run(write_yaml(tmp_path / "ddp.yaml", _cfg(tmp_path, "ddp")), "--nproc-per-node", "2")
    z2 = write_yaml(tmp_path / "z2.yaml", _cfg(tmp_path, "z2", strategy="zero2", save_steps=1, save_total_limit=None))
    b, _ = _run(z2, "--nproc-per-node", "2")
    assert (b["world_size"], b["strategy"], b["restarts"]) == (2, "zero2", 0)
    assert b["losses"] == pytest.approx(a["losses"], abs=1e-5)
    assert max_abs_diff(load_weights(tmp_path / "ddp"), load_weights(tmp_path / "z2")) < 1e-5
    assert (tmp_path / "z2" / "checkpoint-2" / "deepspeed" / "zero").is_dir()

    shutil.rmtree(tmp_path / "z2" / "checkpoint-3")
    r, _ = _run(z2, "--nproc-per-node", "2", "--resume")
    assert r["resumed_from"].endswith("checkpoint-2") and r["losses"] == pytest.approx(b["losses"], abs=1e-6)

    o, err = _run(z2, "--nproc-per-node", "2", "--overwrite", env_extra={"OOMDOCTOR_INJECT_OOM": "2:1"})
    assert "rank 1: out of memory at step 2" in err
    assert (o["restarts"], o["oom_recoveries"], o["optimizer_steps"]) == (1, 1, 3)
    assert (o["micro_batch_size"], o["gradient_accumulation_steps"]) == (4, 4)
    assert o["losses"] == pytest.approx(b["losses"], abs=1e-5)

    # ZeRO-3 partitions the model every rank loaded (rank 0's weights broadcast, no zero.Init): DDP's start too
    c, _ = _run(write_yaml(tmp_path / "z3.yaml", _cfg(tmp_path, "z3")), "--nproc-per-node", "2", "--strategy", "zero3")
    assert c["strategy"] == "zero3" and c["losses"] == pytest.approx(a["losses"], abs=1e-5)
    assert max_abs_diff(load_weights(tmp_path / "ddp"), load_weights(tmp_path / "z3")) < 1e-5


@pytest.mark.slow
def test_zero3_lora_bf16_gc_with_offload_trains_and_saves_a_peft_adapter(tmp_path):
    pytest.importorskip("deepspeed")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from oomdoctor.execute.load import ModelSource, hf_config

    cfg = _cfg(
        tmp_path,
        "lora",
        strategy="zero3",
        method="lora",
        gradient_checkpointing=True,
        precision="bf16-mixed",
        offload_optimizer=True,
        offload_params=True,
        micro_batch_size=4,
        gradient_accumulation_steps=1,
    )
    res, _ = _run(write_yaml(tmp_path / "lora.yaml", cfg), "--nproc-per-node", "2")
    assert "offload:opt+params" in res["plan"] and "zero3(2)" in res["plan"]
    assert res["losses"][-1] < res["losses"][0]
    base = AutoModelForCausalLM.from_config(hf_config(ModelSource(config=cfg.model.config, init="random")))
    model = PeftModel.from_pretrained(base, tmp_path / "lora")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) == res["num_trainable_params"]
    assert any(float(p.abs().sum()) > 0 for p in lora_b)  # trained (peft starts B at zero)


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(strategy="zero2", offload_params=True), "offload_params needs strategy fsdp"),
        (dict(strategy="zero3", precision="fp16-mixed"), "DeepSpeed's fp16 runs a loss scaler"),
    ],
)
def test_bad_zero_config_is_one_message_before_any_rank_starts(tmp_path, changes, message):
    pytest.importorskip("deepspeed")
    cfg = write_yaml(tmp_path / "bad.yaml", _cfg(tmp_path, "bad", **changes))
    p = cli("train", cfg, "--nproc-per-node", "2")
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and p.stderr.count("error:") == 1 and "Traceback" not in p.stderr
    assert not (tmp_path / "bad").exists()


def test_zero_without_deepspeed_is_one_message(tmp_path, monkeypatch):
    from oomdoctor.errors import BadInput
    from oomdoctor.train.setup import resolve_topology

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(BadInput) as exc:
        resolve_topology(_cfg(tmp_path, "x", strategy="zero2"), 2)
    assert "pip install 'oomdoctor[deepspeed]'" in exc.value.hint


def test_train_and_emit_share_one_deepspeed_config(tmp_path):
    """tune --emit writes HF's ``auto`` values; train fills them, with explicit buckets either way."""
    from oomdoctor.execute.zero import ZeroRun, zero_config

    plan = _cfg(tmp_path, "x", strategy="zero3", world_size=2, precision="bf16-mixed", offload_optimizer=True).to_plan(
        micro_batch=8
    )
    emitted = zero_config(plan, 64)
    run = zero_config(plan, 64, ZeroRun(micro_batch=8, grad_accum=2, max_grad_norm=1.0, device_type="cpu"))
    assert emitted["zero_optimization"]["reduce_bucket_size"] == run["zero_optimization"]["reduce_bucket_size"] == 64**2
    assert emitted["train_micro_batch_size_per_gpu"] == "auto" and run["train_micro_batch_size_per_gpu"] == 8
    assert run["bf16"] == {"enabled": True} and run["gradient_clipping"] == 1.0
    assert run["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert emitted["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    assert run["managed_gradient_accumulation"] is False and run["zero_force_ds_cpu_optimizer"] is False
