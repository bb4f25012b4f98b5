"""``oomdoctor targets [TRAINER]``: what each trainer ``tune --emit`` writes for can run — per knob, the keys that
carry it, how the trainer runs it, and the values it cannot run (``oomdoctor.plan.targets``)."""

from __future__ import annotations

from typing import Optional

import typer

from oomdoctor.cli.app import app
from oomdoctor.cli.output import emit_json

HELP = (
    "What each trainer can run: for every knob of a plan, the key(s) that carry it in that trainer's config, how "
    "the trainer runs it, and the values it cannot run (tune --emit TRAINER never picks those; pinning one is an "
    "error). TRAINER: trl, hf, axolotl, accelerate (default: all four)."
)


def _cannot(trainer: str, knob: str) -> list[dict]:
    """The refused values of ``knob``, grouped by reason: ``[{"values": [...], "why": ...}]``."""
    from oomdoctor.plan.targets import refused_values

    groups: dict[str, list[str]] = {}
    for v, why in refused_values(trainer, knob).items():
        groups.setdefault(why, []).append(str(v).lower() if isinstance(v, bool) else str(v))
    return [{"values": values, "why": why} for why, values in groups.items()]


def _said(cannot: list[dict]) -> str:
    return "; ".join(f"{', '.join(g['values'])}: {g['why']}" for g in cannot) or "-"


def rows(trainer: str) -> list[dict]:
    """One row per knob: ``knob``, ``keys``, ``how``, ``cannot`` (refused values grouped by reason)."""
    from oomdoctor.plan.targets import RULES

    return [
        {"knob": knob, "keys": list(rule.keys), "how": rule.how, "cannot": _cannot(trainer, knob)}
        for knob, rule in RULES[trainer].items()
        if knob != "trainer"
    ]


def markdown(trainer: str) -> str:
    """The rows as a Markdown table (docs/tune.md quotes it)."""
    lines = [f"| knob | `{trainer}` keys | how | cannot run |", "|---|---|---|---|"]
    for r in rows(trainer):
        keys = ", ".join(f"`{k}`" for k in r["keys"]) or "-"
        lines.append(f"| {r['knob']} | {keys} | {r['how'] or '-'} | {_said(r['cannot'])} |")
    return "\n".join(lines) + "\n"


@app.command(help=HELP)
def targets(
    trainer: Optional[str] = typer.Argument(None, help="trl | hf | axolotl | accelerate (default: all)"),
    as_markdown: bool = typer.Option(False, "--markdown", help="print Markdown tables"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    from oomdoctor.errors import BadInput
    from oomdoctor.plan.targets import PRICED_VERSIONS

    foreign = [t for t in PRICED_VERSIONS if t != "oomdoctor"]
    if trainer is not None and trainer not in foreign:
        raise BadInput(f"unknown trainer {trainer!r}", f"use one of {', '.join(foreign)}")
    chosen = [trainer] if trainer else foreign
    if as_json:
        emit_json({t: {"priced_versions": dict(PRICED_VERSIONS[t]), "knobs": rows(t)} for t in chosen})
        return
    if as_markdown:
        typer.echo("\n".join(markdown(t) for t in chosen))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for t in chosen:
        table = Table(
            title=f"{t}: priced as " + ", ".join(f"{d} {v}" for d, v in PRICED_VERSIONS[t]),
            title_justify="left",
            show_lines=False,
        )
        for col in ("knob", "keys", "how", "cannot run"):
            table.add_column(col, overflow="fold")
        for r in rows(t):
            table.add_row(r["knob"], ", ".join(r["keys"]) or "-", r["how"] or "-", _said(r["cannot"]))
        con.print(table)
