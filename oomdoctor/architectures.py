"""Module inventories per architecture, from config.json alone (pure Python: no torch, no transformers).

Each builder mirrors the module tree of the transformers implementation for that ``model_type`` (names as in HF,
so LoRA ``target_modules`` match), and a test checks every bundled config against a meta-device build of the real
transformers model: same parameter count, same linear shapes.
"""

from __future__ import annotations

from typing import Callable

from oomdoctor.errors import BadInput
from oomdoctor.spec import ModelSpec, ParamGroup

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
            raise BadInput(
                f"{self.name}: malformed {self.cfg.get('model_type', '?')} config: " + "; ".join(self.problems),
                "pass a complete Hugging Face config.json (see `oomdoctor models` for bundled ones)",
            )


def _lin(name: str, i: int, o: int, count: int, bias: bool = False, per_layer: bool = True) -> ParamGroup:
    return ParamGroup(name=name, kind="linear", in_features=i, out_features=o, bias=bias, count=count, per_layer=per_layer)


def _norm(name: str, numel: int, count: int, per_layer: bool = True) -> ParamGroup:
    return ParamGroup(name=name, kind="norm", numel_each=numel, count=count, per_layer=per_layer)


def _emb(name: str, num: int, dim: int) -> ParamGroup:
    return ParamGroup(name=name, kind="embedding", in_features=num, out_features=dim, count=1, per_layer=False)


@register("llama", "mistral", "qwen2", "gemma", "gemma2", "mixtral", "qwen3", "olmo2", "granite")
def _llama_like(cfg: dict, name: str) -> ModelSpec:
    """LlamaForCausalLM and its close relatives (transformers models/llama/modeling_llama.py):
    q/k/v/o_proj (+bias if attention_bias; Qwen2 has q/k/v bias), gate/up/down_proj (SwiGLU/GeGLU),
    RMSNorm before attention and MLP (Gemma2 adds pre/post feed-forward norms), final norm, lm_head (tied or not).
    Mixtral replaces the MLP with ``num_local_experts`` experts (w1/w3 gate/up, w2 down) and a router ``gate``."""
    c = _Cfg(cfg, name)
    mt = cfg.get("model_type", "llama")
    h = c.int("hidden_size")
    L = c.int("num_hidden_layers")
    nh = c.int("num_attention_heads")
    nkv = c.int("num_key_value_heads", default=nh)
    hd = c.int("head_dim", default=h // max(nh, 1))
    inter = c.int("intermediate_size")
    V = c.int("vocab_size")
    c.check()
    qkv_bias = bool(c.get("attention_bias", mt == "qwen2"))
    mlp_bias = bool(c.get("mlp_bias", False))
    tie = bool(c.get("tie_word_embeddings", mt in ("gemma", "gemma2")))
    groups = [
        _emb("embed_tokens", V, h),
        _lin("q_proj", h, nh * hd, L, qkv_bias),
        _lin("k_proj", h, nkv * hd, L, qkv_bias),
        _lin("v_proj", h, nkv * hd, L, qkv_bias),
        _lin("o_proj", nh * hd, h, L, bool(c.get("attention_bias", False)) and mt != "qwen2"),
    ]
    n_exp = int(c.get("num_local_experts", 0) or 0)
    if mt == "mixtral" and n_exp:
        groups += [
            _lin("gate", h, n_exp, L),  # router
            _lin("w1", h, inter, L * n_exp),
            _lin("w2", inter, h, L * n_exp),
            _lin("w3", h, inter, L * n_exp),
        ]
    else:
        groups += [
            _lin("gate_proj", h, inter, L, mlp_bias),
            _lin("up_proj", h, inter, L, mlp_bias),
            _lin("down_proj", inter, h, L, mlp_bias),
        ]
    groups += [_norm("input_layernorm", h, L), _norm("post_attention_layernorm", h, L)]
    if mt == "gemma2":
        groups += [_norm("pre_feedforward_layernorm", h, L), _norm("post_feedforward_layernorm", h, L)]
    if mt in ("qwen3",):
        groups += [_norm("q_norm", hd, L), _norm("k_norm", hd, L)]
    groups.append(_norm("norm", h, 1, per_layer=False))
    if not tie:
        groups.append(_lin("lm_head", h, V, 1, per_layer=False))
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
        experts_per_token=int(c.get("num_experts_per_tok", 0) or 0) if n_exp else 0,
        tie_word_embeddings=tie,
        max_position_embeddings=int(c.get("max_position_embeddings", 0) or 0),
        sliding_window=c.get("sliding_window"),
        config=cfg,
    )


def build_spec(cfg: dict, name: str = "config") -> ModelSpec:
    """ModelSpec for a config dict; raises BadInput for unknown model types or malformed configs."""
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise BadInput(
            f"{name}: config has no model_type; is it a Hugging Face config.json?",
            "pass a Hugging Face config.json, a directory holding one, or a bundled id (`oomdoctor models`)",
        )
    builder = BUILDERS.get(mt)
    if builder is None:
        raise BadInput(
            f"{name}: model_type {mt!r} is not supported yet (supported: {', '.join(sorted(BUILDERS))})",
            "pick a bundled model (`oomdoctor models`) or open an issue with its config.json",
        )
    return builder(cfg, name)
