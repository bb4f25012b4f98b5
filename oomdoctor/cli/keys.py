"""``oomdoctor keys [PATTERN]``: every key of a train YAML with its meaning, from the schema (``train.config.schema``:
the same table that validates a config and comments the YAML ``tune`` writes). What config errors point at: an install
from a wheel has no docs/ directory."""

from __future__ import annotations

from typing import Optional

import typer

from oomdoctor.cli.app import app
from oomdoctor.cli.output import emit_json

HELP = """Every key of an `oomdoctor train` YAML: its name (and accepted aliases), values, default and meaning, with
the memory effect of the memory knobs. PATTERN keeps the keys whose name, alias or text contains it (e.g. lora,
dataset., optim)."""
HELP = " ".join(HELP.split())


@app.command(help=HELP)
def keys(
    pattern: Optional[str] = typer.Argument(None, help="substring of a key, an alias or its text, e.g. lora"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
) -> None:
    from oomdoctor.errors import BadInput
    from oomdoctor.train.config.schema import key_docs

    docs = key_docs(pattern)
    if not docs:
        raise BadInput(f"no train key matches {pattern!r}", "run `oomdoctor keys` for every key")
    if as_json:
        emit_json({"keys": [d.to_dict() for d in docs]})
        return
    from rich.console import Console
    from rich.padding import Padding
    from rich.text import Text

    con = Console()  # wraps at the terminal's width (80 columns in a pipe)
    con.print(
        "train YAML keys: flat top-level keys, then the model: and dataset: sections "
        "(values; default), what each does, and its memory effect",
        style="bold",
    )
    for d in docs:
        head = Text(d.name, style="bold")
        if d.aliases:
            head.append(f" (= {', '.join(d.aliases)})")
        head.append(f"  {d.values}; default {_yaml(d.default)}", style="dim")
        con.print(head)
        con.print(Padding(Text(d.help), (0, 0, 0, 4)))
        if d.memory:
            con.print(Padding(Text(f"memory: {d.memory}", style="dim"), (0, 0, 0, 4)))


def _yaml(value) -> str:
    """A default as it is written in the YAML (true, null, [q_proj, v_proj])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
