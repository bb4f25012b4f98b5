"""Every bundled architecture quantized in the price as transformers' bitsandbytes loading quantizes it.

Two independent references per bundled config (cut to a few blocks: the rule is per module, and the meta builds stay
fast): transformers' own quantizer (``AutoHfQuantizer.preprocess_model``, what ``from_pretrained(quantization_config=
BitsAndBytesConfig(...))`` runs) on the model transformers builds, for which modules become bitsandbytes layers; and
the executor's model (``execute/build.build_model``: stand-ins holding exactly the bytes bitsandbytes stores, peft's
adapters, k-bit preparation), for the bytes a QLoRA plan's parameters hold.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from oomdoctor.execute.build import config_with_layers
from oomdoctor.memory.context import make_ctx
from oomdoctor.memory.parameters import base_weight_bytes, is_quantized, parameter_bytes
from oomdoctor.model.load import bundled_ids, load_config, spec_from_config
from oomdoctor.plan import Plan, validate

#: Blocks kept per config: enough for DeepSeek-V3's first MoE block (``first_k_dense_replace`` 3).
LAYERS = 4
QUANTS = {
    "nf4 dq": dict(quant="nf4", double_quant=True),
    "nf4": dict(quant="nf4", double_quant=False),
    "int8": dict(quant="int8", double_quant=False),
}


def cut_spec(model_id: str):
    cfg, _, _ = load_config(model_id)
    return spec_from_config(config_with_layers(cfg, LAYERS), name=model_id)


def transformers_model(spec):
    """The model transformers builds for ``spec``'s config on the meta device, by the class a fine-tune loads."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

    from oomdoctor.execute.build import hf_config
    from oomdoctor.model.inventory import auto_model_class

    config = hf_config(spec, validate(Plan()))
    auto = {"encoder": AutoModelForSequenceClassification, "encoder-decoder": AutoModelForSeq2SeqLM}.get(
        spec.arch_kind
    ) or auto_model_class(config)
    with torch.device("meta"):
        return auto.from_config(config, dtype=torch.float32)


#: The block list in a module path (T5's ``encoder.block.3.layer.0``: the first index is the block's).
BLOCK = re.compile(r"\.(layers|h|blocks|block|layer)\.(\d+)\.")


def templates(paths) -> Counter:
    """Module paths with the block index as ``{i}`` (how the spec's groups spell them), counted."""
    return Counter(BLOCK.sub(lambda m: f".{m.group(1)}.{{i}}.", f".{p}.", count=1).strip(".") for p in paths)


@pytest.mark.parametrize("model_id", bundled_ids())
def test_the_priced_quantized_linears_are_the_ones_transformers_quantizes(model_id):
    """transformers' bitsandbytes quantizer, run on the model transformers builds, replaces exactly the linears the
    spec prices as quantized: not Falcon's ``FalconLinear`` (an nn.Linear subclass), not T5's ``wo``
    (``_keep_in_fp32_modules``), not the head; GPT-2's ``Conv1D`` yes."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    spec = cut_spec(model_id)
    model = transformers_model(spec)
    AutoHfQuantizer.from_config(BitsAndBytesConfig(load_in_4bit=True)).preprocess_model(model, device_map={"": "cpu"})
    quantized = templates(n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit))
    priced = Counter()
    for g in spec.groups:
        if is_quantized(g):
            priced[g.path] += g.count
    assert priced == quantized


def held_bytes(model) -> int:
    """Bytes the executor's model holds in its parameters (tied ones once) and its bitsandbytes stand-ins' buffers
    (absmax, codes, offsets, int8 row scales): what its weights are on the device."""
    from oomdoctor.execute.bnb_standin import standin_classes

    seen: dict[int, int] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p.numel() * p.element_size())
    for m in model.modules():
        if isinstance(m, standin_classes()):
            for b in m.buffers(recurse=False):
                seen.setdefault(id(b), b.numel() * b.element_size())
    return sum(seen.values())


@pytest.mark.parametrize("quant", QUANTS.values(), ids=QUANTS.keys())
@pytest.mark.parametrize("model_id", bundled_ids())
def test_a_qlora_plan_prices_the_bytes_the_executors_model_holds(model_id, quant):
    """A QLoRA plan's parameter bytes (4-bit packed linears + their constants, LoRA adapters, the fp32 rest) equal
    what the executor's model holds: decoders as ``build_model`` builds them for the plan (stand-ins, peft, k-bit
    preparation); the encoder classifier and the encoder-decoder, which the executor does not train, as
    transformers builds them with the same stand-ins and k-bit preparation (their base weights)."""
    from peft import prepare_model_for_kbit_training

    from oomdoctor.execute.bnb_standin import quantize_model_standin
    from oomdoctor.execute.build import build_model

    spec = cut_spec(model_id)
    plan = validate(Plan(method="qlora", precision="bf16-mixed", seq_len=64, **quant))
    c = make_ctx(spec, plan)
    if spec.arch_kind == "decoder":
        assert held_bytes(build_model(spec, plan, device="meta").model) == parameter_bytes(c)
    else:
        model = transformers_model(spec)
        quantize_model_standin(model, plan)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        assert held_bytes(model) == base_weight_bytes(c)


def test_falcons_qlora_is_priced_unquantized_and_says_so():
    """transformers 5.x leaves Falcon's FalconLinear layers unquantized (a real 4-bit load replaces none of them:
    "no linear modules were found"): its QLoRA holds the whole base in fp32, more than a bf16 LoRA, and says why."""
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec

    spec = load_spec("tiiuae/falcon-7b")
    qlora = estimate(spec, validate(Plan(method="qlora", precision="bf16-mixed", quant="nf4", double_quant=True)))
    lora = estimate(spec, validate(Plan(method="lora", precision="bf16")))
    assert qlora.parameters > lora.parameters
    assert any("no linear is quantized" in n and "FalconLinear" in n for n in qlora.notes)
    llama = load_spec("meta-llama/Llama-2-7b-hf")
    assert not any("stay unquantized" in n for n in estimate(llama, validate(Plan(method="qlora"))).notes)
