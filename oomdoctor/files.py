"""Writing user-facing files without ever leaving half of one: atomic replace, refusal to overwrite."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from oomdoctor.errors import BadInput


def write_text_atomic(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same directory, fsync, rename): a reader never sees
    a partial file and a failure leaves the old one. An existing file is refused (BadInput) unless ``overwrite``;
    a directory always is."""
    out = Path(path)
    if out.is_dir():
        raise BadInput(f"--output {out} is a directory", "pass a file name, e.g. --output plan.yaml")
    if out.exists() and not overwrite:
        raise BadInput(f"--output {out} exists; not overwriting it",
                       "pass --force to replace it, or another --output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return out


__all__ = ["write_text_atomic"]
