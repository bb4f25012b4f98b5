"""Files on the user's disk: writing user-facing files (``tune --output``, ``diagnose --plot``, ``train``'s summary)
through one helper that checks the path first and never leaves half a file, the free default name beside an existing
file (:func:`free_path`), and the one test of whether a model directory holds weights (:func:`holds_weights`).

Two kinds of failure, two exit codes (README, "Exit codes"):

* the path cannot take the file — it names a directory, sits under a file, lies in a directory that is read-only or
  not writable, or exists and may not be replaced: :class:`~oomdoctor.errors.BadInput` (exit 2), raised by
  :func:`check_output_path`, which the commands call before any work so that the answer comes at once;
* the write itself fails (disk full, quota, I/O error): :class:`~oomdoctor.errors.WriteFailed` (exit 74), with the
  free space; the temporary file is removed and a file already at the path is left as it was.

Writes are atomic: a temporary file in the same directory, flushed and fsynced, renamed over the path
(``os.replace``), so a reader sees the old file or the whole new one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from oomdoctor.errors import BadInput, WriteFailed
from oomdoctor.units import format_bytes


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing parent); None when unknown."""
    try:
        return shutil.disk_usage(_nearest_existing(Path(path))).free
    except OSError:
        return None


def _nearest_existing(p: Path) -> Path:
    """``p`` or its nearest parent that exists."""
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _not_writable(d: Path) -> str | None:
    """Why no file can be created in the directory ``d`` (None: it can). ``os.access`` answers for the real user and
    sees read-only mounts (EROFS), which even root cannot write."""
    if os.access(d, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return "read-only filesystem"
    except OSError:
        pass
    return "permission denied"


def check_output_path(
    path: str | os.PathLike, *, what: str = "--output", overwrite: bool = False, example: str = "plan.yaml"
) -> Path:
    """The path ``what`` (the flag that named it) will write, refused with one message (BadInput, exit 2) when a file
    cannot be written there: a directory, an existing file unless ``overwrite``, a parent that is a file, a directory
    that is read-only or not writable. ``example``: a file name for the hint."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise BadInput(f"{what} {out} is a directory", f"name a file in it, e.g. {what} {out / example}")
    if out.exists() and not overwrite:
        raise BadInput(
            f"{what} {out} exists; not overwriting it", f"pass --force to replace it, or another {what} path"
        )
    where = _nearest_existing(out.parent)
    if not where.is_dir():
        raise BadInput(
            f"{what} {out}: {where} is a file, not a directory", f"choose a path in a directory, e.g. {what} {out.name}"
        )
    why = _not_writable(where)
    if why:
        raise BadInput(
            f"{what} {out}: cannot write in {where} ({why})",
            f"choose a writable directory, e.g. {what} {Path.home() / out.name}",
        )
    return out


#: The file :func:`write_file_atomic` writes before renaming it into place: ``.NAME.<random>.tmp`` beside it.
_PARTIAL_PREFIX, _PARTIAL_SUFFIX = ".{}.", ".tmp"


def discard_partial_write(path: str | os.PathLike) -> None:
    """Remove what a :func:`write_file_atomic` of ``path`` killed before its rename left beside it (a process
    stopped from outside: its own ``except`` never ran)."""
    p = Path(path)
    try:
        for tmp in p.parent.glob(f"{_PARTIAL_PREFIX.format(p.name)}*{_PARTIAL_SUFFIX}"):
            tmp.unlink(missing_ok=True)
    except OSError:
        pass


def write_file_atomic(
    path: str | os.PathLike,
    data: str | bytes,
    *,
    what: str = "--output",
    overwrite: bool = False,
    example: str = "plan.yaml",
    hint: str | None = None,
) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically after :func:`check_output_path`; WriteFailed (exit 74)
    when the write fails, with nothing left behind (``hint``: what to do then; default: free space or choose another
    path). Returns the path written."""
    out = check_output_path(path, what=what, overwrite=overwrite, example=example)
    existed = out.exists()
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_PARTIAL_PREFIX.format(out.name), suffix=_PARTIAL_SUFFIX, dir=out.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except OSError as exc:
        _remove(tmp)
        raise write_failed(
            what,
            out,
            exc,
            "nothing was written" + (", the file already there is unchanged" if existed else ""),
            hint or f"free some space or choose another {what} path, and run the command again",
        ) from None
    except BaseException:
        _remove(tmp)
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


def holds_weights(ref: str | os.PathLike) -> bool:
    """Whether ``ref`` is a directory with weights (``*.safetensors`` / ``*.bin``) a trainer can load, as opposed to a
    config alone (``tune``'s emitted configs, the GPU probe: what ``oomdoctor train`` would load)."""
    p = Path(ref).expanduser()
    return p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


def write_text_atomic(path: str | os.PathLike, text: str, *, overwrite: bool = False, what: str = "--output") -> Path:
    """:func:`write_file_atomic` for text (the YAML/JSON configs ``tune`` writes)."""
    return write_file_atomic(path, text, what=what, overwrite=overwrite)


def write_failed(what: str, path: str | os.PathLike, exc: OSError, outcome: str, hint: str) -> WriteFailed:
    """The one message of a failed write: ``what`` (a flag or a kind of file) ``path`` could not be written because
    of ``exc`` (its errno's text, and the free space there); ``outcome`` says what was kept."""
    free = free_bytes(path)
    return WriteFailed(
        f"{what} {path}: writing it failed ({exc.strerror or exc}"
        + (f"; {format_bytes(free)} free there" if free is not None else "")
        + f"); {outcome}",
        hint,
    )


def _remove(tmp: str | None) -> None:
    if tmp is not None:
        try:
            os.unlink(tmp)
        except OSError:
            pass


__all__ = [
    "check_output_path",
    "discard_partial_write",
    "free_bytes",
    "free_path",
    "holds_weights",
    "write_failed",
    "write_file_atomic",
    "write_text_atomic",
]
