"""Is a failed request the logits? ``tokens x vocab x 2|4 bytes`` for a common (or the user's) vocabulary."""

from __future__ import annotations

from oomdoctor.units import format_bytes

GiB = 2**30
MiB = 2**20

# Common vocabulary sizes (for "this request is the logits"), most used first: Llama-3 128256, Llama-2/Mistral 32000,
# Qwen2 151936/152064, Gemma 256000, Gemma-3 262144, GPT-2 50257, Pythia 50304, Phi-2 51200, Phi-3 32064. Power-of-two
# vocabularies (Mistral-Nemo 131072, Gemma-3 262144) are left out: they match every power-of-two sized tensor.
COMMON_VOCABS: tuple[int, ...] = (
    128256, 32000, 151936, 152064, 256000, 50257, 50304, 51200, 32064)


def logits_match(requested: int, vocabs: tuple[int, ...], tokens_hint: int | None = None) -> str | None:
    """If ``requested`` is (within print rounding) tokens x vocab x 4|2 bytes, say so; else ``None``.

    torch prints sizes with two decimals, so a request is known to +-0.005 of its unit. To keep chance matches rare
    the token count must be the user's micro-batch x sequence length (``tokens_hint``) or a power of two >= 512
    (micro-batch and sequence length usually are); the result reads "consistent with", a heuristic, not proof.
    """
    unit = GiB if requested > GiB else (MiB if requested > MiB else 1024)
    tol = 0.005 * unit + 1
    candidates = ([tokens_hint] if tokens_hint else []) + [2**k for k in range(9, 21)]
    for v in vocabs:
        for nbytes, what in ((4, "fp32"), (2, "bf16/fp16")):
            for k in candidates:
                if abs(k * v * nbytes - requested) <= tol:
                    who = "your micro-batch x sequence length" if k == tokens_hint else "micro-batch x sequence length"
                    return (
                        f"{format_bytes(requested)} = {k} x vocab {v} x {nbytes} bytes ({what}): consistent with the "
                        f"logits of {who} = {k} tokens"
                        + (" (or with an embedding/lm_head weight of that vocabulary)" if k <= 16384 else "")
                    )
    return None
