"""stdout is for the JSON document under ``--json``: whatever libraries print there meanwhile goes to stderr.

DeepSpeed, once installed, is imported by accelerate (``accelerate.utils.deepspeed``) and logs "Setting accelerator
to CPU" through a handler bound to ``sys.stdout``; other libraries print progress there. Under ``--json`` the CLI
points ``sys.stdout`` at stderr for the whole command (before those imports bind their handlers) and
:func:`emit_json` writes the one document to the real stdout, so ``oomdoctor ... --json | jq`` always parses.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

_json_stream: TextIO | None = None


@contextmanager
def stdout_for_json(enabled: bool) -> Iterator[None]:
    """While active and ``enabled``: ``sys.stdout`` is stderr, :func:`emit_json` writes to the real stdout."""
    global _json_stream
    if not enabled:
        yield
        return
    real, _json_stream = sys.stdout, sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout, _json_stream = real, None


def emit_json(doc: Any, indent: int = 2) -> None:
    """Write ``doc`` as JSON to the real stdout (``default=str`` for paths and other plain values)."""
    stream = _json_stream or sys.stdout
    stream.write(json.dumps(doc, indent=indent, default=str) + "\n")
    stream.flush()


__all__ = ["emit_json", "stdout_for_json"]
