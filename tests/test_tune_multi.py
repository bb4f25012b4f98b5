"""`oomdoctor tune --gpus N`: the strategy ladder (DDP, FSDP/HSDP, ZeRO when asked, offload last), the per-rank
global batch, the strategies table and the emitted topology (issue 13)."""

from __future__ import annotations

import json

import pytest

from oomdoctor.cli import main
from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput, DoesNotFit
from oomdoctor.model.load import load_spec
from oomdoctor.tune.emit import render_config
from oomdoctor.tune.tuner import tune

LLAMA7B = "meta-llama/Llama-2-7b-hf"
FULL_FT = dict(method="full", precision="bf16-mixed", gradient_checkpointing=True, optimizer="adamw")


@pytest.fixture(scope="module")
def llama7b():
    return load_spec(LLAMA7B)


def _tune(spec, gpus, gpu_mem=24 * 10**9, **kw):
    pins = dict(kw.pop("pins", {}), world_size=gpus)
    return tune(spec, gpu_mem=gpu_mem, seq_len=kw.pop("seq_len", 2048), pins=pins, gpu=None, verify_mode="none", **kw)


def test_llama7b_full_ft_on_8x24gb_picks_fsdp_with_the_reason_ddp_failed(llama7b):
    """The README anchor: full FT, bf16-mixed, GC, micro 1 x 2048 on 8 x 24 GB -> FSDP (DDP needs > 108 GB)."""
    r = _tune(llama7b, 8, pins=dict(FULL_FT), global_batch=8)
    assert r.plan.strategy == "fsdp" and r.plan.world_size == 8 and r.plan.shard_group is None
    assert r.plan.micro_batch == 1 and r.plan.grad_accum == 1 and r.plan.effective_batch == 8
    assert [s.label for s in r.strategies] == ["ddp(8)", "fsdp(8)"]
    ddp, fsdp = r.strategies
    assert (
        not ddp.fits and ddp.needed_bytes > 108 * 10**9 and "ddp(8) needs" in ddp.reason and "> 22.35 GiB" in ddp.reason
    )
    assert fsdp.fits and fsdp.reason == "chosen"
    doc = r.to_dict()
    assert doc["world_size"] == 8 and doc["plan"]["world_size"] == 8 and doc["plan"]["strategy"] == "fsdp"
    assert doc["strategies"][0]["fits"] is False and doc["plan"]["effective_batch_size"] == 8
    assert r.command.endswith("--nproc-per-node 8")


def test_adapters_stay_on_ddp_when_it_fits(llama7b):
    r = _tune(llama7b, 2, pins=dict(method="lora"))
    assert r.plan.strategy == "ddp"
    assert [s.reason for s in r.strategies] == ["chosen"]
    for c in r.search.fitting:  # a LoRA stack is sharded only when its DDP rung does not fit
        if c.plan.strategy == "fsdp":
            ddp = estimate(llama7b, c.plan.with_(strategy="ddp", micro_batch=1, grad_accum=1))
            assert ddp.resident_device > r.budget.limit_bytes


def test_global_batch_is_over_every_gpu(llama7b):
    r = _tune(llama7b, 8, pins=dict(FULL_FT), global_batch=64)
    assert r.plan.micro_batch * r.plan.grad_accum * 8 == 64 == r.plan.effective_batch
    with pytest.raises(BadInput) as e:
        _tune(llama7b, 8, pins=dict(FULL_FT), global_batch=60)
    assert "56" in (e.value.hint or "") and "64" in (e.value.hint or "")


def test_several_nodes_shard_inside_a_node(llama7b):
    r = _tune(llama7b, 16, pins=dict(FULL_FT), gpus_per_node=8)
    assert r.plan.strategy == "fsdp" and r.plan.shard_group == 8
    assert "hsdp 2x8" in r.plan.label() and r.command.endswith("--nproc-per-node 8 --nnodes 2")
    with pytest.raises(BadInput):
        _tune(llama7b, 16, pins=dict(FULL_FT), gpus_per_node=6)


