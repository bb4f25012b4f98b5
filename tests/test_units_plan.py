"""Units (one place for parsing/printing sizes) and plan validation."""

import pytest

from oomdoctor.errors import BadInput
from oomdoctor.plan import Plan, validate
from oomdoctor.units import format_bytes, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("24GB", 24 * 10**9),
        ("24GiB", 24 * 2**30),
        ("24000MiB", 24000 * 2**20),
        ("1.5 TB", 15 * 10**11),
        ("80gb", 80 * 10**9),
        ("512B", 512),
        ("0 bytes", 0),
        ("1e3MB", 10**9),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "GB", "24 parsecs", "-3GB", "twenty GB", "24G iB", True, "24", "1e999GB", float("inf")]
)
def test_parse_size_rejects(bad):
    with pytest.raises(BadInput) as e:
        parse_size(bad, what="--gpu-mem")
    assert "--gpu-mem" in str(e.value)


def test_format_bytes():
    assert format_bytes(24 * 2**30) == "24.00 GiB"
    assert format_bytes(24 * 10**9, binary=False) == "24.00 GB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(None) == "-"
    assert format_bytes(-3 * 2**20) == "-3.00 MiB"


def test_plan_normalizes_lora_with_quant_to_qlora():
    p = validate(Plan(method="lora", quant="nf4"))
    assert p.method == "qlora" and p.quant == "nf4"
    assert validate(Plan(method="qlora")).quant == "nf4"


def test_plan_rejects_impossible_combinations_all_at_once():
    with pytest.raises(BadInput) as e:
        validate(Plan(method="full", quant="nf4", micro_batch=0, precision="fp8"))
    msg = str(e.value)
    assert "--method full" in msg and "micro_batch" in msg and "precision" in msg


def test_double_quant_needs_4bit():
    with pytest.raises(BadInput):
        validate(Plan(method="qlora", quant="int8", double_quant=True))
    with pytest.raises(BadInput):
        validate(Plan(method="lora", double_quant=True))


def test_plan_settings_and_effective_batch():
    p = validate(Plan(micro_batch=4, grad_accum=8))
    s = p.settings()
    assert s["micro_batch_size"] == 4 and s["gradient_accumulation_steps"] == 8
    assert s["effective_batch_size"] == 32 == p.effective_batch
    assert "full" in p.label() and "fp32" in p.label()  # HF Trainer's default precision


def test_topology_normalizes_like_torchrun_and_fsdp2():
    assert validate(Plan(world_size=8)).strategy == "ddp"  # torchrun + HF Trainer wrap in DDP
    assert validate(Plan(strategy="ddp")).strategy == "single"
    p = validate(Plan(offload_params=True))  # one GPU: FSDP2 CPUOffloadPolicy, which moves the optimizer too
    assert (p.strategy, p.offload_optimizer, p.world_size) == ("fsdp", True, 1)
    assert validate(Plan(world_size=8, strategy="fsdp", shard_group=8)).shard_group is None
    hsdp = validate(Plan(world_size=8, strategy="fsdp", shard_group=4))
    assert hsdp.shards == 4 and "fsdp(8) hsdp 2x4" in hsdp.label()
    assert validate(Plan(world_size=8, strategy="zero3")).shards == 8
    assert validate(Plan(world_size=8)).shards == 1
    assert validate(Plan(micro_batch=2, grad_accum=3, world_size=4)).effective_batch == 24


@pytest.mark.parametrize(
    "plan, words",
    [
        (Plan(world_size=8, strategy="fsdp", shard_group=3), "divisor"),
        (Plan(world_size=8, shard_group=4), "applies to strategy fsdp"),
        (Plan(world_size=8, reshard_after_forward=False), "reshard_after_forward"),
        (Plan(world_size=8, strategy="fsdp", bucket_size=10**6), "no buckets"),
        (Plan(world_size=8, strategy="zero2", offload_params=True), "zero3"),
        (Plan(world_size=8, strategy="fsdp", offload_optimizer=True), "together"),
        (Plan(world_size=2, optimizer_in_backward=True), "one GPU"),
    ],
)
def test_topology_problems_are_named(plan, words):
    with pytest.raises(BadInput, match=words):
        validate(plan)


def test_adapter_dtype_is_a_lora_knob():
    from oomdoctor.diagnose.matrix import _pinned_methods
    from oomdoctor.tune.search import enumerate_candidates

    with pytest.raises(BadInput, match="applies to LoRA adapters"):
        validate(Plan(method="full", adapter_dtype="bf16"))
    assert "bf16-adapters" in validate(Plan(method="qlora", adapter_dtype="bf16")).label()
    assert "adapters" not in validate(Plan(method="qlora")).label()
    assert set(_pinned_methods({"adapter_dtype": "bf16"})) == {"lora", "qlora"}
    # no bf16 hardware: bf16-adapter plans are dropped, not turned into a refused fp16-mixed plan (which aborted)
    assert enumerate_candidates({"adapter_dtype": "bf16", "method": "lora"}, Plan(), bf16_supported=False) == []
    assert enumerate_candidates({"method": "lora"}, Plan(), bf16_supported=False)
