"""accelerate's ``No executable batch size found, reached zero.`` (HF ``auto_find_batch_size`` after OOMs at every
batch size)."""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText

_EXHAUSTED_RE = re.compile(r"No executable batch size found, reached zero")
_NOTE = (
    "accelerate's find_executable_batch_size (HF auto_find_batch_size) shrank the batch after every OOM it "
    "caught (by 10% per retry in accelerate 1.x, by half in older releases) until it reached zero; the OOM "
    "messages themselves were swallowed"
)


def parse(text: FlatText) -> Found | None:
    m = _EXHAUSTED_RE.search(text.flat)
    if not m:
        return None
    return Found(
        OomMessage(kind="batch-size-exhausted", format="accelerate", device="cuda", message=m.group(0), notes=(_NOTE,)),
        m.start(),
    )