def test_deepspeed_only_when_asked(llama7b):
    r = _tune(llama7b, 8, pins=dict(FULL_FT))
    assert all(c.plan.strategy in ("ddp", "fsdp") for c in r.search.candidates)
    z = _tune(llama7b, 8, pins=dict(FULL_FT, strategy="zero3"))
    assert z.plan.strategy == "zero3" and [s.label for s in z.strategies] == ["zero3(8)"]
    no_opt = {k: v for k, v in FULL_FT.items() if k != "optimizer"}
    # AdamW: 2Ψ + 18Ψ/8 do not fit 24 GB; paged AdamW does, its states (54 GB a rank, 32-bit) paged out to a host
    # with the RAM for 8 of them (tune.search.host_bytes)
    z2 = _tune(llama7b, 8, pins=dict(no_opt, strategy="zero2"), host_mem=2**40)
    assert z2.plan.strategy == "zero2" and z2.strategies[-1].reason == "chosen"
    assert all(s.label.startswith("zero2(8)") for s in z2.strategies)


def test_offload_last_with_host_ram_per_node(llama7b, monkeypatch):
    """On 4 x 12 GB no on-device full fine-tune of a 7B fits; FSDP2 CPUOffloadPolicy does if the node has the RAM."""
    pins = dict(method="full", precision="bf16-mixed", gradient_checkpointing=True)
    monkeypatch.setattr("oomdoctor.tune.tuner.host_ram_bytes", lambda: 512 * 2**30)
    r = _tune(llama7b, 4, gpu_mem=12 * 10**9, pins=pins)
    assert r.plan.method == "full" and r.plan.strategy == "fsdp" and r.plan.offload_params
    assert r.host_per_node_bytes >= 12 * llama7b.num_params  # weights, gradients, optimizer states of 4 ranks
    assert r.to_dict()["host_per_node_bytes"] == r.host_per_node_bytes
    labels = [s.label for s in r.strategies]
    assert labels[-1] == "fsdp(4) + offload" and "ddp(4)" in labels and "fsdp(4)" in labels
    monkeypatch.setattr("oomdoctor.tune.tuner.host_ram_bytes", lambda: 16 * 2**30)
    try:
        small = _tune(llama7b, 4, gpu_mem=12 * 10**9, pins=pins)
    except DoesNotFit:
        return
    assert not small.plan.offload_params
    assert any(c.why_not and "host RAM per node" in c.why_not for c in small.search.candidates)


def test_emitted_yaml_carries_the_topology(llama7b):
    r = _tune(llama7b, 16, pins=dict(FULL_FT), gpus_per_node=8)
    text = render_config(r, LLAMA7B)
    assert "\nworld_size: 16  #" in text and "\nstrategy: fsdp  #" in text and "\nshard_group: 8  #" in text
    assert "\nreshard_after_forward: true  #" in text  # every knob is written, defaults too
    single = render_config(_tune(llama7b, 1, gpu_mem=80 * 10**9, pins=dict(method="lora")), LLAMA7B)
    assert "\nworld_size: 1  #" in single and "\nstrategy: single  #" in single


def test_cli_json_and_table(capsys, tmp_path):
    out_yaml = tmp_path / "p.yaml"
    args = [
        "tune",
        LLAMA7B,
        "--gpus",
        "8",
        "--gpu-mem",
        "24GB",
        "--method",
        "full",
        "--precision",
        "bf16-mixed",
        "--gradient-checkpointing",
        "--optimizer",
        "adamw",
        "--seq-len",
        "2048",
        "--verify",
        "none",
        "-o",
        str(out_yaml),
    ]
    try:
        main(args + ["--json"])
    except SystemExit as e:
        assert e.code in (0, None)
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["strategy"] == "fsdp" and [s["strategy"] for s in doc["strategies"]] == ["ddp(8)", "fsdp(8)"]
    assert "needs" in doc["strategies"][0]["reason"]
    out_yaml.unlink()
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None)
    text = capsys.readouterr().out
    assert "strategies on 8 GPUs" in text and "ddp(8) needs" in text and "--nproc-per-node 8" in text


def test_fsdp_plans_are_verified_by_the_fake_process_group_replay(tiny_spec):
    """--verify auto without a GPU replays the chosen FSDP rank (simulate engine, fake process group)."""
    r = tune(
        tiny_spec,
        gpu_mem=2 * 10**9,
        seq_len=128,
        gpu=None,
        verify_mode="auto",
        pins=dict(world_size=2, strategy="fsdp", method="full", precision="fp32", micro_batch=2),
    )
    assert r.plan.strategy == "fsdp" and r.verification == "simulate"
    assert r.trials and r.trials[-1].outcome == "fits" and r.trials[-1].verified_by == "simulate"
    assert r.trials[-1].measured_peak_allocated_bytes > 0
