"""The plan defaults the engine-accuracy tests were measured with (not a test module).

Those tests compare the analytic formulas, the simulated engine and real CPU steps on plans that mostly leave the
technique knobs at their defaults. The defaults have since become Hugging Face's (fp32, fused AdamW, peft's r=8,
alpha=8, dropout 0.0: ``oomdoctor.plan.techniques``); these tests keep the settings their tolerances were
established on, so each still checks what it was written to check. Knobs a test names win.
"""

from __future__ import annotations

from oomdoctor.plan import Plan as _Plan

CALIBRATED = dict(precision="bf16-mixed", optimizer_impl="foreach", lora_r=16, lora_alpha=32, lora_dropout=0.05)


def Plan(**kw) -> _Plan:  # stands in for the class in these tests
    """``oomdoctor.plan.Plan`` with :data:`CALIBRATED` under the given knobs."""
    return _Plan(**{**CALIBRATED, **kw})
