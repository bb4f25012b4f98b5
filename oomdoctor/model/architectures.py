"""Module inventories per architecture, from config.json alone (pure Python: no torch, no transformers).

One job, over 600 lines: one hand builder per architecture family, each a short function.

Each builder mirrors the module tree of the transformers implementation for that ``model_type`` (names as in HF,
so LoRA ``target_modules`` match), and a test checks every bundled config against a meta-device build of the real
transformers model: same parameter count, same linear shapes.
"""

from __future__ import annotations

from collections.abc import Callable

from oomdoctor.errors import BadInput, ConfigErrors
from oomdoctor.model.spec import ModelSpec, ParamGroup

Builder = Callable[[dict, str], ModelSpec]
BUILDERS: dict[str, Builder] = {}


def register(*model_types: str):
    def deco(fn: Builder) -> Builder:
        for t in model_types:
            BUILDERS[t] = fn
        return fn

    return deco


class _Cfg:
    """Typed access to config fields; collects every missing/invalid field so one error lists them all."""

    def __init__(self, cfg: dict, name: str):
        self.cfg, self.name, self.problems = cfg, name, []

    def int(self, *keys: str, default: int | None = None) -> int:
        for k in keys:
            v = self.cfg.get(k)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    self.problems.append(f"{k}={v!r} must be a non-negative integer")
                    return 1
                return v
        if default is None:
            self.problems.append(f"missing {' / '.join(keys)}")
            return 1
        return default

    def get(self, key: str, default=None):
        v = self.cfg.get(key)
        return default if v is None else v

    def check(self) -> None:
        if self.problems:
            raise ConfigErrors(
                f"{self.name} ({self.cfg.get('model_type', '?')} config)",
                self.problems,
                "pass a complete Hugging Face config.json (see `oomdoctor models` for bundled ones)",
            )


def _lin(
    name: str,
    i: int,
    o: int,
    count: int,
    bias: bool = False,
    per_layer: bool = True,
    path: str = "",
    module: str = "Linear",
    kept: bool = False,
) -> ParamGroup:
    """A linear group; bitsandbytes through transformers quantizes it unless it is a subclass of nn.Linear
    (``module``) or ``kept`` by transformers' quantizer (``model/inventory.bnb_quantized_paths``: the output
    embeddings, the module of the model's last parameter, ``_keep_in_fp32_modules``)."""
    return ParamGroup(
        name=name,
        kind="linear",
        in_features=i,
        out_features=o,
        bias=bias,
        count=count,
        per_layer=per_layer,
        path=path,
        module=module,
        quantizable=module in ("Linear", "Conv1D") and not kept,
    )


def _head(name: str, i: int, o: int, bias: bool = False) -> ParamGroup:
    """The output head (``lm_head``, a decoder classifier's ``score``): transformers' quantizer keeps it (the output
    embeddings, or the last parameter's module)."""
    return _lin(name, i, o, 1, bias, per_layer=False, path=name, kept=True)


def _norm(
    name: str, numel: int, count: int, per_layer: bool = True, path: str = "", module: str = "RMSNorm"
) -> ParamGroup:
    return ParamGroup(
        name=name, kind="norm", numel_each=numel, count=count, per_layer=per_layer, path=path, module=module
    )


def _ln(name: str, dim: int, count: int, per_layer: bool = True, path: str = "") -> ParamGroup:
    """nn.LayerNorm with weight and bias (2 * dim elements)."""
    return _norm(name, 2 * dim, count, per_layer, path, module="LayerNorm")


def _emb(name: str, num: int, dim: int, path: str = "") -> ParamGroup:
    return ParamGroup(
        name=name,
        kind="embedding",
        in_features=num,
        out_features=dim,
        count=1,
        per_layer=False,
        path=path,
        module="Embedding",
    )


def _other(name: str, numel: int, count: int, path: str, per_layer: bool = True) -> ParamGroup:
    return ParamGroup(
        name=name, kind="other", numel_each=numel, count=count, per_layer=per_layer, path=path, module="Parameter"
    )


