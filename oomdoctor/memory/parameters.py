"""Weights on the device: unquantized (fp32 / bf16), bitsandbytes int8 and 4-bit (NF4/FP4, double quantization),
LoRA adapters, and AMP's low-precision weight copies. Pure functions of (ModelSpec, Plan) returning bytes.
"""

from __future__ import annotations

from oomdoctor.memory.context import Ctx
from oomdoctor.memory.logits import fused_head
from oomdoctor.memory.lora import adapter_bytes
from oomdoctor.model.lora_targets import PARAM_WRAPPER

#: bitsandbytes 4-bit: one absmax per block of 64 weights (``quantize_4bit`` default blocksize; QLoRA paper §2,
#: Dettmers et al. 2023, arXiv 2305.14314).
NF4_BLOCKSIZE = 64
#: Double quantization quantizes the fp32 absmax values to 8 bit in blocks of 256 (QLoRA §2 "Double
#: Quantization"; bitsandbytes ``functional.quantize_4bit(compress_statistics=True)`` -> ``quantize_blockwise(...,
#: blocksize=256)``).
DQ_BLOCKSIZE = 256
#: Per quantized tensor constants: the 4-bit code (16 fp32) and, with double quant, the 8-bit code (256 fp32) and
#: the fp32 offset (bitsandbytes ``QuantState``).
NF4_CODE_BYTES = 16 * 4
DQ_CODE_BYTES = 256 * 4 + 4


