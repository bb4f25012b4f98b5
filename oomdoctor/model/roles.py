"""Linear roles: the per-layer linears of a :class:`ModelSpec` sorted by what they read and feed (attention input and
output, MLP input and output, MoE router), by shape first and by module name where shapes are ambiguous. Used by the
activation formulas (``memory/activations``), evaluation pricing (``memory/evaluation``) and the throughput model
(``tune/throughput``). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from oomdoctor.model.spec import HEAD_NAMES, ModelSpec


@dataclass(frozen=True)
class LayerRoles:
    """Per-layer linear groups of a spec sorted by role, with instances per layer (count / num_layers)."""

    attn_in: tuple[tuple[str, int, int, float], ...]
    """(name, in, out, per-layer multiplicity) of linears reading the attention norm output (q/k/v or fused qkv)."""
    attn_out: tuple[tuple[str, int, int, float], ...]
    """The attention output projections (-> hidden)."""
    mlp_in: tuple[tuple[str, int, int, float], ...]
    """The MLP input projections (gate/up, fused gate_up, fc1); expert groups weighted by experts_per_token / E."""
    mlp_out: tuple[tuple[str, int, int, float], ...]
    """The MLP output projections (down, fc2); expert groups weighted like ``mlp_in``."""
    router: tuple[tuple[str, int, int, float], ...]
    """MoE routers (hidden -> experts)."""
    attn_blocks: float
    """Attention blocks per layer (2 for a T5 decoder layer with cross-attention, averaged over all layers)."""
    mlp_tokens: float
    """Tokens through the MLP per token (experts_per_token for MoE, else 1)."""
    fused_up: bool
    """gate and up are one linear of 2*intermediate (Phi-3)."""


#: Attention input projections by module name (separate or fused q/k/v), classified before the shape rules.
ATTN_IN_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "qkv_proj",
        "query_key_value",
        "c_attn",
        "Wqkv",
        "W_pack",
        "query",
        "key",
        "value",
        "q",
        "k",
        "v",
    }
)


#: MLP projections by module name: classify them when the intermediate size equals the hidden size, where their
#: shapes look like the attention's.
MLP_IN_NAMES = frozenset(
    {"gate_proj", "up_proj", "gate_up_proj", "fc1", "w1", "w3", "c_fc", "dense_h_to_4h", "wi", "wi_0", "wi_1"}
)


MLP_OUT_NAMES = frozenset({"down_proj", "fc2", "w2", "dense_4h_to_h", "wo"})


@lru_cache(maxsize=256)
def layer_roles(spec: ModelSpec) -> LayerRoles:
    """Classify per-layer linears by shape: MLP up (h -> I or 2I), MLP down (I -> h), router (h -> experts),
    attention output (-> h), attention input (h -> ...)."""
    h, inter = spec.hidden_size, spec.intermediate_size
    L = max(spec.num_layers, 1)
    E, k = spec.num_experts, spec.experts_per_token
    attn_in, attn_out, mlp_in, mlp_out, router = [], [], [], [], []
    fused_up = False
    for g in spec.groups:
        if g.kind != "linear" or not g.per_layer or g.name in HEAD_NAMES:
            continue
        mult = g.count / L
        item = (g.name, g.in_features, g.out_features, mult)
        if E and g.out_features == E and g.in_features == h:
            router.append(item)
        elif g.name in ATTN_IN_NAMES:
            attn_in.append(item)  # by name first: a fused qkv of 3h outputs looks like an MLP input when I == 3h
        elif g.in_features == h and g.out_features in (inter, 2 * inter) and inter != h:
            fused_up = fused_up or g.out_features == 2 * inter
            mlp_in.append(item)
        elif g.in_features == inter and g.out_features == h and inter != h:
            mlp_out.append(item)
        elif inter == h and g.name in MLP_IN_NAMES:
            mlp_in.append(item)
        elif inter == h and g.name in MLP_OUT_NAMES:
            mlp_out.append(item)
        elif g.out_features == h and g.in_features != h:
            attn_out.append(item)
        elif g.in_features == h and g.out_features != h:
            attn_in.append(item)
        elif g.name.endswith(("o_proj", "o", "out_proj", "dense", "c_proj", "wo")) and not g.name.startswith(
            ("mlp", "fc")
        ):
            attn_out.append(item)
        else:
            attn_in.append(item)
    n_attn = sum(m for *_x, m in attn_out) or 1.0
    if E:
        # Expert groups repeat E times per layer; each token visits k of them.
        mlp_in = [(n, i, o, m * k / E if m >= E - 1e-9 else m) for n, i, o, m in mlp_in]
        mlp_out = [(n, i, o, m * k / E if m >= E - 1e-9 else m) for n, i, o, m in mlp_out]
    mlp_tokens = float(k) if E else 1.0
    return LayerRoles(
        tuple(attn_in), tuple(attn_out), tuple(mlp_in), tuple(mlp_out), tuple(router), n_attn, mlp_tokens, fused_up
    )
