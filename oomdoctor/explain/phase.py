"""Which training phase a traceback shows (forward, loss, backward, optimizer step, evaluation, checkpoint save), read
from its frames: plain Python tracebacks and IPython/Jupyter/Colab ones."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple


class Frame(NamedTuple):
    """One traceback frame (a plain ``(file, line, func, code)`` tuple is accepted wherever a Frame is)."""

    path: str
    """Source file (or ``In [7]`` for a notebook cell)."""
    line: int
    """Line number."""
    func: str
    """Function name, without its class (``<cell>`` for a notebook cell)."""
    code: str
    """The source line shown under the frame, ``""`` when none is shown."""


_FRAME_RE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
# IPython/Jupyter/Colab: "File ~/lib/python3.10/site-packages/torch/_tensor.py:487, in Tensor.backward(self, ...)"
# followed by numbered source lines, the current one marked "--> 487 code"; the user's cell is "Cell In[7], line 3".
_IPY_FRAME_RE = re.compile(r"^\s*(?:File (\S.*?):(\d+), in ([\w.<>]+)|Cell (In\s*\[\d+\]), line (\d+))")
_IPY_CODE_RE = re.compile(r"^\s*-+>\s*(\d+)\s?(.*)$")


def _traceback_span(lines: tuple[str, ...] | list[str], upto: int) -> tuple[int, int]:
    """(start, stop) of the last traceback starting before line ``upto``; the whole text without a header."""
    for i in range(min(upto, len(lines) - 1), -1, -1):
        if "Traceback (most recent call last)" in lines[i]:
            return i, min(len(lines), upto + 1)
    return 0, len(lines)


def _python_frame(lines, i: int) -> Frame | None:
    m = _FRAME_RE.match(lines[i])
    if not m:
        return None
    code = ""
    if i + 1 < len(lines) and not _FRAME_RE.match(lines[i + 1]) and lines[i + 1].strip():
        code = lines[i + 1].strip()
    return Frame(m.group(1), int(m.group(2)), m.group(3), code)


def _ipython_frame(lines, i: int, stop: int) -> Frame | None:
    m = _IPY_FRAME_RE.match(lines[i])
    if not m:
        return None
    code = ""
    for j in range(i + 1, stop):
        if _IPY_FRAME_RE.match(lines[j]):
            break
        cm = _IPY_CODE_RE.match(lines[j])
        if cm:
            code = cm.group(2).strip()
            break
    func = (m.group(3) or "<cell>").split(".")[-1]
    return Frame(m.group(1) or m.group(4), int(m.group(2) or m.group(5)), func, code)


def find_frames(lines: tuple[str, ...] | list[str], upto: int) -> list[Frame]:
    """Frames of the last traceback that starts before line ``upto`` (every frame in the text without a header)."""
    start, stop = _traceback_span(lines, upto)
    frames = []
    for i in range(start, stop):
        frame = _python_frame(lines, i) or _ipython_frame(lines, i, stop)
        if frame:
            frames.append(frame)
    return frames


@dataclass(frozen=True)
class PhaseRule:
    """How frames show one phase: by function name, by the code line, or by the file's path."""

    phase: str
    """The phase (one of ``oomdoctor.explain.report.PHASES``)."""
    func: re.Pattern
    """Function names that run only in this phase."""
    code: re.Pattern
    """Calls on the shown code line that start this phase."""
    path: re.Pattern
    """Library files of this phase (decides for ``step`` / ``loss`` frames)."""


_NEVER = re.compile(r"$^")

