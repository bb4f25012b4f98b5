"""transformers/accelerate refusing a bitsandbytes-quantized model that ``device_map="auto"`` spilled to CPU/disk
(``Some modules are dispatched on the CPU or the disk. Make sure you have enough GPU RAM to fit the quantized
model...``, ``You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload``)."""

from __future__ import annotations

import re

from oomdoctor.explain.parsers.base import Found
from oomdoctor.explain.report import OomMessage
from oomdoctor.explain.text import FlatText

_QUANT_RE = re.compile(
    r"Some modules are dispatched on the CPU or the disk\.? Make sure you have enough GPU RAM to fit"
    r"\s+the quantized model"
    r"|You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk offload"
)
_NOTE = (
    "raised while loading the model: device_map='auto' placed some quantized modules on the "
    "CPU/disk because the GPU had too little free memory at load time"
)


def parse(text: FlatText) -> Found | None:
    m = _QUANT_RE.search(text.flat)
    if not m:
        return None
    return Found(
        OomMessage(
            kind="quantized-offload",
            format="transformers/accelerate",
            device="cuda",
            message=m.group(0),
            notes=(_NOTE,),
        ),
        m.start(),
    )
