"""Measured blocks: what each block of a model saves and holds transiently, measured by replaying the blocks' real
code (``engines/blocks``) and scaled to a plan's tokens — the types the analytic engine takes for blocks its
formulas do not know.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.memory.context import Ctx


@dataclass(frozen=True)
class BlockBytes:
    """What the blocks of a model keep for backward and hold transiently at one token count (bytes)."""

    per_block: tuple[int, ...]
    """One entry per block, bottom first: the activation bytes autograd saves while the block runs."""
    final: int
    """The activation bytes saved between the last block and the output head (the final norm)."""
    forward_transient: int
    """The largest peak of a block's forward above what all blocks save (``engines/blocks.forward_over_saves``)."""
    backward_transient: int
    """The largest peak of a block's backward above the bytes alive when it starts, its weights' gradients included
    (under gradient checkpointing: with its recompute)."""
    backward_over_gradients: int
    """The largest peak of a block's backward above the bytes alive when it starts and the weight gradients it makes:
    what the bottom moment adds to gradients it counts as made already (a hybrid stack's MoE blocks make far more
    than the average block)."""


@dataclass(frozen=True)
class BlockSaves:
    """What each block of a model keeps for backward and holds transiently, measured by replaying the blocks' real
    code (``oomdoctor.engines.blocks``) at micro-batch 1 and 2 with the plan's gradient checkpointing: what the
    analytic engine uses for blocks its formulas do not know."""

    one: BlockBytes
    """Measured at micro-batch 1."""
    two: BlockBytes
    """Measured at micro-batch 2: the difference is what grows with the tokens; the rest is the same for any batch
    (weight-sized tensors: the gradients a block's backward makes, the merged W' of peft's ``ParamWrapper``)."""
    checkpointed: bool
    """Measured with gradient checkpointing: ``per_block`` is then empty of what checkpointed blocks save (each keeps
    its input, a formula) and the transients are those of checkpointed blocks."""
    seq_len: int
    """The sequence length measured at."""

    def scale(self, c: Ctx) -> float:
        """The plan's tokens in measured micro-batches: exact in the batch and in every term linear in the sequence;
        the measurement runs at the next power of two (``engines/blocks.measured_plan``), so a term quadratic in the
        sequence (eager scores, sliding-window masks) is over-priced by less than 2x between."""
        return c.B * c.S / self.seq_len

    def at(self, c: Ctx) -> BlockBytes:
        """The bytes at the plan's tokens: the weight-sized part as measured, the token part scaled (the line
        through the two measurements)."""
        k = self.scale(c)

        def line(a: int, b: int) -> int:
            return max(0, int(a + (b - a) * (k - 1)))

        one, two = self.one, self.two
        return BlockBytes(
            tuple(line(a, b) for a, b in zip(one.per_block, two.per_block)),
            line(one.final, two.final),
            line(one.forward_transient, two.forward_transient),
            line(one.backward_transient, two.backward_transient),
            line(one.backward_over_gradients, two.backward_over_gradients),
        )
