"""``oomdoctor models``: the bundled model configs (resolve offline, no hub needed)."""

from __future__ import annotations

from typing import Optional

import typer

from oomdoctor.cli.app import app
from oomdoctor.cli.output import emit_json

HELP = (
    "List the bundled model configs: every id here resolves offline in diagnose/tune/train (aliases too, case "
    "does not matter). Other ids fetch only config.json from the hub when it is reachable; a local directory "
    "holding config.json, or a config.json path, always works. PATTERN keeps rows whose id, alias, family or "
    "model_type contains it."
)


def _b(n: int) -> str:
    """Parameter count in billions (or millions below 1 B), for the table."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M"


@app.command(help=HELP)
def models(
    pattern: Optional[str] = typer.Argument(None, help="substring of id / alias / family / model_type, e.g. qwen"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
) -> None:
    from oomdoctor.model.load import bundled_models

    rows = bundled_models(pattern)
    if as_json:
        emit_json({"models": rows})
        return
    from oomdoctor.cli.console import fold_column, new_table, out_console, print_table, whole_column

    console = out_console()
    if not rows:
        console.print(f"no bundled model matches {pattern!r}; run `oomdoctor models` for all of them")
        raise typer.Exit(0)
    t = new_table(f"Bundled model configs ({len(rows)})")
    fold_column(t, "id")  # at a narrow terminal the id folds onto more lines (whole when piped)
    fold_column(t, "family")
    for col in ("params", "layers", "hidden", "vocab"):
        whole_column(t, col, justify="right")
    for r in sorted(rows, key=lambda r: (r["family"], r["params"])):
        fam = r["family"]
        if r["arch_kind"] != "decoder":
            fam += " (enc-dec)" if r["arch_kind"] == "encoder-decoder" else f" ({r['arch_kind']})"
        if r["experts"]:
            fam += f" (MoE {r['experts']})"
        t.add_row(r["id"], fam, _b(r["params"]), str(r["layers"]), str(r["hidden"]), f"{r['vocab']:,}")
    print_table(console, t)
    console.print(
        "[dim]heads, KV heads, tied embeddings and aliases (-chat/-Instruct variants of the same shape): "
        "`oomdoctor models --json`[/]"
    )
