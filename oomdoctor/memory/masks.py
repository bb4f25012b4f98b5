"""Tensors the model's forward makes once for all its blocks: rotary cos/sin and the attention masks (eager's 4-D
float masks, SDPA's sliding-window boolean mask, T5's cross-attention bias), and when they are freed.
"""

from __future__ import annotations

from oomdoctor.memory.context import Ctx
from oomdoctor.model.quirks import effective_attn


def sliding_fraction(c: Ctx) -> float:
    """Share of the blocks whose attention SDPA runs with a materialized sliding-window mask: blocks attending
    within ``spec.sliding_window`` (``layer_types`` entries ``sliding_attention``; Qwen2 with
    ``use_sliding_window``: blocks from ``max_window_layers`` on; else every block) when the sequence is longer than
    the window — shorter, transformers skips the mask (``masking_utils._ignore_causal_mask_sdpa``)."""
    spec, w = c.spec, c.spec.sliding_window
    if not w or c.S <= w:
        return 0.0
    L = max(spec.num_layers, 1)
    kinds = spec.config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return sum(k == "sliding_attention" for k in kinds) / len(kinds)
    if spec.model_type == "qwen2":
        first = spec.config.get("max_window_layers")
        return (L - min(first if isinstance(first, int) else L, L)) / L
    return 1.0


def shared_forward_bytes(c: Ctx) -> int:
    """Tensors shared by all blocks during forward: rotary cos/sin (positions of batch 1) and the attention masks
    (:func:`forward_mask_bytes`)."""
    spec = c.spec
    cos_sin = 2 * c.S * spec.head_dim * c.rb if spec.model_type not in ("gpt2", "bert", "t5") else 0
    return cos_sin + forward_mask_bytes(c)


def forward_mask_bytes(c: Ctx) -> int:
    """The masks the model makes before its blocks: for eager a 4-D float causal mask (B x 1 x S x S in the
    residual dtype) per attention kind in ``layer_types`` (Gemma 2's full and sliding blocks: two), for SDPA with
    sliding-window blocks their boolean mask (S x S expanded over the batch; full-attention blocks run
    ``is_causal`` without one). No op saves them (``scores + mask``; SDPA saves its own additive copy, priced per
    block), so they die when the model's forward returns, before the loss — unless checkpointed blocks hold them as
    recompute arguments until their backward (measured with the simulated engine on tiny Llama blocks, eager fp32:
    the mask was priced at the loss, +2 % before). T5's zero cross-attention bias is saved by every SDPA: counted
    here, never freed early."""
    spec = c.spec
    impl = effective_attn(spec, c.plan.attn)
    kinds = spec.config.get("layer_types")
    n_kinds = len({k for k in kinds if str(k).endswith("attention")}) if isinstance(kinds, list) else 0
    mask = max(n_kinds, 1) * c.rb * c.B * c.S * c.S if impl == "eager" else 0  # one per attention kind
    if impl == "sdpa" and sliding_fraction(c):
        mask += c.S * c.S  # one boolean S x S, expanded (not copied) over the batch
    if spec.model_type == "t5" and impl != "eager":
        mask += c.ab * spec.num_heads * c.S * c.S  # the decoder's zero cross-attention bias, saved by every SDPA
    return mask


def released_mask_bytes(c: Ctx) -> int:
    """Mask bytes gone after the model's forward (:func:`forward_mask_bytes`): all of them without checkpointing
    (T5's bias excepted), none with it."""
    if c.plan.gradient_checkpointing or c.spec.model_type == "t5":
        return 0
    return forward_mask_bytes(c)