# Checked in precedence order: an outer context (saving, evaluating) decides over what runs inside it (a forward
# pass, a loss); backward decides over the forward recomputation of gradient checkpointing inside it.
PHASE_RULES: tuple[PhaseRule, ...] = (
    PhaseRule(
        "checkpoint-save",
        re.compile(r"^(save_pretrained|save_model|_save_checkpoint|_save|save_state|save_checkpoint|"
                   r"_save_optimizer_and_scheduler|merge_and_unload|save_file|save_lora_weights|"
                   r"get_peft_model_state_dict|_full_post_state_dict_hook|full_state_dict)$"),
        re.compile(r"torch\.save\(|save_pretrained\(|save_model\(|merge_and_unload\(|save_checkpoint\(|save_state\("),
        _NEVER,
    ),
    PhaseRule(
        "evaluation",
        re.compile(r"^(evaluate|_evaluate|evaluation_loop|prediction_loop|prediction_step|predict|validation_step|"
                   r"eval_step|evaluate_loop|run_evaluation|_run_evaluation|eval_loop|test_step)$"),
        re.compile(r"\bevaluate\(|prediction_step\(|evaluation_loop\(|\.predict\(|validation_step\("),
        _NEVER,
    ),
    PhaseRule(
        "optimizer-step",
        re.compile(r"^(_multi_tensor_adamw?|_single_tensor_adamw?|_fused_adamw?|adamw?|_init_group|"
                   r"optimizer_step|_multi_tensor_sgd|_single_tensor_sgd|update_step|init_state|prefetch_state)$"),
        re.compile(r"\boptimizer\.step\(|\boptim\.step\(|scaler\.step\(|optimizer_step\(|\bopt\.step\("),
        re.compile(r"/torch/optim/|/bitsandbytes/optim/|/accelerate/optimizer\.py|/transformers/optimization\.py"),
    ),
    PhaseRule(
        "backward",
        re.compile(r"^(_engine_run_backward|run_backward|manual_backward|unpack_hook|recompute_fn|backward_step)$"),
        re.compile(r"\.backward\(|accelerator\.backward\(|autograd\.backward\(|autograd\.grad\("),
        re.compile(r"/torch/autograd/"),
    ),
    PhaseRule(
        "loss",
        re.compile(r"^(cross_entropy|nll_loss|loss_function|ForCausalLMLoss|ForMaskedLMLoss|fixed_cross_entropy|"
                   r"ForSequenceClassificationLoss|ForTokenClassification|chunked_cross_entropy|"
                   r"LigerFusedLinearCrossEntropy\w*)$"),
        re.compile(r"cross_entropy\(|loss_function\(|loss_fct\(|CrossEntropyLoss|ForCausalLMLoss|nll_loss\("),
        re.compile(r"/transformers/loss/"),
    ),
    PhaseRule(
        "forward",
        re.compile(r"^(forward|_forward|_call_impl|_wrapped_call_impl|training_step|compute_loss)$"),
        re.compile(r"\bmodel\(|self\.model\(|outputs = |self\.lm_head\(|hidden_states = "),
        re.compile(r"/transformers/models/|/torch/nn/modules/|/peft/tuners/"),
    ),
)

#: Phases shown by their innermost frame (the module that ran out); the others by their outermost (the user's call).
INNERMOST_PHASES = ("forward", "loss")


def frame_shows(rule: PhaseRule, frame: tuple[str, int, str, str]) -> bool:
    """True when ``frame`` shows ``rule``'s phase."""
    path, _, func, code = frame
    p = path.replace("\\", "/")
    if rule.phase == "backward" and func == "backward" and ("/torch/" in p or "/accelerate/" in p):
        return True
    if rule.phase == "optimizer-step" and func == "step" and rule.path.search(p):
        return True
    if rule.func.match(func) or (code and rule.code.search(code)):
        # The Trainer's training_step/compute_loss frames tell "forward" only through the call on their line.
        return not (rule.phase == "forward" and func in ("training_step", "compute_loss")
                    and not rule.code.search(code))
    return rule.phase == "loss" and bool(rule.path.search(p))


def frame_str(frame: tuple[str, int, str, str]) -> str:
    """``dir/file.py:line in func: code``."""
    path, line, func, code = frame
    short = "/".join(path.replace("\\", "/").split("/")[-2:])
    return f"{short}:{line} in {func}" + (f": {code}" if code else "")


def detect_phase(frames: list[tuple[str, int, str, str]]) -> tuple[str | None, str | None]:
    """The phase a traceback shows and the frame that shows it (``None`` when no frame tells)."""
    found: dict[str, tuple[str, int, str, str]] = {}
    for frame in frames:
        for rule in PHASE_RULES:
            if rule.phase in found and rule.phase not in INNERMOST_PHASES:
                continue
            if frame_shows(rule, frame):
                found[rule.phase] = frame
    for rule in PHASE_RULES:
        if rule.phase in found:
            return rule.phase, frame_str(found[rule.phase])
    return None, None
