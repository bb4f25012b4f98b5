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


@pytest.mark.parametrize("bad", ["", "GB", "24 parsecs", "-3GB", "twenty GB", "24G iB", True, "24", "1e999GB",
                                 float("inf")])
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


def test_scale_out_fields_are_carried_but_refused_for_now():
    with pytest.raises(BadInput, match="world_size"):
        validate(Plan(world_size=8, sharding="fsdp"))
