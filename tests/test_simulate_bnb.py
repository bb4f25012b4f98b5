"""bitsandbytes stand-ins hold exactly the bytes a real bnb model stores (loaded in 4-bit / 8-bit on CPU)."""

from __future__ import annotations

import pytest

from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import Plan, validate


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from oomdoctor.execute.build import hf_config
    from tests.conftest import TINY_LLAMA

    cfg = dict(TINY_LLAMA, num_hidden_layers=2)
    spec = spec_from_config(cfg, name="tiny")
    path = tmp_path_factory.mktemp("tiny-bnb")
    AutoModelForCausalLM.from_config(hf_config(spec, Plan()), dtype=torch.float32).save_pretrained(path)
    return spec, path


@pytest.mark.parametrize(
    "quant,dq", [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True), ("int8", False)], ids=str
)
def test_standin_bytes_equal_real_bitsandbytes(saved_tiny, quant, dq):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from oomdoctor.execute.bnb_standin import quant_bytes_4bit, quant_bytes_int8, quantized_storage_bytes
    from oomdoctor.execute.build import build_model

    spec, path = saved_tiny
    if quant == "int8":
        qc = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qc = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant,
            bnb_4bit_use_double_quant=dq,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    real = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, device_map="cpu", dtype=torch.float32)
    plan = validate(Plan(method="qlora", quant=quant, double_quant=dq))
    stand = build_model(spec, plan, device="meta").model.get_base_model()
    for lora in [m for m in stand.modules() if hasattr(m, "lora_A")]:
        lora.lora_A = torch.nn.ModuleDict()  # compare the base model only
        lora.lora_B = torch.nn.ModuleDict()
    exact_real = quantized_storage_bytes(real)
    assert quantized_storage_bytes(stand) == exact_real
    # and as the CUDA allocator would book them (512-byte blocks)
    assert quantized_storage_bytes(stand, 512) == quantized_storage_bytes(real, 512)
    # the documented per-layer formula
    q = spec.group("q_proj")
    per = (
        quant_bytes_int8(q.out_features, q.in_features)
        if quant == "int8"
        else quant_bytes_4bit(q.out_features, q.in_features, dq)
    )
    real_q = real.model.layers[0].self_attn.q_proj
    one = quantized_storage_bytes(torch.nn.ModuleList([real_q]))
    assert one == sum(per.values())
