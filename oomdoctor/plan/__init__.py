"""The plan layer: one vocabulary for every memory knob of a fine-tuning run (the ground floor: imports nothing
of oomdoctor but the utilities: errors, units, gpu)."""

from oomdoctor.plan.plan import DEFAULT_LORA_TARGETS, HF_OPTIM_NAMES, Plan, validate

__all__ = ["DEFAULT_LORA_TARGETS", "HF_OPTIM_NAMES", "Plan", "validate"]
