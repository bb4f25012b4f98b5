"""What makes a model's blocks differ, read from its transformers config: the replay plans of the block measurement
(``engines/blocks.py``) and the simulated engine's extrapolation period (``engines/simulate.py``) share it.

A block's kind is the tuple of its entries in the config's per-layer lists (``layer_types``...), index lists
(``moe_layers``, Llama-3.2-Vision's ``cross_attention_layers``...) and index rules (``first_k_dense_replace``, Jamba's
periods...), as transformers' config class fills them in. Pure Python apart from building the config.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from oomdoctor.execute.build import LAYER_KEYS, PER_LAYER_KEY, hf_config, per_layer_overrides

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan

#: Per-layer lists in a transformers config that hold block indices (membership marks a block's kind).
INDEX_LIST_KEYS = frozenset(
    {
        "mlp_only_layers",
        "moe_layers",
        "full_attn_idxs",
        "attn_layer_indices",
        "cross_attention_layers",
        "hybrid_layer_ids",
    }
)
#: Config keys that vary blocks with their index: ``key: (value, i, config) -> kind of block i``. Jamba's and
#: Zamba's periods mark the blocks ``i mod period == offset`` (``JambaConfig.layers_block_type``,
#: ``layers_num_experts``); the other periods give each position in the period a kind of its own (a safe superset).
_INDEX_RULES = {
    "first_k_dense_replace": lambda v, i, d: i < v,
    "max_window_layers": lambda v, i, d: i >= v,
    "moe_layer_start_index": lambda v, i, d: i >= v,
    "moe_layer_end_index": lambda v, i, d: i <= v,
    "attn_layer_period": lambda v, i, d: bool(v) and i % v == d.get("attn_layer_offset", 0),
    "expert_layer_period": lambda v, i, d: bool(v) and i % v == d.get("expert_layer_offset", 0),
    **{
        k: (lambda v, i, d: i % v if v else 0)
        for k in (
            "moe_layer_interval",
            "decoder_sparse_step",
            "interleave_moe_layer_step",
            "no_rope_layer_interval",
            "sliding_window_pattern",
            "_sliding_window_pattern",
        )
    },
}
#: Config keys about layers that do not make blocks differ (sizes, and the offsets their periods read).
_NOT_PER_LAYER = frozenset(
    {
        "layer_norm_eps",
        "layer_norm_epsilon",
        "num_nextn_predict_layers",
        "mtp_layers_block_type",
        "expert_layer_offset",
        "attn_layer_offset",
        "vocab_size_per_layer_input",
        "hidden_size_per_layer_input",
    }
) | set(LAYER_KEYS)
#: Index rules whose per-block list the config also holds, which the modeling code reads instead (Gemma 3's and
#: EXAONE 4's ``layer_types`` from ``sliding_window_pattern``, Llama 4's ``no_rope_layers`` and ``moe_layers``).
_SUBSUMED = {
    "sliding_window_pattern": "layer_types",
    "_sliding_window_pattern": "layer_types",
    "no_rope_layer_interval": "no_rope_layers",
    "interleave_moe_layer_step": "moe_layers",
}
#: Config keys whose per-block meaning the config class spells out as a per-block list property, read instead
#: (Gemma 3n/4: the last ``num_kv_shared_layers`` blocks reuse earlier blocks' keys and values).
_PROPERTY_OF = {"num_kv_shared_layers": "kv_sharing_modes"}
_LAYER_KEY = re.compile(r"layer|pattern|interval|step_?$|freq|period|idxs|indices|first_k")


def layer_kinds(spec: "ModelSpec", plan: "Plan") -> list | None:
    """What makes each block differ from the others, per block, as transformers' config says (its per-layer lists,
    index lists and index rules, read after the config class filled them in): None when the config has a
    layer-related key this does not understand (the replay then runs every block)."""
    tc = hf_config(spec, plan).get_text_config()
    d = tc.to_dict()
    L = spec.num_layers
    kinds: list[list] = [[] for _ in range(L)]
    overrides = per_layer_overrides(d)  # a block's own attributes (Gemma 4's global blocks: their head_dim)
    for i in range(L):
        kinds[i].append(json.dumps(overrides.get(i, {}), sort_keys=True, default=str))
    for key, v in d.items():
        if (
            not _LAYER_KEY.search(key)
            or key in _NOT_PER_LAYER
            or v is None
            or key.startswith("time_step")
            or key == PER_LAYER_KEY
            or isinstance(d.get(_SUBSUMED.get(key, "")), list)
        ):
            continue
        per_block = getattr(tc, _PROPERTY_OF[key], None) if key in _PROPERTY_OF else None
        if isinstance(per_block, list) and len(per_block) == L:
            for i in range(L):
                kinds[i].append(per_block[i])
        elif key in INDEX_LIST_KEYS and isinstance(v, list):
            for i in range(L):
                kinds[i].append(i in v)
        elif isinstance(v, (list, str)) and len(v) == L:
            for i in range(L):
                kinds[i].append(v[i])
        elif key in _INDEX_RULES and isinstance(v, int):
            for i in range(L):
                kinds[i].append(_INDEX_RULES[key](v, i, d))
        else:
            return None
    return [tuple(k) for k in kinds]


def replay_plan(kinds: list) -> tuple[int, int]:
    """(q, p) for the fewest blocks to replay: blocks after ``q + 1`` repeat with period ``p`` (``kinds[i] ==
    kinds[i - p]``), so blocks ``0 .. q + p`` are replayed; block 0 is always its own (under LoRA its input needs
    no gradient)."""
    L = len(kinds)
    best = (L, 0)
    for q in range(L):
        for p in range(1, L - q):
            if q + p + 1 >= L or q + p >= sum(best):
                break
            if all(kinds[i] == kinds[i - p] for i in range(q + 1 + p, L)):
                best = (q, p)
                break
    return best


def replay_depth(spec: "ModelSpec", plan: "Plan") -> tuple[int, int]:
    """(q, p) of :func:`replay_plan` for the model, or (L, 0) to replay every block."""
    kinds = layer_kinds(spec, plan)
    return replay_plan(kinds) if kinds else (spec.num_layers, 0)


def extend(measured: tuple[int, ...], q: int, p: int, num_layers: int) -> tuple[int, ...]:
    """Per-block bytes of all ``num_layers`` blocks from a replay of blocks ``0 .. q + p`` (block ``i > q + p`` is
    of the kind of replayed block ``q + 1 + ((i - q - 1) mod p)``)."""
    if p == 0:
        return measured
    return tuple(measured[i] if i < len(measured) else measured[q + 1 + (i - q - 1) % p] for i in range(num_layers))


def layer_period(spec: "ModelSpec", plan: "Plan") -> int | None:
    """Blocks per repeating unit: 1 when every block is built the same way, p when the blocks repeat with period p
    from block 0 (Gemma 2 alternates sliding-window and global attention: p = 2; Llama-3.2-Vision's image
    cross-attention every 5th block, skipped on text: p = 5), as transformers' config says
    (:func:`layer_kinds`); the whole model when the kinds have no such period; None when memory is not
    periodic in the block count (MoE: data-dependent routing). A config with a layer key the kinds do not read
    (GPT-2's ``scale_attn_by_inverse_layer_idx``...) counts as uniform."""
    if spec.num_experts or spec.arch_kind != "decoder":
        return None
    kinds = layer_kinds(spec, plan)
    if kinds is None:
        return 1
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))
