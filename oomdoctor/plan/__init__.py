"""The plan layer: one vocabulary for every memory knob of a fine-tuning run (the ground floor: imports nothing
of oomdoctor but the utilities: errors, units, gpu). The knobs are described once, in
:mod:`oomdoctor.plan.techniques`."""

from oomdoctor.plan.plan import DEFAULT_LORA_TARGETS, Plan, validate
from oomdoctor.plan.techniques import HF_OPTIM_NAMES, TECHNIQUES, Technique

__all__ = ["DEFAULT_LORA_TARGETS", "HF_OPTIM_NAMES", "Plan", "TECHNIQUES", "Technique", "validate"]
