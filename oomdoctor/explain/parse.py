"""``parse_oom``: find the out-of-memory message in a log or traceback (:mod:`oomdoctor.explain.parsers`) and add
what its traceback shows: the phase (:mod:`oomdoctor.explain.phase`), the failing line, the ranks that reported it.

Lines may carry ``[rank3]:`` / ``[default0]:`` prefixes (torchrun) and messages may be wrapped over several lines or
stored as one escaped string in a JSON log (:mod:`oomdoctor.explain.text`).
"""

from __future__ import annotations

from oomdoctor.errors import BadInput
from oomdoctor.explain.parsers import find_message, fsdp
from oomdoctor.explain.phase import detect_phase, find_frames, frame_str
from oomdoctor.explain.report import OomReport
from oomdoctor.explain.text import FlatText, flatten

NO_OOM = (
    "no out-of-memory error found in the input (looked for PyTorch CUDA/HIP/XPU/MPS/CPU allocator "
    "messages, 'CUDA error: out of memory', FSDP clone warnings, bitsandbytes/accelerate offload errors, "
    "accelerate's 'No executable batch size found' and the Linux OOM killer)"
)
NO_OOM_HINT = "pass the full log or traceback, e.g. `python train.py 2>&1 | oomdoctor explain -`"


def _ranks(text: FlatText, line: int) -> tuple[int, ...]:
    """Ranks that reported an OOM; else the rank of the message's own line; else none."""
    ranks = tuple(sorted(set(text.oom_ranks()) | fsdp.clone_ranks(text.flat)))
    if not ranks and text.line_ranks[line] is not None:
        return (text.line_ranks[line],)
    return ranks


def parse_oom(text: str) -> OomReport:
    """Find the out-of-memory message in ``text`` (a log or traceback) and read its numbers.

    Raises :class:`BadInput` ("no out-of-memory error found") when the text holds none.
    """
    flat = flatten(text)
    found = find_message(flat)
    if found is None:
        raise BadInput(NO_OOM, NO_OOM_HINT)
    line = flat.line_of(found.start)
    frames = find_frames(flat.lines, line)
    phase, frame = detect_phase(frames)
    if found.message.kind == "fsdp-clone-warning":
        phase, frame = "checkpoint-save", frame or fsdp.clone_frame(found.message.tensor_name)
    return OomReport.of(
        found.message,
        phase=phase,
        phase_frame=frame,
        failing_frame=frame_str(frames[-1]) if frames else None,
        ranks=_ranks(flat, line),
    )
