"""Which phase a traceback shows (model load, forward, loss, backward, optimizer step, evaluation, checkpoint save), read
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
    """Library files every frame of which shows this phase."""


_NEVER = re.compile(r"$^")

# Checked in precedence order: an outer context (saving, evaluating, loading) decides over what runs inside it (a
# forward pass, a loss, a module's .to()); backward decides over the forward recomputation of gradient checkpointing
# inside it. Frame names are those of transformers 5.x (Trainer, modeling_utils, core_model_loading), TRL 1.x,
# accelerate 1.x, peft, bitsandbytes, DeepSpeed, torch.distributed (FSDP1/2, DCP) and Lightning 2.x.
PHASE_RULES: tuple[PhaseRule, ...] = (
    PhaseRule(
        "checkpoint-save",
        re.compile(
            r"^(save_pretrained|save_model|_save_checkpoint|_save|save_state|save_checkpoint|"
            r"_save_optimizer_and_scheduler|merge_and_unload|save_file|save_torch_state_dict|"
            r"save_lora_weights|get_peft_model_state_dict|_full_post_state_dict_hook|full_state_dict|"
            r"state_dict|get_state_dict|get_model_state_dict|_get_model_state_dict|get_optimizer_state_dict|"
            r"_gather_state_dict|_offload_state_dict_to_cpu|save_fsdp_model|save_fsdp_optimizer|"
            r"_zero3_consolidated_16bit_state_dict|save_16bit_model|consolidate_state_dict|"
            r"dump_checkpoint)$"
        ),
        re.compile(
            r"torch\.save\(|save_pretrained\(|save_model\(|merge_and_unload\(|save_checkpoint\(|save_state\(|"
            r"get_(?:model_|optimizer_)?state_dict\(|\.state_dict\(\)|save_16bit_model\(|save_file\(|"
            r"dcp\.save\("
        ),
        _NEVER,
    ),
    PhaseRule(
        "evaluation",
        re.compile(
            r"^(evaluate|_evaluate|evaluation_loop|prediction_loop|prediction_step|predict|validation_step|"
            r"eval_step|evaluate_loop|run_evaluation|_run_evaluation|eval_loop|test_step|predict_step|"
            r"_evaluation_step|_predict_step|_on_evaluation_epoch_end|on_validation_epoch_end|"
            r"on_test_epoch_end|on_predict_epoch_end|on_validation_batch_end|validation_epoch_end|validate|"
            r"run_eval|eval_epoch|evaluate_model)$"
        ),
        re.compile(r"\bevaluate\(|prediction_step\(|evaluation_loop\(|\.predict\(|validation_step\(|\.validate\("),
        re.compile(
            r"/lightning/pytorch/loops/(?:evaluation|prediction)_loop\.py|"
            r"/pytorch_lightning/loops/(?:evaluation|prediction)_loop\.py"
        ),
    ),
    PhaseRule(
        "model-load",
        re.compile(
            r"^(from_pretrained|_from_pretrained|_load_pretrained_model|load_state_dict|"
            r"_load_state_dict_into_meta_model|_load_state_dict_into_zero3_model|"
            r"convert_and_load_state_dict_in_model|caching_allocator_warmup|set_param_for_module|"
            r"load_checkpoint_and_dispatch|load_checkpoint_in_model|dispatch_model|"
            r"set_module_tensor_to_device|set_module_quantized_tensor_to_device|replace_with_bnb_linear|"
            r"create_quantized_param|_move_model_to_device|prepare_model|prepare_model_for_kbit_training|"
            r"_load_from_checkpoint|_load_best_model|_load_optimizer_and_scheduler|load_state|"
            r"load_checkpoint|load_adapter|load_model|_quantize|quantize_4bit)$"
        ),
        re.compile(
            r"from_pretrained\(|\.load_state_dict\(|torch\.load\(|load_checkpoint_and_dispatch\(|"
            r"dispatch_model\(|prepare_model_for_kbit_training\(|"
            r"\b(?:model|module|self\.model)\.(?:to|cuda)\("
        ),
        re.compile(r"/transformers/core_model_loading\.py|/transformers/quantizers/|/accelerate/big_modeling\.py"),
    ),
    PhaseRule(
        "optimizer-step",
        re.compile(
            r"^(_multi_tensor_adamw?|_single_tensor_adamw?|_fused_adamw?|adamw?|_init_group|"
            r"optimizer_step|_multi_tensor_sgd|_single_tensor_sgd|update_step|init_state|prefetch_state)$"
        ),
        re.compile(r"\boptimizer\.step\(|\boptim\.step\(|scaler\.step\(|optimizer_step\(|\bopt\.step\("),
        re.compile(r"/torch/optim/|/bitsandbytes/optim/|/accelerate/optimizer\.py|/transformers/optimization\.py"),
    ),
    PhaseRule(
        "backward",
        re.compile(r"^(_engine_run_backward|run_backward|manual_backward|unpack_hook|recompute_fn|backward_step)$"),
        re.compile(r"\.backward\(|accelerator\.backward\(|autograd\.backward\(|autograd\.grad\("),
        _NEVER,  # autograd's files also run in forward (Function.apply)
    ),
    PhaseRule(
        "loss",
        re.compile(
            r"^(cross_entropy|nll_loss|loss_function|ForCausalLMLoss|ForMaskedLMLoss|fixed_cross_entropy|"
            r"ForSequenceClassificationLoss|ForTokenClassification|chunked_cross_entropy|"
            r"LigerFusedLinearCrossEntropy\w*|selective_log_softmax|entropy_from_logits)$"
        ),
        re.compile(r"cross_entropy\(|loss_function\(|loss_fct\(|CrossEntropyLoss|ForCausalLMLoss|nll_loss\("),
        re.compile(r"/transformers/loss/"),
    ),
    PhaseRule(
        "forward",
        re.compile(r"^(forward|_forward|_call_impl|_wrapped_call_impl|training_step|compute_loss)$"),
        re.compile(r"\bmodel\(|self\.model\(|outputs = |self\.lm_head\(|hidden_states = "),
        _NEVER,  # model and nn.Module files also run in loading (.to) and evaluation
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
    if rule.phase == "model-load" and func in ("to", "cuda", "_apply") and "/torch/nn/modules/module.py" in p:
        return True  # nn.Module.to / .cuda: moving a model's weights onto the device
    if rule.func.match(func) or (code and rule.code.search(code)):
        # The Trainer's training_step/compute_loss frames tell "forward" only through the call on their line.
        return not (
            rule.phase == "forward" and func in ("training_step", "compute_loss") and not rule.code.search(code)
        )
    return bool(rule.path.search(p))


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
