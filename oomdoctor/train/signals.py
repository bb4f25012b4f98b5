"""Stopping a run cleanly: the first Ctrl-C (SIGINT; SIGTERM under torchrun) finishes the step, saves, stops."""

from __future__ import annotations

from typing import Any

from oomdoctor.train.run import Event, any_rank


class StopRequest:
    """Ctrl-C (SIGINT) during training: the first finishes the current step, saves and stops; a second aborts.
    Under torchrun the launcher turns Ctrl-C into SIGTERM for every rank: SIGTERM is handled the same way there,
    and the ranks agree on the step to stop after (:meth:`agreed`). A context manager: the previous handlers are
    restored on exit; outside the main thread (where Python cannot install handlers) it installs none."""

    def __init__(self, emit: Event, info: Any = None):
        self.requested = False
        self._emit = emit
        self._info = info
        self._previous: dict = {}

    def agreed(self) -> bool:
        """Whether to stop after this step: this process's request, or any rank's in a data-parallel job (one tiny
        all-reduce per step, so every rank stops after the same step)."""
        return any_rank(self.requested, self._info)

    def _handler(self, signum, frame) -> None:  # signal protocol
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._emit(
            {
                "type": "info",
                "message": "Ctrl-C: finishing this step, then saving a checkpoint "
                "(Ctrl-C again to stop at once without saving)",
            }
        )

    def __enter__(self) -> StopRequest:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            sigs = [signal.SIGINT] + ([signal.SIGTERM] if self._info is not None and self._info.enabled else [])
            self._previous = {sig: signal.signal(sig, self._handler) for sig in sigs}
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


__all__ = ["StopRequest"]
