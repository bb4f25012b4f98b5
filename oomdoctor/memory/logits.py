"""Logits and loss: the vocab x tokens tensors of the language-model head, its fp32 upcast, the cross-entropy
intermediates and the logits gradient, at each phase.

Source: transformers ``loss/loss_utils.py: ForCausalLMLoss`` (``logits = logits.float()`` then
``nn.functional.cross_entropy`` = ``log_softmax`` + ``nll_loss``), transformers issue #30860 (removing the upcast
"divides the memory peak by more than 2 on Llama3"); torch autograd formulas (``log_softmax`` saves its output,
``nll_loss`` backward materializes a zero-filled gradient of the log-probabilities).

Per micro-batch of T tokens and vocabulary V (``lb``: bytes of the head output, bf16 under autocast; ``ce``:
bytes of the loss's log-probabilities, fp32 for causal LMs):

* forward peak (inside ``log_softmax``): logits ``lb·T·V`` + fp32 upcast ``4·T·V`` (when ``lb`` != 4) +
  log-probabilities ``ce·T·V``;
* kept for backward: the log-probabilities ``ce·T·V`` (the model's ``outputs.logits`` is dropped before backward,
  as Trainer's ``compute_loss`` returns only the loss);
* backward peak (``_log_softmax_backward_data``): log-probabilities + their gradient + the logits' gradient,
  ``3·ce·T·V``; then the gradient is cast back to ``lb`` for the head's backward.

Limits: HF computes logits for every position (``logits_to_keep=0``), labels of -100 still cost memory; chunked /
fused linear-cross-entropy (Liger, ``trl`` ``chunked_nll``) is not modelled; T5-style seq2seq losses
(``CrossEntropyLoss`` on the logits without upcast) are priced in the logits dtype with the decoder length taken
equal to ``seq_len``; encoder classifiers have a ``B x num_labels`` head (negligible).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.memory.context import Ctx


@dataclass(frozen=True)
class LogitsMemory:
    forward_peak: int
    """Peak logits/loss bytes during the forward (at the loss)."""
    saved: int
    """Bytes kept from the end of forward into backward."""
    backward_peak: int
    """Peak logits/loss bytes at the start of backward."""


def logits_memory(c: Ctx) -> LogitsMemory:
    spec = c.spec
    if spec.arch_kind == "encoder":
        n = max(spec.num_labels, 2) * c.B * 4
        return LogitsMemory(3 * n, n, 3 * n)
    T, V = c.T, spec.vocab_size
    lb = 2 if c.mixed else c.ab  # autocast runs the head's matmul in bf16/fp16
    if spec.arch_kind == "decoder":
        upcast = 4 if lb != 4 else 0  # ForCausalLMLoss: logits.float()
        ce = 4
    else:
        upcast, ce = 0, lb
    fwd = (lb + upcast + ce) * T * V
    # peft LoRA on the head adds fp32 T x V transients (lora_B output, the promoted sum) that peak at ~lb+8 bytes
    # per logit, no more than the loss's lb+4+4: the loss stays the forward peak.
    saved = ce * T * V
    bwd = 3 * ce * T * V
    if spec.config.get("final_logit_softcapping") is not None:
        # Gemma-2: logits / cap -> tanh (keeps its output for backward) -> * cap: one more lb·T·V kept until the
        # head's backward (modeling_gemma2.py).
        fwd += lb * T * V
        saved += lb * T * V
        bwd += lb * T * V
    return LogitsMemory(fwd, saved, bwd)
