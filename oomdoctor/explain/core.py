"""``explain(text)``: read an out-of-memory message (a log, a traceback) and say why it happened and what to change.

Pure text processing and arithmetic: no torch, no rich; the CLI (``oomdoctor/cli/explain.py``) only prints what it
returns. The work is split by job: one parser per message format (:mod:`oomdoctor.explain.parsers`, put together by
:mod:`oomdoctor.explain.parse`), the traceback's phase (:mod:`oomdoctor.explain.phase`), one function per cause
(:mod:`oomdoctor.explain.causes`), the fixes (:mod:`oomdoctor.explain.fixes`, priced for the user's plan by
:mod:`oomdoctor.explain.pricing`), the diagnosis (:mod:`oomdoctor.explain.diagnosis`) and the JSON form
(:mod:`oomdoctor.explain.render`). This module is the public entry point and names the API the CLI and tests use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomdoctor.explain.diagnosis import diagnose
from oomdoctor.explain.logits import logits_match as _logits_match
from oomdoctor.explain.parse import parse_oom
from oomdoctor.explain.phase import detect_phase
from oomdoctor.explain.pricing import rank_plan_fixes
from oomdoctor.explain.report import CAUSE_IDS, PHASES, Cause, Diagnosis, Fix, OomReport, ProcessUse

if TYPE_CHECKING:
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan


def explain(
    text: str, spec: ModelSpec | None = None, plan: Plan | None = None, capacity_bytes: int | None = None
) -> Diagnosis:
    """Parse ``text`` and diagnose the OOM it holds (raises BadInput when it holds none)."""
    return diagnose(parse_oom(text), spec=spec, plan=plan, capacity_bytes=capacity_bytes)


__all__ = [
    "CAUSE_IDS",
    "PHASES",
    "ProcessUse",
    "OomReport",
    "Fix",
    "Cause",
    "Diagnosis",
    "parse_oom",
    "detect_phase",
    "diagnose",
    "explain",
    "rank_plan_fixes",
    "_logits_match",
]
