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

import math
from dataclasses import dataclass

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


#: Trainers whose chunked loss is Liger's fused linear cross-entropy (``use_liger_kernel`` / axolotl's Liger plugin /
#: ``apply_liger_kernel_to_<model>`` in a user's script: ``oomdoctor.plan.targets``), by the liger-kernel version
#: priced (axolotl 0.19 pins 0.8.1).
LIGER_TRAINERS: dict[str, str] = {"hf": "0.8.5", "accelerate": "0.8.5", "axolotl": "0.8.1"}


def fused_head(plan) -> bool:
    """Whether the loss reads the LM head's weight directly and never runs the head module (TRL's fused LM head,
    Liger's fused linear cross-entropy): no autocast copy of the whole head weight, nothing saved by a head."""
    return plan.trainer == "trl" or (plan.loss == "chunked" and plan.trainer in LIGER_TRAINERS)


def logits_memory(c: Ctx) -> LogitsMemory:
    spec = c.spec
    if c.plan.trainer == "trl" and spec.arch_kind == "decoder":
        return trl_fused_head(c)
    if fused_head(c.plan) and spec.arch_kind == "decoder":
        return liger_fused_linear_ce(c)
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


#: TRL 1.16 ``trainer/utils.py`` ``_CHUNKED_LOGPROB_CHUNK_SIZE``: vocabulary columns per projection tile.
TRL_VOCAB_CHUNK = 32768
#: TRL 1.16 ``kernels/chunked_logprob.py`` ``TOKEN_CHUNK_SIZE``: token rows per projection tile.
TRL_TOKEN_CHUNK = 4096
#: fp32 per-token buffers ``_ChunkedLogProbFunction.forward`` allocates before its tiles (running max, sum of
#: exponentials, its x- and square-weighted sums, sum of logits, max before the target, target logit).
TRL_TOKEN_BUFFERS = 7


