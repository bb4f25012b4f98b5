"""Thin command-line layer: parses flags, calls the library, prints. Exceptions become messages here, in one place.

Only this package imports typer and rich. Heavy imports (torch, transformers, peft, bitsandbytes) stay inside the
command bodies so ``oomdoctor --help`` is instant.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

# Each import registers its command on ``app``.
from oomdoctor.cli import diagnose as _diagnose  # noqa: F401 - registers its command
from oomdoctor.cli import explain as _explain  # noqa: F401 - registers its command
from oomdoctor.cli import keys as _keys  # noqa: F401 - registers its command
from oomdoctor.cli import models as _models  # noqa: F401 - registers its command
from oomdoctor.cli import targets as _targets  # noqa: F401 - registers its command
from oomdoctor.cli import train as _train  # noqa: F401 - registers its command
from oomdoctor.cli import tune as _tune  # noqa: F401 - registers its command
from oomdoctor.cli.app import app
from oomdoctor.cli.output import stdout_for_json
from oomdoctor.errors import OomDoctorError
from oomdoctor.imports import cheap_imports
from oomdoctor.noise import quiet_third_party


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turn our exceptions into one line on stderr and an exit code. Without
    ``argv`` (the process's own command line) the process then ends at once (:func:`_end_process`)."""
    if argv is not None:
        _run(argv)
        return
    try:
        _run(None)
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    _end_process(code)


def _run(argv: list[str] | None) -> None:
    quiet_third_party()
    cheap_imports()
    args = sys.argv[1:] if argv is None else argv
    try:
        with stdout_for_json("--json" in args):  # library chatter goes to stderr, the document to stdout
            app(args=argv, prog_name="oomdoctor")
    except OomDoctorError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(exc.hint, file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _end_process(code: int | str | None) -> NoReturn:
    """Exit with ``code`` as ``sys.exit`` would. Once torch is imported, the interpreter's own teardown (modules,
    objects, torch's) takes 3-4 s on 2 cores (measured after ``tune``): the exit handlers run and the streams are
    flushed, then the process ends without it."""
    if "torch" not in sys.modules:
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`oomdoctor ... | head`) or a closed stream
            pass
    os._exit(code or 0)
