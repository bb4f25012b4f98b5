"""Facts about architectures, per ``model_type``, that the memory formulas need and a config does not state: which
activation a config means when it names none, which RMSNorms keep an fp32 product, which rotary embeddings
concatenate the query, which attention implementation a model really runs, which routers hand out fp32 weights,
which models scale their embeddings outside the embedding module. Each cites the transformers code it reads.
Pure Python.
"""

from __future__ import annotations

from oomdoctor.model.spec import ModelSpec

#: Models whose rotary embedding concatenates q's rotated and passed parts (``apply_rotary_pos_emb`` with
#: ``torch.cat``): a contiguous (B, heads, S, hd) query.
CONCATENATED_QUERY = frozenset({"phi", "phi3", "gpt_neox", "stablelm", "persimmon"})


#: Extra intermediate-sized tensors saved by activation functions that transformers composes from pointwise ops
#: (``activations.py``): NewGELU ``0.5*x*(1+tanh(c*(x+0.044715*x^3)))`` keeps tanh's output, ``0.5*x`` and
#: ``1+tanh`` besides its input; FastGELU one more (``0.044715*x`` times x); QuickGELU keeps ``sigmoid(1.702x)``.
#: Fused ones (silu, gelu, gelu_pytorch_tanh, relu) keep only their input.
ACT_EXTRA_TENSORS = {"gelu_new": 3, "gelu_fast": 4, "gelu_accurate": 3, "quick_gelu": 1, "gelu_python": 2}


#: transformers' config defaults when config.json omits the activation.
DEFAULT_ACT = {
    "gpt2": "gelu_new",
    "phi": "gelu_new",
    "falcon": "gelu",
    "gemma": "gelu_pytorch_tanh",
    "gemma2": "gelu_pytorch_tanh",
    "bert": "gelu",
    "t5": "relu",
}


#: Composite activations that cube their input with ``torch.pow`` (transformers ``NewGELUActivation``,
#: ``GELUActivation`` accurate): under CUDA autocast ``pow`` runs in fp32, so the tanh branch is fp32 throughout.
POW_ACTS = frozenset({"gelu_new", "gelu_accurate"})


def activation_name(spec: ModelSpec) -> str:
    """The MLP activation function transformers runs: the config's (``gated-`` stripped from T5's
    ``feed_forward_proj``), else the model type's default (:data:`DEFAULT_ACT`)."""
    for key in ("hidden_act", "activation_function", "hidden_activation", "feed_forward_proj"):
        v = spec.config.get(key)
        if isinstance(v, str):
            return v.replace("gated-", "")
    return DEFAULT_ACT.get(spec.model_type, "")


def act_extra_tensors(spec: ModelSpec) -> int:
    """Intermediate-sized tensors the activation saves besides its input (:data:`ACT_EXTRA_TENSORS`)."""
    return ACT_EXTRA_TENSORS.get(activation_name(spec), 0)


def effective_attn(spec: ModelSpec, attn: str) -> str:
    """Attention implementation the model really runs: transformers refuses SDPA for models that soft-cap attention
    logits (Gemma-2: ``_supports_sdpa = False``), so they run eager unless flash-attention is requested."""
    if attn == "sdpa" and spec.config.get("attn_logit_softcapping") is not None and spec.model_type == "gemma2":
        return "eager"
    if (
        attn == "sdpa"
        and spec.model_type == "falcon"
        and not spec.config.get("new_decoder_architecture")
        and spec.num_kv_heads != spec.num_heads
    ):
        # Falcon-7B multi-query: FalconAttention passes 1-head k/v to SDPA without enable_gqa, so SDPA falls back
        # to its math kernel, which materializes the B x heads x S x S probabilities like eager attention.
        return "eager"
    return attn


def config_float(spec: ModelSpec, *keys: str) -> float:
    """The first numeric value among config ``keys`` (model types name their dropout probabilities differently),
    0.0 without one."""
    for key in keys:
        v = spec.config.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 0.0


#: RMSNorms that multiply their weight into the fp32 normalized input and cast the product back (Gemma 1-3 and
#: Qwen3-Next: ``output * (1.0 + self.weight.float())``; OLMo 2/3: ``(self.weight * hidden_states).to(input_dtype)``):
#: with a trainable weight the product saves that fp32 ``y``, where Llama's (and OLMoE's) saves ``y`` cast back to
#: the input dtype.
FP32_PRODUCT_NORMS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "olmo2", "olmo3", "qwen3_next"})


#: Model types whose router hands the experts fp32 routing weights (transformers ``MixtralTopKRouter.forward``:
#: ``softmax(logits.float())`` top-k, never cast back; Qwen2/3-MoE and most others cast to the logits' dtype): the
#: experts' weighted output, its reordering and the sum are fp32 then (``grouped_mm_experts_forward``).
FP32_ROUTING_WEIGHTS = ("mixtral",)


#: Models that scale the input embeddings in the model's forward, outside the embedding module (Granite's
#: ``embedding_multiplier``; Gemma scales inside its embedding module).
EMBEDDINGS_SCALED_IN_FORWARD = frozenset(
    {"granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "falcon_h1", "hyperclovax", "recurrent_gemma"}
)