def _bool(c: _Cfg, key: str, default: bool) -> bool:
    v = c.cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        c.problems.append(f"{key}={v!r} must be true or false")
        return default
    return v


def _pos(c: _Cfg, *keys: str, default: int | None = None) -> int:
    """A positive integer field (0 would build a degenerate model and divide by zero later)."""
    v = c.int(*keys, default=default)
    if v == 0:
        c.problems.append(f"{keys[0]}=0 must be positive")
        return 1
    return v


# ---------------------------------------------------------------------------------------------- decoders


@register("llama", "mistral", "qwen2", "gemma", "gemma2", "mixtral", "qwen3", "olmo2", "granite")
def _llama_like(cfg: dict, name: str) -> ModelSpec:
    """LlamaForCausalLM and its close relatives (transformers models/llama/modeling_llama.py and siblings):
    q/k/v/o_proj (+bias if ``attention_bias``; Qwen2 always has q/k/v bias and no o_proj bias),
    gate/up/down_proj (SwiGLU/GeGLU, +bias if ``mlp_bias``), RMSNorm before attention and MLP (Gemma2 adds
    pre/post feed-forward norms; OLMo2 has only post-norms plus q_norm/k_norm over all heads; Qwen3 has per-head
    q_norm/k_norm), final norm, lm_head (tied or not; the default follows each config class).
    Mixtral (transformers 5.x, modeling_mixtral.py): the MLP is a router ``gate`` (MixtralTopKRouter, a raw
    (experts, hidden) Parameter, not an nn.Linear) and ``experts`` holding two fused 3D Parameters,
    ``gate_up_proj`` (experts, 2*inter, hidden) and ``down_proj`` (experts, hidden, inter). They are neither LoRA
    ``all-linear`` targets nor quantized by bitsandbytes, so they are ``other`` groups here."""
    c = _Cfg(cfg, name)
    mt = cfg.get("model_type", "llama")
    h = _pos(c, "hidden_size")
    L = _pos(c, "num_hidden_layers")
    nh = _pos(c, "num_attention_heads")
    nkv = _pos(c, "num_key_value_heads", default=nh)
    hd = _pos(c, "head_dim", default=max(h // max(nh, 1), 1))
    inter = _pos(c, "intermediate_size")
    V = _pos(c, "vocab_size")
    n_exp = c.int("num_local_experts", default=8) if mt == "mixtral" else 0
    top_k = c.int("num_experts_per_tok", default=2) if mt == "mixtral" else 0
    attn_bias = _bool(c, "attention_bias", False)
    mlp_bias = _bool(c, "mlp_bias", False)
    tie = _bool(c, "tie_word_embeddings", mt in ("gemma", "gemma2"))
    c.check()
    qkv_bias = True if mt == "qwen2" else attn_bias
    o_bias = False if mt == "qwen2" else attn_bias
    P = "model.layers.{i}"
    groups = [
        _emb("embed_tokens", V, h, "model.embed_tokens"),
        _lin("q_proj", h, nh * hd, L, qkv_bias, path=f"{P}.self_attn.q_proj"),
        _lin("k_proj", h, nkv * hd, L, qkv_bias, path=f"{P}.self_attn.k_proj"),
        _lin("v_proj", h, nkv * hd, L, qkv_bias, path=f"{P}.self_attn.v_proj"),
        _lin("o_proj", nh * hd, h, L, o_bias, path=f"{P}.self_attn.o_proj"),
    ]
    if mt == "mixtral":
        groups += [
            _other("gate", n_exp * h, L, f"{P}.mlp.gate"),
            _other("gate_up_proj", n_exp * 2 * inter * h, L, f"{P}.mlp.experts.gate_up_proj"),
            _other("down_proj", n_exp * inter * h, L, f"{P}.mlp.experts.down_proj"),
        ]
    else:
        groups += [
            _lin("gate_proj", h, inter, L, mlp_bias, path=f"{P}.mlp.gate_proj"),
            _lin("up_proj", h, inter, L, mlp_bias, path=f"{P}.mlp.up_proj"),
            _lin("down_proj", inter, h, L, mlp_bias, path=f"{P}.mlp.down_proj"),
        ]
    if mt != "olmo2":
        groups.append(_norm("input_layernorm", h, L, path=f"{P}.input_layernorm"))
    groups.append(_norm("post_attention_layernorm", h, L, path=f"{P}.post_attention_layernorm"))
    if mt == "gemma2":
        groups.append(_norm("pre_feedforward_layernorm", h, L, path=f"{P}.pre_feedforward_layernorm"))
    if mt in ("gemma2", "olmo2"):
        groups.append(_norm("post_feedforward_layernorm", h, L, path=f"{P}.post_feedforward_layernorm"))
    if mt == "qwen3":
        groups += [
            _norm("q_norm", hd, L, path=f"{P}.self_attn.q_norm"),
            _norm("k_norm", hd, L, path=f"{P}.self_attn.k_norm"),
        ]
    if mt == "olmo2":
        groups += [
            _norm("q_norm", nh * hd, L, path=f"{P}.self_attn.q_norm"),
            _norm("k_norm", nkv * hd, L, path=f"{P}.self_attn.k_norm"),
        ]
    groups.append(_norm("norm", h, 1, per_layer=False, path="model.norm"))
    if not tie:
        groups.append(_head("lm_head", h, V))
    sw = cfg.get("sliding_window")
    if mt == "qwen2" and not cfg.get("use_sliding_window", False):
        sw = None  # Qwen2 configs carry sliding_window but only use it when use_sliding_window is true
    return ModelSpec(
        name=name,
        model_type=mt,
        arch_kind="decoder",
        hidden_size=h,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=V,
        groups=tuple(groups),
        mlp_kind="gated",
        norm_kind="rms",
        num_experts=n_exp,
        experts_per_token=top_k,
        peft_moe_conversion="mixtral" if mt == "mixtral" else "",
        tie_word_embeddings=tie,
        max_position_embeddings=int(c.get("max_position_embeddings", 0) or 0),
        sliding_window=sw if isinstance(sw, int) and not isinstance(sw, bool) else None,
        config=cfg,
    )


@register("phi3")
def _phi3(cfg: dict, name: str) -> ModelSpec:
    """Phi3ForCausalLM (modeling_phi3.py): llama layout with FUSED projections: ``qkv_proj`` (hidden ->
    (heads + 2*kv_heads) * head_dim) and ``gate_up_proj`` (hidden -> 2*intermediate), no biases, RMSNorm."""
    c = _Cfg(cfg, name)
    h = _pos(c, "hidden_size")
    L = _pos(c, "num_hidden_layers")
    nh = _pos(c, "num_attention_heads")
    nkv = _pos(c, "num_key_value_heads", default=nh)
    hd = _pos(c, "head_dim", default=max(h // max(nh, 1), 1))
    inter = _pos(c, "intermediate_size")
    V = _pos(c, "vocab_size")
    tie = _bool(c, "tie_word_embeddings", False)
    c.check()
    P = "model.layers.{i}"
    groups = [
        _emb("embed_tokens", V, h, "model.embed_tokens"),
        _lin("qkv_proj", h, (nh + 2 * nkv) * hd, L, path=f"{P}.self_attn.qkv_proj"),
        _lin("o_proj", nh * hd, h, L, path=f"{P}.self_attn.o_proj"),
        _lin("gate_up_proj", h, 2 * inter, L, path=f"{P}.mlp.gate_up_proj"),
        _lin("down_proj", inter, h, L, path=f"{P}.mlp.down_proj"),
        _norm("input_layernorm", h, L, path=f"{P}.input_layernorm"),
        _norm("post_attention_layernorm", h, L, path=f"{P}.post_attention_layernorm"),
        _norm("norm", h, 1, per_layer=False, path="model.norm"),
    ]
    if not tie:
        groups.append(_head("lm_head", h, V))
    sw = cfg.get("sliding_window")
    return ModelSpec(
        name=name,
        model_type="phi3",
        arch_kind="decoder",
        hidden_size=h,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=V,
        groups=tuple(groups),
        mlp_kind="gated",
        norm_kind="rms",
        tie_word_embeddings=tie,
        max_position_embeddings=int(c.get("max_position_embeddings", 0) or 0),
        sliding_window=sw if isinstance(sw, int) and not isinstance(sw, bool) else None,
        config=cfg,
    )


@register("phi")
def _phi(cfg: dict, name: str) -> ModelSpec:
    """PhiForCausalLM (modeling_phi.py; Phi-1/1.5/2): q/k/v_proj and ``dense`` with bias, plain MLP ``fc1``/``fc2``
    (gelu_new) with bias, ONE LayerNorm per block feeding attention and MLP in parallel, ``final_layernorm``,
    ``lm_head`` with bias. Optional ``qk_layernorm`` (LayerNorm over head_dim on q and k). Partial rotary
    (``partial_rotary_factor``) changes no parameter."""
    c = _Cfg(cfg, name)
    h = _pos(c, "hidden_size")
    L = _pos(c, "num_hidden_layers")
    nh = _pos(c, "num_attention_heads")
    nkv = _pos(c, "num_key_value_heads", default=nh)
    hd = max(h // max(nh, 1), 1)
    inter = _pos(c, "intermediate_size")
    V = _pos(c, "vocab_size")
    tie = _bool(c, "tie_word_embeddings", False)
    qk_ln = _bool(c, "qk_layernorm", False)
    c.check()
    P = "model.layers.{i}"
    groups = [
        _emb("embed_tokens", V, h, "model.embed_tokens"),
        _lin("q_proj", h, nh * hd, L, True, path=f"{P}.self_attn.q_proj"),
        _lin("k_proj", h, nkv * hd, L, True, path=f"{P}.self_attn.k_proj"),
        _lin("v_proj", h, nkv * hd, L, True, path=f"{P}.self_attn.v_proj"),
        _lin("dense", nh * hd, h, L, True, path=f"{P}.self_attn.dense"),
        _lin("fc1", h, inter, L, True, path=f"{P}.mlp.fc1"),
        _lin("fc2", inter, h, L, True, path=f"{P}.mlp.fc2"),
        _ln("input_layernorm", h, L, path=f"{P}.input_layernorm"),
    ]
    if qk_ln:
        groups += [
            _ln("q_layernorm", hd, L, path=f"{P}.self_attn.q_layernorm"),
            _ln("k_layernorm", hd, L, path=f"{P}.self_attn.k_layernorm"),
        ]
    groups.append(_ln("final_layernorm", h, 1, per_layer=False, path="model.final_layernorm"))
    if not tie:
        groups.append(_head("lm_head", h, V, bias=True))
    else:  # PhiForCausalLM's lm_head has a bias even when its weight is tied to the embedding
        groups.append(
            ParamGroup(
                name="lm_head", kind="other", numel_each=V, count=1, per_layer=False, path="lm_head", module="Linear"
            )
        )
    return ModelSpec(
        name=name,
        model_type="phi",
        arch_kind="decoder",
        hidden_size=h,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=V,
        groups=tuple(groups),
        mlp_kind="plain",
        norm_kind="layer",
        parallel_attn=True,
        tie_word_embeddings=tie,
        max_position_embeddings=int(c.get("max_position_embeddings", 0) or 0),
        config=cfg,
    )


@register("falcon")
def _falcon(cfg: dict, name: str) -> ModelSpec:
    """FalconForCausalLM (modeling_falcon.py). Fused ``query_key_value``: (heads + 2*kv_heads) * head_dim outputs
    with ``new_decoder_architecture`` (Falcon-40B/180B: grouped KV, ``num_kv_heads``), hidden + 2*head_dim with
    ``multi_query`` (Falcon-7B: one KV head), else 3*hidden (Falcon-RW). ``dense``, plain MLP ``dense_h_to_4h`` /
    ``dense_4h_to_h`` (``ffn_hidden_size``, default 4*hidden), all with bias iff ``bias``. LayerNorms: parallel
    attention uses ``ln_attn`` + ``ln_mlp`` (new architecture, ``num_ln_in_parallel_attn`` 2) or one
    ``input_layernorm``; sequential blocks (``parallel_attn`` false) use ``input_layernorm`` +
    ``post_attention_layernorm``. ``lm_head`` is tied to ``word_embeddings`` by default.
    The linears are ``FalconLinear`` (an nn.Linear subclass): peft LoRA adapts them, but transformers 5.x's
    bitsandbytes replacement (``type(m) is nn.Linear``) skips them, so they are not ``quantizable``."""
    c = _Cfg(cfg, name)
    h = _pos(c, "hidden_size")
    L = _pos(c, "num_hidden_layers")
    nh = _pos(c, "num_attention_heads")
    V = _pos(c, "vocab_size")
    new_arch = _bool(c, "new_decoder_architecture", False)
    mq = _bool(c, "multi_query", True)
    parallel = _bool(c, "parallel_attn", True)
    bias = _bool(c, "bias", False)
    tie = _bool(c, "tie_word_embeddings", True)
    nkv_cfg = _pos(c, "num_kv_heads", default=nh)
    ffn = _pos(c, "ffn_hidden_size", default=4 * h)
    n_ln = c.cfg.get("num_ln_in_parallel_attn")
    c.check()
    hd = max(h // nh, 1)
    if new_arch:
        qkv_out, nkv = (2 * nkv_cfg + nh) * hd, nkv_cfg
    elif mq:
        qkv_out, nkv = h + 2 * hd, 1
    else:
        qkv_out, nkv = 3 * h, nh
    if n_ln is None and new_arch:
        n_ln = 2
    P = "transformer.h.{i}"
    groups = [
        _emb("word_embeddings", V, h, "transformer.word_embeddings"),
        _lin("query_key_value", h, qkv_out, L, bias, path=f"{P}.self_attention.query_key_value", module="FalconLinear"),
        _lin("dense", h, h, L, bias, path=f"{P}.self_attention.dense", module="FalconLinear"),
        _lin("dense_h_to_4h", h, ffn, L, bias, path=f"{P}.mlp.dense_h_to_4h", module="FalconLinear"),
        _lin("dense_4h_to_h", ffn, h, L, bias, path=f"{P}.mlp.dense_4h_to_h", module="FalconLinear"),
    ]
    if not parallel:
        groups += [
            _ln("input_layernorm", h, L, path=f"{P}.input_layernorm"),
            _ln("post_attention_layernorm", h, L, path=f"{P}.post_attention_layernorm"),
        ]
    elif n_ln == 2:
        groups += [_ln("ln_attn", h, L, path=f"{P}.ln_attn"), _ln("ln_mlp", h, L, path=f"{P}.ln_mlp")]
    else:
        groups.append(_ln("input_layernorm", h, L, path=f"{P}.input_layernorm"))
    groups.append(_ln("ln_f", h, 1, per_layer=False, path="transformer.ln_f"))
    if not tie:
        groups.append(_head("lm_head", h, V))
    return ModelSpec(
        name=name,
        model_type="falcon",
        arch_kind="decoder",
        hidden_size=h,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=ffn,
        vocab_size=V,
        groups=tuple(groups),
        mlp_kind="plain",
        norm_kind="layer",
        parallel_attn=parallel,
        tie_word_embeddings=tie,
        max_position_embeddings=int(c.get("max_position_embeddings", 2048) or 0),
        config=cfg,
    )


@register("gpt2")
def _gpt2(cfg: dict, name: str) -> ModelSpec:
    """GPT2LMHeadModel (modeling_gpt2.py): ``wte`` + learned positions ``wpe`` (n_positions), per block ``ln_1``,
    ``attn.c_attn`` (hidden -> 3*hidden), ``attn.c_proj``, ``ln_2``, ``mlp.c_fc`` (hidden -> n_inner, default
    4*hidden), ``mlp.c_proj``, all with bias; ``ln_f``; ``lm_head`` tied to ``wte``. The projections are
    ``Conv1D`` (weight stored (in, out)), not nn.Linear: peft adapts them (fan_in_fan_out), and transformers'
    bitsandbytes integration quantizes them after transposing, so they count as quantizable linears here.
    Cross-attention (``add_cross_attention``) is not modelled."""
    c = _Cfg(cfg, name)
    h = _pos(c, "n_embd", "hidden_size")
    L = _pos(c, "n_layer", "num_hidden_layers")
    nh = _pos(c, "n_head", "num_attention_heads")
    V = _pos(c, "vocab_size")
    npos = _pos(c, "n_positions", "max_position_embeddings", default=1024)
    inner = _pos(c, "n_inner", default=4 * h)
    tie = _bool(c, "tie_word_embeddings", True)
    if c.cfg.get("add_cross_attention"):
        c.problems.append("add_cross_attention=true (GPT-2 as a seq2seq decoder) is not supported")
    c.check()
    P = "transformer.h.{i}"
    groups = [
        _emb("wte", V, h, "transformer.wte"),
        _emb("wpe", npos, h, "transformer.wpe"),
        _ln("ln_1", h, L, path=f"{P}.ln_1"),
        _lin("c_attn", h, 3 * h, L, True, path=f"{P}.attn.c_attn", module="Conv1D"),
        _lin("c_proj", h, h, L, True, path=f"{P}.attn.c_proj", module="Conv1D"),
        _ln("ln_2", h, L, path=f"{P}.ln_2"),
        _lin("c_fc", h, inner, L, True, path=f"{P}.mlp.c_fc", module="Conv1D"),
        _lin("c_proj", inner, h, L, True, path=f"{P}.mlp.c_proj", module="Conv1D"),
        _ln("ln_f", h, 1, per_layer=False, path="transformer.ln_f"),
    ]
    if not tie:
        groups.append(_head("lm_head", h, V))
    return ModelSpec(
        name=name,
        model_type="gpt2",
        arch_kind="decoder",
        hidden_size=h,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nh,
        head_dim=max(h // nh, 1),
        intermediate_size=inner,
        vocab_size=V,
        groups=tuple(groups),
        mlp_kind="plain",
        norm_kind="layer",
        tie_word_embeddings=tie,
        max_position_embeddings=npos,
        config=cfg,
    )


# ---------------------------------------------------------------------------------------------- encoders


def _num_labels(c: _Cfg) -> int:
    """``num_labels`` as transformers derives it: from ``id2label`` when present, else ``num_labels``, else 2."""
    id2label = c.cfg.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    return _pos(c, "num_labels", default=2)


@register("bert")
def _bert(cfg: dict, name: str) -> ModelSpec:
    """BertForSequenceClassification (modeling_bert.py), the usual way a BERT checkpoint is fine-tuned:
    embeddings (``word_embeddings``, ``position_embeddings``, ``token_type_embeddings``, LayerNorm), per block
    ``query``/``key``/``value``, ``attention.output.dense``, ``intermediate.dense``, ``output.dense`` (all with
    bias; three different shapes share the leaf name ``dense``) and two LayerNorms (post-norm), then the
    ``pooler.dense`` and the ``classifier`` (hidden -> num_labels, bias). The MLM/NSP pre-training heads in the
    released checkpoint are dropped by this class."""
    c = _Cfg(cfg, name)
    h = _pos(c, "hidden_size")
    L = _pos(c, "num_hidden_layers")
    nh = _pos(c, "num_attention_heads")
    inter = _pos(c, "intermediate_size")
    V = _pos(c, "vocab_size")
    npos = _pos(c, "max_position_embeddings", default=512)
    ntype = _pos(c, "type_vocab_size", default=2)
    labels = _num_labels(c)
    c.check()
    P = "bert.encoder.layer.{i}"
    groups = [
        _emb("word_embeddings", V, h, "bert.embeddings.word_embeddings"),
        _emb("position_embeddings", npos, h, "bert.embeddings.position_embeddings"),
        _emb("token_type_embeddings", ntype, h, "bert.embeddings.token_type_embeddings"),
        _ln("LayerNorm", h, 1, per_layer=False, path="bert.embeddings.LayerNorm"),
        _lin("query", h, h, L, True, path=f"{P}.attention.self.query"),
        _lin("key", h, h, L, True, path=f"{P}.attention.self.key"),
        _lin("value", h, h, L, True, path=f"{P}.attention.self.value"),
        _lin("dense", h, h, L, True, path=f"{P}.attention.output.dense"),
        _ln("LayerNorm", h, L, path=f"{P}.attention.output.LayerNorm"),
        _lin("dense", h, inter, L, True, path=f"{P}.intermediate.dense"),
        _lin("dense", inter, h, L, True, path=f"{P}.output.dense"),
        _ln("LayerNorm", h, L, path=f"{P}.output.LayerNorm"),
        _lin("dense", h, h, 1, True, per_layer=False, path="bert.pooler.dense"),
        # the last parameter is classifier.bias, and transformers' quantizer keeps the module named like it
        # ("classifier.bias" names none): its 4-bit loading quantizes the classifier (quantizers/base.py)
        _lin("classifier", h, labels, 1, True, per_layer=False, path="classifier"),
    ]
    return ModelSpec(
        name=name,
        model_type="bert",
        arch_kind="encoder",
        hidden_size=h,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nh,
        head_dim=max(h // nh, 1),
        intermediate_size=inter,
        vocab_size=V,
        groups=tuple(groups),
        mlp_kind="plain",
        norm_kind="layer",
        max_position_embeddings=npos,
        encoder_layers=L,
        num_labels=labels,
        tie_word_embeddings=False,
        config=cfg,
    )


@register("t5")
def _t5(cfg: dict, name: str) -> ModelSpec:
    """T5ForConditionalGeneration (modeling_t5.py): one ``shared`` embedding (encoder and decoder ``embed_tokens``
    are the same tensor; so is ``lm_head``: transformers 5.x ties it for every T5, whatever the config says). Encoder block:
    ``SelfAttention`` q/k/v/o (heads*d_kv inner dim, no bias) + ``layer_norm`` (RMS-style, weight only), then
    ``DenseReluDense`` ``wi``/``wo`` (or gated ``wi_0``/``wi_1``/``wo`` for ``feed_forward_proj`` gated-*,
    T5 v1.1/Flan) + ``layer_norm``. Decoder blocks add ``EncDecAttention`` q/k/v/o + ``layer_norm``. Only block 0
    of each stack has ``relative_attention_bias`` (buckets x heads). ``final_layer_norm`` per stack.
    ``num_layers`` in the spec counts encoder + decoder blocks; ``encoder_layers`` the encoder's."""
    c = _Cfg(cfg, name)
    d = _pos(c, "d_model")
    dff = _pos(c, "d_ff")
    dkv = _pos(c, "d_kv")
    nh = _pos(c, "num_heads")
    Le = _pos(c, "num_layers")
    Ld = _pos(c, "num_decoder_layers", default=Le)
    V = _pos(c, "vocab_size")
    buckets = _pos(c, "relative_attention_num_buckets", default=32)
    # transformers 5.x (configuration_t5.py) forces tie_word_embeddings=True for every T5, v1.1/Flan included:
    # a ``false`` in the config only switches off the decoder-output scaling. So lm_head is always ``shared``.
    _bool(c, "tie_word_embeddings", True)
    tie = True
    ff = c.get("feed_forward_proj", "relu")
    if not isinstance(ff, str) or len(ff.split("-")) > 2 or (ff.count("-") == 1 and not ff.startswith("gated-")):
        c.problems.append(f"feed_forward_proj={ff!r} must be 'ACT' or 'gated-ACT'")
        ff = "relu"
    c.check()
    gated = ff.startswith("gated-")
    inner = nh * dkv
    groups: list[ParamGroup] = [_emb("shared", V, d, "shared")]
    for stack, n in (("encoder", Le), ("decoder", Ld)):
        B = f"{stack}.block.{{i}}"
        attns = [("SelfAttention", 0)] + ([("EncDecAttention", 1)] if stack == "decoder" else [])
        for attn, li in attns:
            for proj in ("q", "k", "v"):
                groups.append(_lin(proj, d, inner, n, path=f"{B}.layer.{li}.{attn}.{proj}"))
            groups.append(_lin("o", inner, d, n, path=f"{B}.layer.{li}.{attn}.o"))
            groups.append(_norm("layer_norm", d, n, path=f"{B}.layer.{li}.layer_norm", module="T5LayerNorm"))
        groups.append(
            ParamGroup(
                name="relative_attention_bias",
                kind="embedding",
                in_features=buckets,
                out_features=nh,
                count=1,
                per_layer=False,
                path=f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias",
                module="Embedding",
            )
        )
        fi = len(attns)
        if gated:
            groups += [
                _lin("wi_0", d, dff, n, path=f"{B}.layer.{fi}.DenseReluDense.wi_0"),
                _lin("wi_1", d, dff, n, path=f"{B}.layer.{fi}.DenseReluDense.wi_1"),
            ]
        else:
            groups.append(_lin("wi", d, dff, n, path=f"{B}.layer.{fi}.DenseReluDense.wi"))
        # T5's _keep_in_fp32_modules = ["wo"]: transformers' bitsandbytes loading leaves wo unquantized
        groups.append(_lin("wo", dff, d, n, path=f"{B}.layer.{fi}.DenseReluDense.wo", kept=True))
        groups.append(_norm("layer_norm", d, n, path=f"{B}.layer.{fi}.layer_norm", module="T5LayerNorm"))
        groups.append(
            _norm("final_layer_norm", d, 1, per_layer=False, path=f"{stack}.final_layer_norm", module="T5LayerNorm")
        )
    return ModelSpec(
        name=name,
        model_type="t5",
        arch_kind="encoder-decoder",
        hidden_size=d,
        num_layers=Le + Ld,
        num_heads=nh,
        num_kv_heads=nh,
        head_dim=dkv,
        intermediate_size=dff,
        vocab_size=V,
        groups=tuple(groups),
        mlp_kind="gated" if gated else "plain",
        norm_kind="rms",
        tie_word_embeddings=tie,
        max_position_embeddings=int(c.get("n_positions", 0) or 0),
        encoder_layers=Le,
        config=cfg,
    )


def build_spec(cfg: dict, name: str = "config") -> ModelSpec:
    """ModelSpec for a config dict: a hand-written builder for the families in :data:`BUILDERS`, else the inventory
    of the model transformers builds on the meta device (``oomdoctor.model.inventory``); BadInput for malformed
    configs and model types transformers cannot build."""
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise BadInput(
            f"{name}: config has no model_type; is it a Hugging Face config.json?",
            "pass a Hugging Face config.json, a directory holding one, or a bundled id (`oomdoctor models`)",
        )
    builder = BUILDERS.get(mt)
    if builder is None:
        from oomdoctor.model.inventory import spec_from_transformers

        return spec_from_transformers(cfg, name)  # any other type transformers builds (BadInput if it cannot)
    spec = builder(cfg, name)
    archs = cfg.get("architectures")
    if (
        spec.arch_kind == "decoder"
        and isinstance(archs, list)
        and archs
        and str(archs[0]).endswith("ForSequenceClassification")
    ):
        spec = _as_sequence_classifier(spec, cfg, name)
    return spec


def _as_sequence_classifier(spec: ModelSpec, cfg: dict, name: str) -> ModelSpec:
    """A decoder saved as ``*ForSequenceClassification`` (reward models, classifiers): transformers swaps the LM
    head for ``score`` (hidden -> num_labels, no bias; modeling_llama.py / modeling_gpt2.py /
    modeling_falcon.py ...). The input embedding stays; a tied ``lm_head`` simply disappears."""
    from dataclasses import replace

    c = _Cfg(cfg, name)
    labels = _num_labels(c)
    c.check()
    groups = [g for g in spec.groups if g.name != "lm_head"]
    groups.append(_head("score", spec.hidden_size, labels))
    return replace(spec, groups=tuple(groups), num_labels=labels, tie_word_embeddings=False)
