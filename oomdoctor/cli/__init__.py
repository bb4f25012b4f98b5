"""Thin command-line layer: parses flags, calls the library, prints. Exceptions become messages here, in one place.

Only this package imports typer and rich. Heavy imports (torch, transformers, peft, bitsandbytes) stay inside the
command bodies so ``oomdoctor --help`` is instant.
"""

from __future__ import annotations

import sys

from oomdoctor.cli.app import app
from oomdoctor.cli.output import stdout_for_json
from oomdoctor.errors import OomDoctorError
from oomdoctor.imports import cheap_imports
from oomdoctor.noise import quiet_third_party

# Each import registers its command on ``app``.
from oomdoctor.cli import diagnose as _diagnose  # noqa: E402,F401
from oomdoctor.cli import tune as _tune  # noqa: E402,F401
from oomdoctor.cli import train as _train  # noqa: E402,F401
from oomdoctor.cli import explain as _explain  # noqa: E402,F401
from oomdoctor.cli import models as _models  # noqa: E402,F401


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turn our exceptions into one line on stderr and an exit code."""
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
