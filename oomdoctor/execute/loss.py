"""The chunked causal-LM loss (plan ``loss: chunked``): the LM head and cross-entropy over token chunks.

transformers' ``ForCausalLMLoss`` materializes the logits of every token (``tokens x vocab`` in the compute dtype),
upcasts them to fp32 and keeps the log-probabilities for backward: with 128k-256k vocabularies that is the peak of
many fine-tunes. Liger's fused linear cross-entropy and Apple's cut-cross-entropy never hold more than a chunk.
This is the same memory behaviour in pure torch: the final hidden states are split into chunks of ``C`` tokens;
each chunk's ``lm_head -> (softcap) -> float -> cross_entropy(sum)`` runs under non-reentrant activation
checkpointing, so only the chunk's input is kept and its logits are recomputed in backward. The sum over chunks
divided by ``num_items_in_batch`` equals transformers' loss (same shift, same -100 masking).

Chunk size: ``oomdoctor.memory.logits.chunk_tokens`` (Liger's rule), the size the memory model prices. Cost: one more LM-head forward per step (the recompute).
"""

from __future__ import annotations

from typing import Any

from oomdoctor.memory.logits import chunk_tokens

IGNORE_INDEX = -100


def _chunk_loss(head: Any, softcap: float | None, h, labels):
    import torch

    logits = head(h)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


#: Name of the method an FSDP2 root runs the chunked loss through (:func:`_through_fsdp_root`).
_FSDP_METHOD = "_oomdoctor_chunked_loss"


def _through_fsdp_root(model: Any):
    """The chunked loss as a method of an FSDP2 root (``register_fsdp_forward_method``), or None when ``model`` is not
    one. The loss calls the decoder and the head directly, not ``model.forward``: without this the root unit
    (embeddings, final norm, LM head) would never be gathered nor its gradients reduce-scattered."""
    import torch.distributed as dist

    if not dist.is_available():  # torch built without distributed support: no FSDP either
        return None
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return None
    if _FSDP_METHOD not in vars(model):
        setattr(model, _FSDP_METHOD, lambda batch, n: _chunked_loss(model, batch, n))
        register_fsdp_forward_method(model, _FSDP_METHOD)
    return getattr(model, _FSDP_METHOD)


def chunked_causal_lm_loss(model: Any, batch: dict, num_items_in_batch: int | None = None):
    """The causal-LM loss of ``model`` (a transformers ``*ForCausalLM``, possibly wrapped by peft, possibly the root
    of an FSDP2 model) on ``batch`` (``input_ids``, ``labels``, optional ``attention_mask`` / ``position_ids``),
    computed chunk by chunk.

    Returns ``sum(token losses) / num_items_in_batch`` (or the mean over target tokens without it)."""
    fsdp_root = _through_fsdp_root(model)
    if fsdp_root is not None:
        return fsdp_root(batch, num_items_in_batch)
    return _chunked_loss(model, batch, num_items_in_batch)


def _chunked_loss(model: Any, batch: dict, num_items_in_batch: int | None):
    import torch
    from torch.utils.checkpoint import checkpoint

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = decoder(**inputs)[0]
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    softcap = getattr(base.config, "final_logit_softcapping", None)
    c = chunk_tokens(
        h.shape[0], h.shape[-1], head.weight.shape[0] if hasattr(head, "weight") else base.config.vocab_size
    )
    total = None
    for i in range(0, h.shape[0], c):
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_loss, head, softcap, h[i : i + c], y[i : i + c], use_reentrant=False)
        else:  # eval: nothing to recompute
            part = _chunk_loss(head, softcap, h[i : i + c], y[i : i + c])
        total = part if total is None else total + part
    if num_items_in_batch is None:
        return total / (y != IGNORE_INDEX).sum().clamp(min=1)
    return total / num_items_in_batch


__all__ = ["chunked_causal_lm_loss"]
