"""The CLI's consoles: tables and text on stdout at the terminal's width (whole when piped), progress on stderr.

Width. On a terminal (rich's test: a tty, or ``TTY_COMPATIBLE=1`` / ``FORCE_COLOR``; ``COLUMNS`` sets its width)
text wraps at the terminal's width and tables fit it: their text columns (ids, plan labels, component names) fold
onto more lines and their numbers never wrap, so nothing is cut without a mark. Piped or redirected, nothing is
wrapped, folded or cut: tables take their natural width and every line is printed whole, so ``grep``, ``less -S``
and pasting into an issue keep every id and number intact (``oomdoctor explain`` follows the same rule).

Progress (``oomdoctor.progress``): :func:`showing_progress` draws the reports of a long computation on stderr, a
transient spinner line with the elapsed time on a terminal, one plain line per report otherwise; stdout (the tables,
or the JSON document under ``--json``) is never touched.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console

from oomdoctor.progress import Progress, listening

#: Width of a piped console: wider than any line the CLI prints, so that none is wrapped (tables stay at their
#: natural width; soft wrap keeps text lines whole beyond it too).
PIPED_WIDTH = 4096


def out_console() -> Console:
    """The stdout console: the terminal's width, or whole lines when piped (module docstring)."""
    con = Console()
    return con if con.is_terminal else Console(width=PIPED_WIDTH, soft_wrap=True)


def fold_column(table, name: str, **kw) -> None:
    """A text column (ids, plan labels, component names): folds onto more lines at a narrow terminal's width."""
    table.add_column(name, overflow="fold", **kw)


def whole_column(table, name: str, **kw) -> None:
    """A column of numbers (sizes, counts): never wraps, never cut (the text columns give way)."""
    table.add_column(name, no_wrap=True, **kw)


def add_columns(table, names: tuple[str, ...], *, text: tuple[str, ...]) -> None:
    """Columns ``names``: those in ``text`` fold (:func:`fold_column`), the others stay whole (:func:`whole_column`)."""
    for name in names:
        (fold_column if name in text else whole_column)(table, name)


class ProgressView:
    """Draws :class:`~oomdoctor.progress.Progress` reports on stderr (see the module docstring). :meth:`close`
    ends the spinner; reports after it print nothing on a terminal (another display, e.g. train's bar, owns it)."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.t0 = time.perf_counter()
        self._bar = None
        self._task = None
        self.closed = False

    def __call__(self, p: Progress) -> None:
        text = p.message + (f" ({p.step}/{p.steps})" if p.step and p.steps else "")
        if not self.console.is_terminal:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)
            return
        if self.closed:
            return
        if self._bar is None:
            from rich.progress import Progress as Bar
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            self._bar = Bar(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                            console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(text, total=None)
        else:
            self._bar.update(self._task, description=text)

    def close(self) -> None:
        self.closed = True
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextmanager
def showing_progress() -> Iterator[ProgressView]:
    """Draw the progress reported inside on stderr; the spinner is gone when the block ends."""
    view = ProgressView()
    try:
        with listening(view):
            yield view
    finally:
        view.close()


__all__ = ["out_console", "showing_progress", "ProgressView", "PIPED_WIDTH", "fold_column", "whole_column",
           "add_columns"]