def trl_fused_head(c: Ctx) -> LogitsMemory:
    """TRL's fused LM head, SFTTrainer's only loss (trl 1.16), as its CUDA path allocates it — what the replay of its
    own step (``engines/trainers.py``) runs, op by op.

    ``trainer/utils.py`` ``add_fused_lm_head._fused_forward`` (lines 1599-1665): the backbone's last hidden states
    minus the last position and the labels minus the first; ``mask = labels != -100``; on a Triton device only the
    valid positions are scored (``compact``): ``hidden_states[mask]`` (a copy, N x h in the residual dtype) and
    ``labels[mask]`` (int64); after the function each requested output (log-probs, entropy: fp32; is_top1: bool) is
    scattered back into a (B, S - 1) tensor (``masked_scatter``). N = B·(S - 1): every label of a full batch is
    valid but the one the shift drops.

    ``kernels/chunked_logprob.py`` ``_ChunkedLogProbFunction`` (lines 311-465): forward — 7 fp32 per-token buffers,
    one ``[min(N, TOKEN_CHUNK_SIZE), chunk_size]`` tile buffer in the compute dtype (the autocast dtype, else the
    hidden states' — its width is the chunk size even for a smaller vocabulary), per token chunk the hidden rows cast
    to the compute dtype (a copy unless already in it; the previous chunk's is alive while the next is made), per
    vocabulary chunk the weight rows cast (a temporary of the ``mm`` call); saves the compact hidden states, the
    weight, the targets, ``log_z`` and the entropy (fp32, N each). Backward — fp32 zero-filled gradients of the
    compact hidden states (and of the weight when the head trains), a new tile buffer, the same casts (the weight
    chunk is a named variable: the previous one is alive while the next is made), ``_addmm_fp32`` into the fp32
    accumulators (CUDA: ``addmm(out_dtype=float32)``, no temporaries); at the return, with the last chunks and the
    tile buffer still alive, the gradients cast to the hidden states' / the weight's dtype (a copy unless fp32).
    The incoming gradient is one fp32 value per valid token (``masked_scatter``'s backward). The Triton kernels
    write into the buffers above and allocate nothing.

    ``forward_peak``: beyond the blocks' and the final norm's saves, the final norm's output (alive in the fused
    forward) and everything above at the tile loop's costliest moment. ``saved``: what the function and the mask
    keep into backward. ``backward_peak``: those, the incoming gradient, the fp32 gradients, the tile buffer and the
    costliest of the loop's and the return's moments. No head module runs: no autocast copy of the head weight
    (``parameters.amp_weight_copy_bytes``) and nothing saved by a head (``activations.final_saved``)."""
    spec = c.spec
    h, V = spec.hidden_size, spec.vocab_size
    N = c.B * max(c.S - 1, 0)
    n0 = min(N, TRL_TOKEN_CHUNK)
    n1 = min(max(N - n0, 0), TRL_TOKEN_CHUNK)  # the second token chunk's rows
    n_last = N - TRL_TOKEN_CHUNK * ((N - 1) // TRL_TOKEN_CHUNK) if N else 0
    c1 = min(V, TRL_VOCAB_CHUNK)
    c2 = min(max(V - c1, 0), TRL_VOCAB_CHUNK)
    c_last = V - TRL_VOCAB_CHUNK * ((V - 1) // TRL_VOCAB_CHUNK)
    cd = 2 if c.autocast else c.ab  # compute dtype: autocast's, else the hidden states' (fp32 plans: 4)
    hb = c.rb  # the final norm's output: the hidden states the head reads
    wb = c.wb  # the head weight's dtype
    hc = cd if hb != cd else 0  # bytes of a hidden-chunk cast (0: no copy)
    wc = cd if wb != cd else 0  # bytes of a weight-chunk cast
    tile = n0 * TRL_VOCAB_CHUNK * cd
    kept = N * (1 + 8 + 4 + 4) + N * h * hb  # mask, targets, log_z, entropy, compact hidden states
    fwd_loop = max(hc * n0 + wc * c1, hc * (n0 + n1)) * h
    forward = hb * c.T * h + kept - 8 * N + TRL_TOKEN_BUFFERS * 4 * N + tile + fwd_loop
    grads = 4 * N * h + (4 * V * h if c.full else 0)
    bwd_loop = max(hc * n0 + wc * (c1 + c2), hc * (n0 + n1) + wc * c_last) * h
    bwd_return = (
        (hc * n_last + wc * c_last) * h + (hb * N * h if hb != 4 else 0) + (wb * V * h if c.full and wb != 4 else 0)
    )
    backward = kept + 4 * N + grads + tile + max(bwd_loop, bwd_return)
    return LogitsMemory(forward, kept, backward, tile)


def liger_chunk_tokens(tokens: int, hidden: int, vocab: int, version: str = "0.8.5") -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (liger-kernel ``ops/fused_linear_cross_entropy.py``
    ``fused_linear_cross_entropy_forward``: ``next_power_of_2(cdiv(BT, cdiv(V, H)))``, capped at BT since 0.8.5)."""
    c = chunk_tokens(tokens, hidden, vocab)
    return min(c, tokens) if version != "0.8.1" else c


def liger_fused_linear_ce(c: Ctx) -> LogitsMemory:
    """Liger's fused linear cross-entropy (``LigerForCausalLMLoss`` -> ``LigerFusedLinearCrossEntropyFunction``),
    the chunked loss of the HF Trainer (``use_liger_kernel``), axolotl's Liger plugin and an accelerate script, as
    its CUDA path allocates — by formula from liger-kernel's source (Triton kernels cannot run here; research note
    /work/notes/research-axolotl-liger.md §14, liger-kernel 0.8.5 ``ops/fused_linear_cross_entropy.py`` lines
    95-415, 0.8.1 lines 55-270; ``transformers/model/loss_utils.py`` lines 67-106).

    BT = B·S tokens (the labels are padded, then shifted); the gradients are computed in the forward, chunk by chunk:
    ``grad_input`` (zeros like the hidden states, BT x h), ``grad_weight`` (zeros like the head weight, in its
    dtype: ``accum_dtype`` is None on these paths) when the head trains, ``loss_1d`` (fp32) and ``target_mask``
    (bool) per token, and one logits chunk of ``c`` tokens (:func:`liger_chunk_tokens`) in the matmul's dtype (the
    autocast dtype, else the hidden states'), turned into its gradient in place by the cross-entropy kernel. 0.8.5
    reuses one chunk buffer and updates ``grad_weight`` with ``addmm(out=)`` (sm >= 8: no temporary); 0.8.1
    allocates each chunk while the previous one is referenced (two alive) and, for a 16-bit ``grad_weight``, adds
    ``mm(...).float()`` (V x h in the matmul's dtype and in fp32). Under autocast with fp32 weights the head weight
    is cast per chunk (V x h, 16-bit) and ``grad_logits @ weight`` lands in a 16-bit temporary before the fp32
    ``grad_input`` (c x h). Kept into backward: ``grad_input`` and ``grad_weight`` (the backward only scales them in
    place). Assumed: an Ampere-or-newer GPU, ``grad_weight`` handed to ``.grad`` without a copy."""
    spec = c.spec
    h, V, T = spec.hidden_size, spec.vocab_size, c.T
    version = LIGER_TRAINERS[c.plan.trainer]
    chunk = liger_chunk_tokens(T, h, V, version)
    bx, bl, bw = c.rb, (2 if c.autocast else c.ab), c.wb
    gw = bw * V * h if c.full else 0
    kept = bx * T * h + gw  # grad_input, grad_weight
    logits = chunk * V * bl
    extra = (2 * V * h + bl * chunk * h) if c.mixed else 0  # the head weight's cast, grad_input's chunk
    if version == "0.8.1":
        tw = (bl + 4) * V * h if c.full and bw != 4 else 0
        logits = max(2 * logits, logits + tw) + bl * chunk * h
    forward = bx * T * h + kept + 5 * T + logits + extra
    return LogitsMemory(forward, kept, kept, chunk * V * bl)
