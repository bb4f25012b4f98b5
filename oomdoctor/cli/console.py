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
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from oomdoctor.progress import Progress, listening

#: Width of a piped console: wider than any line the CLI prints, so that none is wrapped (tables stay at their
#: natural width; soft wrap keeps text lines whole beyond it too).
PIPED_WIDTH = 4096


def out_console() -> Console:
    """The stdout console: the terminal's width, or whole lines when piped (module docstring)."""
    con = Console()
    return con if con.is_terminal else Console(width=PIPED_WIDTH, soft_wrap=True)


def new_table(title: str | None = None, **kw):
    """A rule-less table (a line under the header), its title on the left: the CLI's tables."""
    from rich import box
    from rich.table import Table

    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        header_style="bold",
        **kw,
    )


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


#: Narrowest a folding column may get before a table is printed as one record per row instead.
FOLD_MIN = 10


def print_table(console: Console, table) -> None:
    """Print ``table`` so that nothing is cut at the console's width (rich alone shrinks every column, numbers
    included, once the folding ones reach nothing): at its natural width when that fits; else the number columns
    keep the width of their widest value (their headers wrap) and the folding columns share the rest; when that
    leaves them less than :data:`FOLD_MIN` columns each, one record per row (a field per line)."""
    from rich.text import Text

    def width(cell) -> int:
        return Text.from_markup(cell).cell_len if isinstance(cell, str) else console.measure(cell).maximum

    natural = console.measure(table, options=console.options.update_width(PIPED_WIDTH)).maximum
    if natural <= console.width:
        console.print(table)
        return
    cells = [max((width(c) for c in col.cells), default=0) for col in table.columns]
    heads = [width(col.header) for col in table.columns]
    overhead = natural - sum(max(c, h) for c, h in zip(cells, heads))
    folding = [col.overflow == "fold" for col in table.columns]
    whole = [
        max(c, max((len(w) for w in str(col.header).split()), default=0))
        for c, col, f in zip(cells, table.columns, folding)
        if not f
    ]
    room = console.width - overhead - sum(whole)
    if room < FOLD_MIN * sum(folding):
        _print_records(console, table)
        return
    wanted = [max(c, h) for c, h, f in zip(cells, heads, folding) if f]
    shares = iter(_share(room, wanted))
    narrow = iter(whole)
    for col, f in zip(table.columns, folding):
        col.width = next(shares) if f else next(narrow)
        col.no_wrap = False  # the header may wrap; the values fit the width by construction
    console.print(table)


def _share(room: int, wanted: list[int]) -> list[int]:
    """``room`` columns split over columns that want ``wanted`` (none gets more than it wants, none less than
    :data:`FOLD_MIN`): the narrowest are served first."""
    out = [0] * len(wanted)
    left, order = room, sorted(range(len(wanted)), key=wanted.__getitem__)
    for k, i in enumerate(order):
        fair = left // (len(order) - k)
        out[i] = max(min(wanted[i], fair), FOLD_MIN)
        left -= out[i]
    return out


def _print_records(console: Console, table) -> None:
    """``table`` as one record per row: the title, then for each row a two-column grid of header and value (values
    fold at the console's width), a blank line between rows."""
    from rich.table import Table

    if table.title:
        console.print(table.title)
    headers = [str(col.header) for col in table.columns]
    columns = [list(col.cells) for col in table.columns]
    for row in zip(*columns):
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        for header, value in zip(headers, row):
            grid.add_row(header, value)
        console.print(grid)
        console.print()


#: Piped, a stage of work is announced once it has lasted this long (shorter waits need no progress).
PLAIN_AFTER_S = 2.0


class ProgressView:
    """Draws :class:`~oomdoctor.progress.Progress` reports on stderr (see the module docstring). :meth:`close`
    ends the spinner; reports after it print nothing on a terminal (another display, e.g. train's bar, owns it)."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.t0 = time.perf_counter()
        self._bar = None
        self._task = None
        self._timer = None
        self.closed = False

    def __call__(self, p: Progress) -> None:
        text = p.message + (f" ({p.step}/{p.steps})" if p.step and p.steps else "")
        if not self.console.is_terminal:
            self._plain(text)
            return
        if self.closed:
            return
        if self._bar is None:
            from rich.progress import Progress as Bar
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            self._bar = Bar(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(text, total=None)
        else:
            self._bar.update(self._task, description=text)

    def _plain(self, text: str) -> None:
        """Piped: a stage's line once it has lasted :data:`PLAIN_AFTER_S` (a quick command stays silent)."""
        import threading

        if self._timer is not None:
            self._timer.cancel()
        if self.closed:
            return
        t = time.perf_counter() - self.t0

        def line() -> None:
            print(f"[{t:6.1f}s] {text}", file=sys.stderr, flush=True)

        self._timer = threading.Timer(PLAIN_AFTER_S, line)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
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


__all__ = [
    "out_console",
    "showing_progress",
    "ProgressView",
    "PIPED_WIDTH",
    "fold_column",
    "whole_column",
    "add_columns",
    "print_table",
    "new_table",
    "FOLD_MIN",
]
