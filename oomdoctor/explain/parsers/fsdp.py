"""FSDP's ``UserWarning: Failed to clone() tensor with name X on rank N ... Error: CUDA out of memory...``: an OOM
that only warns, during ``state_dict()`` at checkpoint time. The numbers are the CUDA message's
(:mod:`oomdoctor.explain.parsers.cuda` reads them); this module recognises the warning around it."""

from __future__ import annotations

import re

_CLONE_RE = re.compile(r"Failed to clone\(\) tensor with name (\S+) on rank (\d+)")

#: Appended to the report's notes: what the warning means for the saved checkpoint.
NOTE = (
    "FSDP only warned: the run went on, but the saved state-dict entry may point to invalid memory "
    "(the checkpoint can be silently broken)"
)


def clone_tensor_before(flat: str, oom_start: int) -> str | None:
    """The state-dict entry whose clone failed, when the first clone warning introduces the OOM at ``oom_start``."""
    clone = _CLONE_RE.search(flat)
    if clone and clone.start() < oom_start + 10 and flat.rfind("Failed to clone", 0, oom_start) >= 0:
        return clone.group(1)
    return None


def clone_ranks(flat: str) -> set[int]:
    """Ranks named by clone warnings (``on rank N``)."""
    return {int(m.group(2)) for m in _CLONE_RE.finditer(flat)}


def clone_frame(tensor_name: str | None) -> str:
    """What to show as the checkpoint-save frame when the traceback shows none."""
    return "FSDP state_dict() clone of " + str(tensor_name)
