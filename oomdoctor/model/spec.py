"""Model spec: what oomdoctor knows about a model from its ``config.json`` alone (no weights, no torch import).

A frozen :class:`ModelSpec` holds the structural numbers the memory model needs and the module inventory
(:class:`ParamGroup` list) built by ``oomdoctor.model.architectures``; ``oomdoctor.model.load`` makes one from
a model reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from oomdoctor.errors import BadInput

ParamKind = Literal["linear", "embedding", "norm", "other"]
ArchKind = Literal["decoder", "encoder", "encoder-decoder"]

#: Output head module names: never in peft's ``all-linear`` (bitsandbytes: ``ParamGroup.quantizable``).
HEAD_NAMES = ("lm_head", "score", "classifier")

#: Model types whose attention takes relative position buckets: ``max_position_embeddings``/``n_positions`` is the
#: training length, not a limit (T5's ``relative_attention_bias``).
RELATIVE_POSITIONS: frozenset[str] = frozenset({"t5", "mt5", "umt5", "longt5"})


def rope_scaling(config: dict[str, Any]) -> tuple[float, int | None]:
    """``(factor, original_max_position_embeddings or None)`` of a config's RoPE scaling (``rope_scaling``, or
    transformers 5's ``rope_parameters``, per layer type or not); ``(1.0, None)`` without one."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        return 1.0, None
    entries = [rope] if "factor" in rope or not all(isinstance(v, dict) for v in rope.values()) else list(rope.values())
    factor, original = 1.0, None
    for e in entries:
        f = e.get("factor")
        if isinstance(f, (int, float)) and not isinstance(f, bool) and f > factor:
            factor = float(f)
            o = e.get("original_max_position_embeddings")
            original = int(o) if isinstance(o, int) and not isinstance(o, bool) else None
    return factor, original


@dataclass(frozen=True)
class ParamGroup:
    """A set of identical modules, e.g. the ``q_proj`` of every layer (``count = num_layers``).

    For ``linear``: weight is (out_features, in_features), plus ``out_features`` bias values if ``bias``.
    For ``embedding``: (num_embeddings=in_features, dim=out_features). For ``norm``/``other``: ``numel`` elements.
    """

    name: str
    """Module name suffix as in the HF model (``q_proj``, ``embed_tokens``, ``lm_head``...): LoRA targets match it."""
    kind: ParamKind
    in_features: int = 0
    out_features: int = 0
    bias: bool = False
    count: int = 1
    """Number of such modules in the whole model."""
    per_layer: bool = True
    """True when the module repeats in every transformer block."""
    numel_each: int = 0
    """Element count for ``norm``/``other`` groups (weights + biases of one module)."""
    path: str = ""
    """Dotted path in the HF model, ``{i}`` standing for the block index (``model.layers.{i}.self_attn.q_proj``).
    For a raw ``nn.Parameter`` (Mixtral's fused experts) the parameter's own path. Several groups may share a leaf
    ``name`` (BERT's four ``dense``, GPT-2's two ``c_proj``): a LoRA target ``dense`` then adapts all of them."""
    module: str = ""
    """Class of the HF module (``Linear``, ``Conv1D``, ``FalconLinear``, ``Embedding``, ``LayerNorm``, ``RMSNorm``,
    ``Parameter``). GPT-2's ``Conv1D`` stores its weight as (in, out) but holds the same elements as a Linear."""
    quantizable: bool = False
    """True when loading the model quantized through transformers' bitsandbytes integration (transformers 5.x
    ``replace_with_bnb_linear``) replaces this module (``model/inventory.bnb_quantized_paths``, the one rule):
    exactly ``type(m) is nn.Linear`` or ``Conv1D``, but not the output embeddings, tied weights, the module of the
    last parameter or the model's ``_keep_in_fp32_modules`` (T5's ``wo``) — BERT's classifier is quantized (its last
    parameter is a bias). Falcon's ``FalconLinear`` (a subclass) and Mixtral's fused 3D expert tensors are NOT
    replaced and stay in the load dtype; neither are embeddings and norms."""
    tower: bool = False
    """A module of a multimodal tower (vision/audio encoder, its projector): text-only training neither runs nor
    trains it — frozen, never a LoRA target — but holds (and quantizes) its weights (``model/inventory.py``)."""

    @property
    def weight_numel(self) -> int:
        if self.kind in ("linear", "embedding"):
            return self.in_features * self.out_features
        return self.numel_each

    @property
    def bias_numel(self) -> int:
        return self.out_features if (self.kind == "linear" and self.bias) else 0

    @property
    def numel(self) -> int:
        """Elements of one module (weight + bias)."""
        return self.weight_numel + self.bias_numel

    @property
    def total_numel(self) -> int:
        return self.numel * self.count


