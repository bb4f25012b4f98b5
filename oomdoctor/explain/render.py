"""JSON-ready forms of what ``explain`` produces (``oomdoctor explain --json``); the CLI prints the text form.

Only attribute access on the dataclasses of :mod:`oomdoctor.explain.report`: no analysis here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the dataclasses call these functions from their ``to_dict``
    from oomdoctor.explain.report import Cause, Diagnosis, Fix, OomReport

#: Report keys put first in the diagnosis JSON (the numbers a reader looks for), in this order.
HEADLINE_KEYS: tuple[str, ...] = (
    "requested_bytes",
    "total_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_unallocated_bytes",
    "other_processes_bytes",
    "phase",
)

#: Report fields in the JSON, in this order (processes, ranks and notes are converted to lists).
REPORT_KEYS: tuple[str, ...] = (
    "kind",
    "format",
    "device",
    "requested_bytes",
    "total_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "reserved_unallocated_bytes",
    "private_pool_bytes",
    "allowed_bytes",
    "this_process_bytes",
    "other_processes_bytes",
    "processes",
    "non_pytorch_bytes",
    "phase",
    "phase_frame",
    "failing_frame",
    "ranks",
    "occurrences",
    "tensor_name",
    "message",
    "notes",
)


def _json_value(report: "OomReport", key: str):
    value = getattr(report, key)
    if key == "processes":
        return [{"pid": p.pid, "bytes": p.bytes, "is_self": p.is_self} for p in value]
    if key in ("ranks", "notes"):
        return list(value)
    return value


def report_dict(report: "OomReport") -> dict:
    """The report as JSON: every number, ``null`` where the message does not say."""
    return {key: _json_value(report, key) for key in REPORT_KEYS}


def fix_dict(fix: "Fix") -> dict:
    return {
        "id": fix.id,
        "text": fix.text,
        "how": fix.how,
        "saves_bytes": fix.saves_bytes,
        "peak_after_bytes": fix.peak_after_bytes,
        "fits": fix.fits,
    }


def cause_dict(cause: "Cause") -> dict:
    return {
        "id": cause.id,
        "score": round(cause.score, 2),
        "evidence": list(cause.evidence),
        "fixes": [fix_dict(f) for f in cause.fixes],
    }


def diagnosis_dict(diag: "Diagnosis") -> dict:
    """Headline numbers, the causes, the rest of the report, the plan, the capacity and the next command."""
    report = report_dict(diag.report)
    out = {k: report[k] for k in HEADLINE_KEYS}
    out["causes"] = [cause_dict(c) for c in diag.causes]
    out.update((k, v) for k, v in report.items() if k not in out)
    out["plan"] = (
        None
        if diag.plan_label is None
        else {"label": diag.plan_label, "peak_bytes": diag.plan_peak_bytes, "peak_phase": diag.plan_peak_phase}
    )
    out["capacity_bytes"] = diag.capacity_bytes
    out["next_command"] = diag.next_command
    return out
