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

``loss: chunked`` (``oomdoctor.execute.loss``): the same terms for one chunk of ``C`` tokens
(``chunk_tokens``: about ``T·H / V`` tokens, so a chunk's logits are the size of the hidden states) and nothing kept
from the forward into backward.

Limits: HF computes logits for every position (``logits_to_keep=0``), labels of -100 still cost memory; Liger's
fused kernel (which computes the gradient in the forward) is priced as the pure-torch chunked loss; T5-style seq2seq losses
(``CrossEntropyLoss`` on the logits without upcast) are priced in the logits dtype with the decoder length taken
equal to ``seq_len``; encoder classifiers have a ``B x num_labels`` head (negligible).
"""

from __future__ import annotations

from dataclasses import dataclass

import math

from oomdoctor.memory.context import Ctx


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk of the chunked loss (Liger's ``LigerFusedLinearCrossEntropyFunction`` rule):
    ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))``, at least 1 — a chunk of logits holds about as many
    elements as the hidden states. ``oomdoctor.execute.loss`` runs with this size."""
    chunks = max(1, math.ceil(vocab / max(hidden, 1)))
    n = max(1, math.ceil(tokens / chunks))
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class LogitsMemory:
    forward_peak: int
    """Peak logits/loss bytes during the forward (at the loss)."""
    saved: int
    """Bytes kept from the end of forward into backward."""
    backward_peak: int
    """Peak logits/loss bytes at the start of backward."""
    head_output: int
    """Bytes of the head's output (the logits in the compute dtype; one chunk's under the chunked loss)."""


def logits_memory(c: Ctx) -> LogitsMemory:
    spec = c.spec
    if spec.arch_kind == "encoder":
        n = max(spec.num_labels, 2) * c.B * 4
        return LogitsMemory(3 * n, n, 3 * n, n)
    T, V = c.T, spec.vocab_size
    if c.plan.loss == "chunked" and spec.arch_kind == "decoder":
        # oomdoctor.execute.loss: the same tensors for one chunk of C tokens at a time; nothing is kept from the
        # forward (each chunk is recomputed in backward, where it peaks like the standard loss does)
        T = chunk_tokens(T, spec.hidden_size, V)
    lb = 2 if c.mixed else c.ab  # autocast runs the head's matmul in bf16/fp16
    if spec.arch_kind == "decoder":
        upcast = 4 if lb != 4 else 0  # ForCausalLMLoss: logits.float()
        ce = 4
    else:
        upcast, ce = 0, lb
    fwd = (lb + upcast + ce) * T * V
    # peft LoRA on the head adds fp32 T x V transients (lora_B output, the promoted sum) that peak at ~lb+8 bytes
    # per logit, no more than the loss's lb+4+4: the loss stays the forward peak.
    saved = ce * T * V if c.plan.loss != "chunked" else 0
    bwd = 3 * ce * T * V
    if spec.config.get("final_logit_softcapping") is not None:
        # Gemma-2: logits / cap -> tanh (keeps its output for backward) -> * cap: one more lb·T·V kept until the
        # head's backward (modeling_gemma2.py).
        fwd += lb * T * V
        saved += lb * T * V
        bwd += lb * T * V
    if c.plan.loss == "chunked" and spec.arch_kind == "decoder":
        # each chunk's input is a slice of the final hidden states: its backward (``slice_backward``) makes a
        # zero-filled gradient of the whole hidden states, which autograd sums chunk by chunk into one buffer
        # (traced with the simulated engine: alive through the chunks' loss backward)
        bwd += c.rb * c.T * spec.hidden_size
        if c.full:
            # the head's weight gradient arrives chunk by chunk: autograd sums the partials, so next to the running
            # sum one partial of vocab x hidden is alive; measured with the simulated engine (CPU) as one
            # fp32-sized buffer in fp32 and in bf16 (the bf16 matmul's fp32 output) — on CUDA a bf16 partial is
            # half of that
            bwd += 4 * V * spec.hidden_size
    return LogitsMemory(fwd, saved, bwd, lb * T * V)
