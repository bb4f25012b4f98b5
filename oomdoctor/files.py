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


def free_path(path: str | os.PathLike) -> Path:
    """``path``, or when it exists the first free ``STEM-2.SUFFIX``, ``STEM-3.SUFFIX``... beside it (a default output
    name never replaces a file)."""
    p = Path(path)
    n = 2
    while p.exists():
        p = p.with_name(f"{Path(path).stem}-{n}{Path(path).suffix}")
        n += 1
    return p


__all__ = ["free_path", "write_text_atomic"]
