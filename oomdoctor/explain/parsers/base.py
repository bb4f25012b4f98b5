"""What every parser returns: the one message it read and where it starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText


@dataclass(frozen=True)
class Found:
    """One out-of-memory message found in the text."""

    message: OomMessage
    """What it says, as numbers."""
    start: int
    """Offset in ``FlatText.flat`` where it starts (its traceback is the one before that line)."""


#: A parser: the first message of its format in the text, or ``None`` when the text holds none.
Parser = Callable[[FlatText], "Found | None"]
