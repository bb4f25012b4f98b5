"""What the CLI prints reads right at any width (oomdoctor.cli.console): on a terminal of 60, 80 or 200 columns no
line is wider than the terminal, text cells fold and every number stays whole; piped, every line is whole (COLUMNS is
ignored) — so every id, plan label and number printed is complete. The terminal is rich's: ``TTY_COMPATIBLE=1``
with ``COLUMNS``, the commands run in-process through ``oomdoctor.cli.main``.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from oomdoctor.cli import main
from oomdoctor.units import format_bytes, gib

WIDTHS = (60, 80, 200)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BOX = re.compile(r"[\u2500-\u257f]")
#: The numbers ending a model's first line: params (``6.92 B``), layers, hidden, vocab.
_MODEL_NUMBERS = re.compile(r" [\d.]+ [BM] +\d+ +\d+ +[\d,]+ *$")


def run_cli(args: list[str], monkeypatch, capsys, width: int | None) -> list[str]:
    """stdout lines of ``oomdoctor ARGS`` on a terminal of ``width`` columns (None: piped, COLUMNS=60 set anyway)."""
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", str(width or 60))
    if width is not None:
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code in (0, 3, None), exc.code
    return _ANSI.sub("", capsys.readouterr().out).splitlines()


def chars(lines: list[str]) -> Counter:
    """Every printed character but spaces and table rules: equal when the same text was folded differently."""
    return Counter(_BOX.sub("", "".join(lines)).replace(" ", ""))


def assert_fits(lines: list[str], width: int) -> None:
    """No line is wider than the terminal, but the command to run and the path written: those are copied, so they
    are never wrapped (as explain's commands)."""
    wide = [ln for ln in lines if len(ln.rstrip()) > width and not ln.startswith(("run:  ", "wrote "))]
    assert not wide, f"{len(wide)} line(s) wider than {width}: {wide[:3]}"


def heavy_rows(lines: list[str], first_cell: str, key: int = 0) -> list[list[str]]:
    """Rows of the ``│``-ruled table whose header's first cell is ``first_cell``: a row starts on a line with its
    ``key`` cell (a column that never folds) set and continues on the lines where it is empty (folded cells); each
    cell's pieces joined by a space."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith("┃") and ln.strip("┃ ").startswith(first_cell))
    rows: list[list[str]] = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("│"):
            break
        cells = [c.strip() for c in ln.strip().strip("│").split("│")]
        if cells[key]:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return rows


def simple_rows(lines: list[str], header: str) -> list[list[str]]:
    """Rows of a rule-less table whose header line starts with ``header``: (first line's tokens, folded text) — a
    row starts on a line whose first token is set; the text of its other lines is its folded text cells."""
    start = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [header])
    rows: list[list[str]] = []
    for ln in lines[start + 2 :]:
        if not ln.strip():
            break
        if ln[:3].strip():  # the row number / id starts the line
            rows.append([ln, ""])
        else:
            rows[-1][1] = f"{rows[-1][1]} {ln.strip()}".strip()
    return rows


def plan_rows(
    lines: list[str], title: str, headers: tuple[str, ...], cells: list[list[str]]
) -> list[tuple[str, list[str]]]:
    """(plan label, whole cells) of each row of the table titled ``title`` (columns ``headers``, the second the
    folding plan), whichever way it was printed: a rule-less table (a row's first line ends with its whole cells,
    its next lines hold the rest of the label) or one record per row (``header  value`` lines, a folded value
    continued on indented lines, a blank line after each record). ``cells``: the whole cells expected per row."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    body = lines[start + 1 :]
    while not body[0].strip().startswith(headers[0] + " "):
        body = body[1:]  # the rest of a wrapped title, wrapped headers
    rows: list[tuple[str, list[str]]] = []
    if body[0].startswith(headers[0] + " "):  # one record per row
        fields: dict[str, str] = {}
        for ln in body:
            if not ln.strip():
                if not fields:
                    break
                values = [fields[h] for h in headers]
                rows.append((values[1], [values[0]] + values[2:]))
                fields = {}
            elif ln[:1] != " ":
                starts = [h for h in headers if ln.startswith(h + " ")]
                if not starts:  # the text after the last record
                    break
                head = max(starts, key=len)
                fields[head] = ln[len(head) :].strip()
            else:
                fields[head] = f"{fields[head]} {ln.strip()}"
        return rows
    rule = next(i for i, ln in enumerate(body) if ln.strip().startswith("─"))
    expected = iter(cells)
    for ln in body[rule + 1 :]:
        if not ln.strip():
            break
        if ln[:3].strip():
            whole = next(expected)
            tail = " " + " ".join(whole[1:])
            flat = " ".join(ln.split())
            assert flat.startswith(whole[0] + " ") and flat.endswith(tail), (flat, whole)
            rows.append((flat[len(whole[0]) + 1 : -len(tail)], whole))
        else:
            rows[-1] = (f"{rows[-1][0]} {ln.strip()}", rows[-1][1])
    return rows


# ---------------------------------------------------------------------------------------------- models


def test_models_piped_prints_every_row_whole_and_terminals_fold_ids_without_cutting(monkeypatch, capsys):
    from oomdoctor.cli.models import _b
    from oomdoctor.model.load import bundled_models

    expected = {
        r["id"]: [*_b(r["params"]).split(), str(r["layers"]), str(r["hidden"]), f"{r['vocab']:,}"]
        for r in bundled_models()
    }
    piped = run_cli(["models"], monkeypatch, capsys, None)
    by_id = {ln.split()[0]: ln.split() for ln in piped if ln.split() and ln.split()[0] in expected}
    assert set(by_id) == set(expected)
    assert all(by_id[i][-5:] == nums for i, nums in expected.items())
    for width in WIDTHS:
        lines = run_cli(["models"], monkeypatch, capsys, width)
        assert_fits(lines, width)
        assert chars(lines) == chars(piped), width  # folded, nothing cut, nothing added
        table = lines[next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["id", "family"]) + 2 :]
        table = table[: next(i for i, ln in enumerate(table) if not ln.strip())]
        starts = [i for i, ln in enumerate(table) if _MODEL_NUMBERS.search(ln)]
        numbers = Counter(tuple(table[i].split()[-5:]) for i in starts)
        assert numbers == Counter(tuple(n) for n in expected.values()), width
        # the id column, re-joined from its folded pieces, gives back every id
        ids = [
            "".join(ln.split()[0] for ln in table[a:b] if ln[1:2].strip())
            for a, b in zip(starts, starts[1:] + [len(table)])
        ]
        assert sorted(ids) == sorted(expected), width


# ---------------------------------------------------------------------------------------------- diagnose


@pytest.mark.parametrize(
    "pins",
    [
        {"method": "full"},
        {
            "method": "full",
            "precision": "bf16",
            "optimizer": "paged-adamw-8bit",
            "gradient_checkpointing": True,
            "loss": "standard",
            "offload": "none",
        },
    ],
    ids=["matrix", "one-plan-paged"],
)
def test_diagnose_keeps_every_plan_label_and_number_whole(pins, monkeypatch, capsys):
    from oomdoctor.cli.options import pins_from
    from oomdoctor.diagnose.report import diagnose

    args = ["meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB", "--seq-len", "1024"]
    for k, v in pins.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    report = diagnose("meta-llama/Llama-2-7b-hf", pins_from(**pins, seq_len=1024), gpu_mem=24 * 10**9)
    labels = [r.plan.label() for r in report.results]
    needed = [f"{gib(report.budget.needed(r.memory)):.2f}" for r in report.results]
    for width in (None,) + WIDTHS:
        lines = run_cli(["diagnose", *args], monkeypatch, capsys, width)
        if width:
            assert_fits(lines, width)
        rows = simple_rows(lines, "#")
        assert len(rows) == len(labels), width
        for (first, folded), label, peak, r in zip(rows, labels, needed, report.results):
            tokens = first.split()
            verdict = tokens[-1]
            assert verdict == ("yes" if r.fits else "no")
            # the fits number is the resident peak (paged optimizer state in its own column)
            assert peak in tokens, (width, first)
            text = " ".join(t for t in tokens[1:] if not re.fullmatch(r"[\d.]+|-|yes|no", t))
            assert " ".join(f"{text} {folded}".split()) == label, (width, first, folded)
    if len(labels) == 1:  # the breakdown: every byte count whole, the resident peak the verdict used shown
        m = report.results[0].memory
        assert m.paged_optimizer
        for width in (None,) + WIDTHS:
            lines = run_cli(["diagnose", *args], monkeypatch, capsys, width)
            cells = {row[0]: row[1:] for row in heavy_rows(lines, "component", key=1)}
            assert cells[f"peak allocated ({m.peak_phase})"][0] == f"{m.peak_allocated:,}"
            assert cells["peak device (nvidia-smi)"][0] == f"{m.peak_device:,}"
            assert cells["paged optimizer"][0] == f"{m.paged_optimizer:,}"
            assert cells["resident device (paged state excluded)"] == [
                f"{m.resident_device:,}",
                f"{gib(m.resident_device):.2f}",
            ]


# ---------------------------------------------------------------------------------------------- tune


@pytest.fixture(scope="module")
def tuned():
    """Llama-2-7B on 24 GB (its plan pages optimizer state: the ranking shows it apart) and the tiny model
    verified by the simulated engine (a trial table)."""
    from oomdoctor.tune.tuner import tune

    big = tune(
        "meta-llama/Llama-2-7b-hf", gpu_mem=24 * 10**9, seq_len=1024, global_batch=32, gpu=None, verify_mode="none"
    )
    tiny = tune(
        "bundled:tiny/model/config.json",
        gpu_mem=2 * 10**9,
        seq_len=128,
        global_batch=8,
        gpu=None,
        verify_mode="simulate",
    )
    return big, tiny


def _tune_lines(result, monkeypatch, capsys, width):
    from oomdoctor.cli.tune import _print

    for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", str(width or 60))
    if width:
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    capsys.readouterr()
    result.config_path = "plan.yaml"
    _print(result)
    return _ANSI.sub("", capsys.readouterr().out).splitlines()


def test_tune_ranking_shows_the_counted_peak_against_the_budget_with_paged_state_apart(tuned, monkeypatch, capsys):
    big, _ = tuned
    fitting = big.search.fitting[:6]
    assert any(c.memory.paged_optimizer for c in fitting), "the 24 GB plan set should page optimizer state"
    assert all(big.budget.fits(c.memory) for c in fitting)
    headers = ("#", "plan", "max micro", "micro x accum", "resident peak", "paged optim.", "host RAM", "est. tok/s")
    cells = [
        [
            str(c.rank),
            str(c.batch.max_micro_batch),
            f"{c.plan.micro_batch} x {c.plan.grad_accum}",
            format_bytes(big.budget.needed(c.memory)),  # the number the fits rule counts
            format_bytes(c.memory.paged_optimizer) if c.memory.paged_optimizer else "-",
            format_bytes(c.memory.cpu_offloaded) if c.memory.cpu_offloaded else "-",
            f"{c.throughput.tokens_per_s:,.0f}",
        ]
        for c in fitting
    ]
    for width in (None,) + WIDTHS:
        lines = _tune_lines(big, monkeypatch, capsys, width)
        if width:
            assert_fits(lines, width)
        rows = plan_rows(
            lines, f"ranking (fitting plans; resident peak vs the {format_bytes(big.budget_bytes)}", headers, cells
        )
        assert [(" ".join(label.split()), whole) for label, whole in rows] == [
            (c.plan.label(), row) for c, row in zip(fitting, cells)
        ], width


def test_tune_trial_table_keeps_labels_and_sizes_whole(tuned, monkeypatch, capsys):
    _, tiny = tuned
    assert tiny.trials
    headers = ("trial", "plan", "micro x accum", "outcome", "predicted", "measured", "time")
    cells = [
        [
            str(i),
            f"{t.micro_batch} x {t.grad_accum}",
            t.outcome,
            format_bytes(t.predicted_peak_bytes),
            format_bytes(t.measured_peak_bytes),
            f"{t.seconds:.1f}s",
        ]
        for i, t in enumerate(tiny.trials, 1)
    ]
    for width in (None,) + WIDTHS:
        lines = _tune_lines(tiny, monkeypatch, capsys, width)
        if width:
            assert_fits(lines, width)
        rows = plan_rows(lines, "verification: simulate", headers, cells)
        assert [(" ".join(label.split()), whole) for label, whole in rows] == [
            (t.plan_label, row) for t, row in zip(tiny.trials, cells)
        ], width
        assert any(ln.startswith("run:  ") and ln.rstrip().endswith("oomdoctor train plan.yaml") for ln in lines)


# ---------------------------------------------------------------------------------------------- train --dry-run


def test_train_dry_run_wraps_at_the_terminal_and_prints_whole_lines_when_piped(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    config = str(Path(__file__).resolve().parent.parent / "configs" / "train" / "tiny-cpu.yaml")
    piped = run_cli(["train", config, "--dry-run", "--gpu-mem", "2GB"], monkeypatch, capsys, None)
    head = piped[0]
    assert "micro-batch" in head and "seq_len" in head  # the header sentence on one line
    for width in WIDTHS:
        lines = run_cli(["train", config, "--dry-run", "--gpu-mem", "2GB"], monkeypatch, capsys, width)
        assert_fits(lines, width)
        assert chars(lines) == chars(piped), width
        assert {r[0]: r[1] for r in heavy_rows(lines, "component", key=1)} == {
            r[0]: r[1] for r in heavy_rows(piped, "component", key=1)
        }