@dataclass(frozen=True)
class ModelSpec:
    """Structural description of a model, enough to price its training memory."""

    name: str
    """What the user typed (id or path)."""
    model_type: str
    """HF ``model_type`` (llama, mistral, falcon, gpt2...)."""
    arch_kind: ArchKind
    hidden_size: int
    num_layers: int
    """Transformer blocks (for encoder-decoder: encoder + decoder blocks)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    groups: tuple[ParamGroup, ...]
    """Module inventory; sums to the model's parameter count (tied weights counted once)."""
    mlp_kind: Literal["gated", "plain"] = "gated"
    """``gated``: act(gate(x)) * up(x) (SwiGLU/GeGLU, 3 matrices); ``plain``: fc2(act(fc1(x)))."""
    norm_kind: Literal["rms", "layer"] = "rms"
    parallel_attn: bool = False
    """Attention and MLP read the same normed input (Falcon, Phi-2, GPT-J)."""
    num_experts: int = 0
    """MoE experts per layer (0 = dense)."""
    experts_per_token: int = 0
    peft_moe_conversion: str = ""
    """peft's v4->v5 MoE target conversion for this model (peft 0.21 ``utils/transformers_weight_conversion.py``:
    ``_MODEL_TO_CONVERSION_PATTERN`` -> ``_MOE_TARGET_MODULE_MAPPING``): ``mixtral`` or ``qwen2_moe`` (Qwen2/3-MoE,
    OLMoE, DeepSeek-V2/V3, GLM-4-MoE...), ``""`` when peft applies none. On such a model ``get_peft_model`` moves the
    expert and router target names to ``target_parameters``: LoRA on the router weight and on the fused expert
    stacks (``ParamWrapper``), none on nn.Linear modules bearing those names (``memory/lora.py``)."""
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 0
    sliding_window: int | None = None
    encoder_layers: int = 0
    """Encoder-decoder only: blocks in the encoder (``num_layers - encoder_layers`` in the decoder)."""
    num_labels: int = 0
    """Encoder classifiers: output classes of the head (sequence classification)."""
    source: str = "local"
    """``bundled`` (configs/models), ``local`` (a path) or ``hub`` (fetched config.json)."""
    family: str = ""
    """Family in the bundled registry (for "a smaller model of the same family fits")."""
    published_params: int | None = None
    """Parameter count published by the model's authors (bundled registry), for cross-checks."""
    inventory: str = "hand"
    """``hand`` (a builder in ``architectures.py``, its quirks measured) or ``transformers`` (read from the model
    transformers builds on the meta device, ``oomdoctor.model.inventory``: parameters exact, activations by the
    generic block formulas)."""
    towers: tuple[str, ...] = ()
    """Module paths of a multimodal model's towers (``model/inventory.tower_prefixes``: ``model.visual``...): text-only
    training holds them frozen, never a LoRA target (their groups are :attr:`ParamGroup.tower`)."""
    config: dict = field(default_factory=dict, compare=False, repr=False)
    """The raw config.json."""

    @property
    def position_limit(self) -> int:
        """The longest sequence the model's positions reach (0: none known — state-space models, T5's relative
        buckets): ``max_position_embeddings``, times the RoPE scaling ``factor`` when the config scales positions
        beyond it (linear / dynamic / YaRN on the original length, as Qwen2.5's YaRN recipe writes it); a config
        whose ``original_max_position_embeddings`` is below the max already counts the factor (Llama-3.1)."""
        n = self.max_position_embeddings
        if not n or self.model_type in RELATIVE_POSITIONS:
            return 0
        factor, original = rope_scaling(self.config)
        return int(n * factor) if factor > 1 and (original is None or original >= n) else n

    def check_seq_len(self, seq_len: int, what: str = "seq_len") -> None:
        """BadInput when ``seq_len`` is beyond :attr:`position_limit`: the model cannot attend that far (learned
        position embeddings end there; RoPE was trained up to it), so neither pricing nor training it means
        anything — one rule for diagnose, tune and train."""
        limit = self.position_limit
        if limit and seq_len > limit:
            raise BadInput(
                f"{what} {seq_len:,} is beyond the {limit:,} positions of {self.name} (max_position_embeddings"
                + (" x its RoPE scaling factor" if limit != self.max_position_embeddings else "")
                + "): the model cannot attend that far",
                f"use {what} {limit} or less; to train a longer context, extend it in the model's config.json "
                "(rope_scaling and max_position_embeddings) and pass that config",
            )

    @property
    def num_params(self) -> int:
        return sum(g.total_numel for g in self.groups)

    @property
    def layer_groups(self) -> tuple[ParamGroup, ...]:
        return tuple(g for g in self.groups if g.per_layer)

    @property
    def linear_groups(self) -> tuple[ParamGroup, ...]:
        return tuple(g for g in self.groups if g.kind == "linear")

    @property
    def head_group(self) -> ParamGroup | None:
        """The output head's own group (None when it is tied to the input embedding and has no bias)."""
        for g in self.groups:
            if g.name == self.head_name and not g.per_layer:
                return g
        return None

    @property
    def head_name(self) -> str:
        """Name of the output head module (``lm_head`` for causal LMs)."""
        for g in self.groups:
            if g.name in HEAD_NAMES:
                return g.name
        return "lm_head"

    def group(self, name: str) -> ParamGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)
