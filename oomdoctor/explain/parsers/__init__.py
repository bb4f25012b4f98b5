"""One parser per out-of-memory message format; :data:`PARSERS` lists them in precedence order (a caching-allocator
message, with its numbers, wins over an echo of it such as ``CUDA error: out of memory``)."""

from __future__ import annotations

from oomdoctor.explain.parsers import batch_size, cpu, cuda, cuda_error, mps, offload, oom_killer
from oomdoctor.explain.parsers.base import Found, Parser
from oomdoctor.explain.text import FlatText

#: Every parser, in precedence order.
PARSERS: tuple[Parser, ...] = (
    cuda.parse,
    mps.parse,
    cpu.parse,
    oom_killer.parse,
    offload.parse,
    batch_size.parse,
    cuda_error.parse,
)


def find_message(text: FlatText) -> Found | None:
    """The message of the first parser (in precedence order) that finds one."""
    for parser in PARSERS:
        found = parser(text)
        if found is not None:
            return found
    return None


__all__ = ["PARSERS", "Found", "Parser", "find_message"]
