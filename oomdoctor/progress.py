"""Progress of the computations that make a user wait, reported from any layer and drawn by the CLI.

A computation that can take more than a couple of seconds (tune's search and verification replay, ``diagnose
--engine simulate``, the analytic engine's block measurements, train's setup) calls :func:`report` at each stage;
nothing happens unless a listener is installed with :func:`listening` (the CLI installs one that draws on stderr:
``oomdoctor.cli.console.showing_progress``). Every layer reports through this one callback type, so a library caller
can listen too (``with listening(print): tune(...)``). The listener lives in a context variable: nothing is passed
down the call chain, and a thread or task that installs none reports to nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """One report of a long computation."""

    task: str
    """What is running, the same for every report of one computation (``tune``, ``verify``, ``simulate``,
    ``diagnose``, ``blocks``, ``train``)."""
    message: str
    """One line for people: what is being done now (``replaying 3 blocks of the model: step 1 of 2``)."""
    step: int | None = None
    """Number of the stage now running, from 1 (None: not counted)."""
    steps: int | None = None
    """Stages of the whole computation (None: unknown)."""


#: What listens to progress: called with each :class:`Progress`, in the thread that reports it.
Listener = Callable[[Progress], None]

_listener: ContextVar[Listener | None] = ContextVar("oomdoctor_progress_listener", default=None)


def report(task: str, message: str, step: int | None = None, steps: int | None = None) -> None:
    """Tell the installed listener (if any) that ``task`` is now doing ``message`` (stage ``step`` of ``steps``)."""
    listener = _listener.get()
    if listener is not None:
        listener(Progress(task, message, step, steps))


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send the reports made inside to ``listener`` (nested: the innermost listener hears them)."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


__all__ = ["Progress", "Listener", "report", "listening"]