def nf4_weight_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes of one bnb ``Params4bit`` weight of ``numel`` elements with its ``QuantState``.

    Packed uint8 data: two 4-bit values per byte (numel/2). Absmax: one fp32 per 64-block; with double quant one
    uint8 per 64-block plus one fp32 absmax per 256 of those (+ code and offset). Source: QLoRA (Dettmers et al.
    2023) §2; bitsandbytes ``functional.quantize_4bit``. Same layout for FP4.
    Limit: ignores the per-tensor 512-byte allocator rounding (priced as allocator slack).
    """
    blocks = -(-numel // NF4_BLOCKSIZE)
    data = -(-numel // 2)
    if double_quant:
        blocks2 = -(-blocks // DQ_BLOCKSIZE)
        return data + blocks + blocks2 * 4 + NF4_CODE_BYTES + DQ_CODE_BYTES
    return data + blocks * 4 + NF4_CODE_BYTES


def int8_weight_bytes(numel: int, out_features: int) -> int:
    """Bytes of one bnb ``Linear8bitLt`` weight: int8 data plus one fp32 row scale (``SCB``) per output row.

    Source: LLM.int8() (Dettmers et al. 2022, arXiv 2208.07339), vector-wise quantization; bitsandbytes
    ``Int8Params`` (``CB`` int8, ``SCB`` fp32 of shape (out_features,)).
    Limit: outlier columns extracted at threshold 6.0 are transient (per call), not counted here.
    """
    return numel + 4 * out_features


def base_weight_bytes(c: Ctx) -> int:
    """Stored bytes of the base model's weights (without adapters).

    Unquantized weights take ``c.wb`` bytes each. With bitsandbytes, the linears transformers' integration replaces
    are quantized (:func:`is_quantized`: every ``nn.Linear``/``Conv1D`` but the head and what transformers keeps);
    embeddings, norms, biases and the other linears stay in the weight dtype ``c.wb``. The plan's weight dtype for
    ``*-mixed`` is fp32, so peft's ``prepare_model_for_kbit_training`` (which upcasts every non-4-bit fp16/bf16
    parameter to fp32, peft ``utils/other.py``) changes nothing there; in pure ``bf16`` it makes them fp32 (``c.wb``
    = 4, ``model.execution.upcast_to_fp32``) unless ``kbit_upcast: false`` skips it (bf16). Sizes: ZeRO paper (Rajbhandari
    et al. 2020) §3.1 "model states" (2 bytes/param fp16, 4 bytes fp32).
    """
    s = c.sums
    if c.quant is None:
        return (s.linear_numel + s.head_numel + s.embed_numel + s.other_numel) * c.wb
    total = (s.linear_numel + s.head_numel + s.embed_numel + s.other_numel) * c.wb
    for g in c.spec.groups:
        if not is_quantized(g):
            continue
        if c.quant == "int8":
            q = int8_weight_bytes(g.weight_numel, g.out_features)
        else:
            q = nf4_weight_bytes(g.weight_numel, c.plan.double_quant)
        total += (q - g.weight_numel * c.wb) * g.count
    return total


def is_quantized(g) -> bool:
    """Whether bitsandbytes replaces the linears of group ``g`` (``ParamGroup.quantizable``: transformers' rule,
    ``model/inventory.bnb_quantized_paths``; the hand builders follow it, ``tests/test_quantized_price.py``)."""
    return g.kind == "linear" and g.quantizable


def parameter_bytes(c: Ctx) -> int:
    """Everything the model holds on the device: base weights + LoRA adapters (fp32, see ``lora.py``)."""
    return base_weight_bytes(c) + adapter_bytes(c)


def expert_stacks(c: Ctx) -> dict[str, int]:
    """The fused 3-D expert weights of one block (``gate_up_proj``, ``down_proj``: raw ``nn.Parameter`` groups under
    ``experts``; gpt-oss's bias stacks are added, not multiplied) -> their elements in one block."""
    L = max(c.spec.num_layers, 1)
    return {
        g.name: g.numel_each * g.count // L
        for g in c.spec.groups
        if g.per_layer and g.module == "Parameter" and ".experts." in g.path and not g.name.endswith("bias")
    }


def head_weight_numel(c: Ctx) -> int:
    """Elements of the output head's weight: the input embedding's when the two are tied."""
    s = c.sums
    return s.head_numel or (s.embed_numel if c.spec.tie_word_embeddings else 0)


def amp_weight_copy_bytes(c: Ctx, layers: float | None = None) -> int:
    """AMP's low-precision copies of fp32 weights that are alive while their layer's activations are.

    Under ``torch.autocast`` (``*-mixed``) every matmul casts its fp32 weight to the compute dtype. For a leaf that
    requires grad the cast is cached for the whole forward (``cached_cast`` in torch ``aten/src/ATen/autocast_mode.cpp``,
    Apex's heuristic); for a frozen weight it is redone per call. Either way the copy is saved for backward (the
    input gradient needs the weight), so it lives until that layer's backward: 2 bytes per linear weight (+bias) that
    is not quantized — the full linear set for full fine-tuning and for LoRA on an fp32 base (frozen copies), the
    adapters only for QLoRA (bitsandbytes dequantizes per call, nothing saved). Fused 3-D expert stacks are cast
    too (never quantized): per expert slice by transformers' eager experts, whole by Llama 4's batched ``bmm`` —
    unless a peft ``ParamWrapper`` adapts them (its W' casts: ``experts.param_wrapper_weights``); the grouped
    matmul runs bf16 weights only, outside autocast. Embeddings and norm weights are not cast (not autocast ops).
    ``layers``: how many blocks' copies are alive (None = the whole model).
    Limit: fp16-mixed and bf16-mixed are both priced at 2 bytes; ``GradScaler`` buffers are ignored (tiny).
    """
    if not c.autocast:
        return 0
    s = c.sums
    L = max(c.spec.num_layers, 1)
    adapters = c.cast_lora_numel * 2
    if not c.mixed:  # bf16 weights under autocast (a foreign trainer's pure bf16): only fp32 adapters are cast
        return adapters if layers is None else int(adapters * layers / L)
    if c.quant is not None:  # quantized linears are dequantized per call, nothing saved; the rest are cast
        base_layer = (
            sum(
                g.weight_numel * g.count
                for g in c.spec.groups
                if g.kind == "linear" and g.per_layer and not is_quantized(g)
            )
            * 2
        )
    else:
        base_layer = s.linear_numel * 2
    wrapped = {g.name.split(".")[-1] for g in c.lora_groups if g.module == PARAM_WRAPPER}
    base_layer += 2 * L * sum(n for name, n in expert_stacks(c).items() if name not in wrapped)
    # a fused head (TRL's, Liger's) never runs the head module: it casts the weight itself (logits.fused_head)
    head = head_weight_numel(c) * 2 if not fused_head(c.plan) else 0
    if layers is None:
        return base_layer + head + adapters
    return int((base_layer + adapters) * layers / L)
