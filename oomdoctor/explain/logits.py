"""Is a failed request the logits? ``tokens x vocab x 2|4 bytes`` for a common (or the user's) vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.units import format_bytes

GiB = 2**30
MiB = 2**20

# Common vocabulary sizes (for "this request is the logits"), most used first: Llama-3 128256, Llama-2/Mistral 32000,
# Qwen2 151936/152064, Gemma 256000, Gemma-3 262144, GPT-2 50257, Pythia 50304, Phi-2 51200, Phi-3 32064. Power-of-two
# vocabularies (Mistral-Nemo 131072, Gemma-3 262144) are left out: they match every power-of-two sized tensor.
COMMON_VOCABS: tuple[int, ...] = (128256, 32000, 151936, 152064, 256000, 50257, 50304, 51200, 32064)
#: Whole sequences tried when the sequence length is known: up to this many (an eval batch, or the eval batches the
#: Trainer has gathered so far).
MAX_SEQUENCES = 256


@dataclass(frozen=True)
class LogitsShape:
    """What the logits of the run that ran out could look like."""

    vocabs: tuple[int, ...] = COMMON_VOCABS
    """Vocabulary sizes to try: the user's model's (``--model``), else :data:`COMMON_VOCABS`."""
    tokens: int | None = None
    """The user's micro-batch x sequence length, when the plan is known."""
    seq_len: int | None = None
    """The user's sequence length: 1 to :data:`MAX_SEQUENCES` whole sequences of it are tried too."""
    model: str | None = None
    """The user's model, named when the request matches its logits."""


def token_counts(shape: LogitsShape) -> list[tuple[int, str]]:
    """Token counts to try, each with what it would be: the user's micro-batch x sequence length, whole sequences of
    the user's length, and powers of two >= 512 (micro-batch and sequence length usually are)."""
    counts = [(shape.tokens, "your micro-batch x sequence length")] if shape.tokens else []
    if shape.seq_len:
        counts += [
            (b * shape.seq_len, f"{b} sequence(s) of your {shape.seq_len} tokens") for b in range(1, MAX_SEQUENCES + 1)
        ]
    return counts + [(2**k, "micro-batch x sequence length") for k in range(9, 21)]


def logits_match(requested: int, shape: LogitsShape) -> str | None:
    """If ``requested`` is (within print rounding) tokens x vocab x 4|2 bytes, say so; else ``None``.

    torch prints sizes with two decimals, so a request is known to +-0.005 of its unit. To keep chance matches rare
    the token count must come from the user's plan (:func:`token_counts`) or be a power of two >= 512; the result
    reads "consistent with", a heuristic, not proof.
    """
    unit = GiB if requested > GiB else (MiB if requested > MiB else 1024)
    tol = 0.005 * unit + 1
    counts = token_counts(shape)
    for v in shape.vocabs:
        for nbytes, what in ((4, "fp32"), (2, "bf16/fp16")):
            for k, who in counts:
                if abs(k * v * nbytes - requested) <= tol:
                    whose = f"the logits of {shape.model}" if shape.model else "the logits"
                    return (
                        f"{format_bytes(requested)} = {k} tokens x vocab {v} x {nbytes} bytes ({what}): consistent "
                        f"with {whose} for {who} = {k} tokens"
                        + (" (or with an embedding/lm_head weight of that vocabulary)" if k <= 16384 else "")
                    )
    return None
