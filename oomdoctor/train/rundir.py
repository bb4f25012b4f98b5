"""The run directory (``output_dir``): nothing a user made is ever lost.

Before the first step, :func:`open_run_dir`

* refuses an ``output_dir`` that is a file, or that already holds a run (checkpoints, a final model, a summary)
  unless the run resumes it (``--resume``) or replaces it (``--overwrite``, HF's ``overwrite_output_dir``: the old
  run's checkpoints and outputs are deleted, files oomdoctor did not write are kept);
* takes a lock (``.oomdoctor.lock``: pid and host of the owner, created with ``O_EXCL``) so a second concurrent run
  into the same directory is refused; a lock whose process is gone is taken over, with a message;
* checks the directory is writable (a probe file) and has room for one checkpoint (``needed_bytes``);
* removes temporary directories left by a killed run (``.tmp-checkpoint-*``, ``.old-checkpoint-*``,
  ``.tmp-final-*``).

Every refusal is a :class:`oomdoctor.errors.BadInput` (exit 2) naming the directory and the next command.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomdoctor.errors import BadInput
from oomdoctor.train.restart import MARKER as OOM_MARKER
from oomdoctor.units import format_bytes

LOCK_NAME = ".oomdoctor.lock"
#: Subdirectory of ``output_dir`` with the merged model (``merge_adapter: true``).
MERGED_DIR = "merged"
#: Files a finished or running oomdoctor run writes at the top of ``output_dir`` (besides ``checkpoint-N/``).
RUN_FILES = (
    "summary.json",
    "metrics.jsonl",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "runs",
    MERGED_DIR,
    OOM_MARKER,
)
#: The final model is written into ``output_dir/.tmp-final-<pid>`` before it is moved in (``train.outputs``).
FINAL_TMP_PREFIX = ".tmp-final-"
TEMP_PREFIXES = (".tmp-checkpoint-", ".old-checkpoint-", FINAL_TMP_PREFIX)


@dataclass
class RunDir:
    """A locked ``output_dir``; :meth:`release` (or the context manager) unlocks it."""

    path: Path
    """The output directory."""
    lock: Path
    """The lock file this process holds."""

    def release(self) -> None:
        try:
            if self.lock.read_text().split()[0] == str(os.getpid()):
                self.lock.unlink()
        except (OSError, IndexError):
            pass

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_entries(path: Path) -> list[str]:
    """Names in ``path`` that belong to an oomdoctor run (checkpoints and outputs), sorted."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name.startswith("checkpoint-") or p.name in RUN_FILES)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_lock(path: Path, emit: Callable[[str], None]) -> Path:
    lock = path / LOCK_NAME
    me = f"{os.getpid()} {socket.gethostname()}\n"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = lock.read_text(errors="replace").split()
            pid = int(owner[0]) if owner and owner[0].isdigit() else -1
            host = owner[1] if len(owner) > 1 else "?"
            if pid > 0 and (host != socket.gethostname() or _pid_alive(pid)):
                raise BadInput(
                    f"output_dir {path} is in use by another run (pid {pid} on {host}; lock {lock})",
                    "wait for it to finish, or choose another output_dir",
                ) from None
            emit(f"removed a stale lock of a run that is gone (pid {pid}): {lock}")
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(me)
        return lock
    raise BadInput(f"output_dir {path}: could not take the lock {lock}", "remove it if no run is using the directory")


def _check_writable(path: Path) -> None:
    probe = path / f".oomdoctor-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise BadInput(
            f"output_dir {path} is not writable ({exc.strerror or exc})",
            "fix its permissions or choose another output_dir",
        ) from None


def check_space(path: Path, needed_bytes: int) -> None:
    """Refuse to start when the filesystem of ``path`` cannot hold ``needed_bytes`` (one checkpoint)."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise BadInput(
            f"output_dir {path}: {format_bytes(free)} free, one checkpoint needs about {format_bytes(needed_bytes)}",
            "free some space or choose an output_dir on another disk",
        )


def _restore_moved_aside(path: Path, emit: Callable[[str], None]) -> None:
    """Put back a checkpoint a re-save had moved aside (``.old-checkpoint-<step>-<pid>``,
    ``checkpoint._replace_into``) when it died before its replacement landed: that copy is then the only one, and
    it belongs to the run the directory holds (judged after this)."""
    for old in sorted(path.glob(".old-checkpoint-*")):
        final = path / f"checkpoint-{old.name.split('-')[2]}"
        if not final.exists():
            os.replace(old, final)
            emit(f"restored {final.name}: an interrupted save had moved it aside")


def _clean_temporaries(path: Path, emit: Callable[[str], None]) -> None:
    """Remove what an interrupted save left (moved-aside checkpoints already restored)."""
    stale = [p for p in path.iterdir() if p.name.startswith(TEMP_PREFIXES)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    if stale:
        emit(f"removed {len(stale)} temporary checkpoint dir(s) left by an interrupted save in {path}")


def _overwrite(path: Path, entries: list[str], emit: Callable[[str], None]) -> None:
    for name in entries:
        p = path / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    emit(f"--overwrite: removed the previous run in {path} ({len(entries)} entries)")


def open_run_dir(
    output_dir: str | Path,
    *,
    resume: bool,
    overwrite: bool,
    emit: Callable[[str], None] = lambda m: None,
    restarted: bool = False,
) -> RunDir:
    """Validate, lock and tidy ``output_dir`` for a run (see the module docstring). ``restarted``: torchrun restarted
    this job, and the lock a dead process left is the previous attempt's (a rank leaves with ``os._exit`` after an
    OOM), taken over without a word."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise BadInput(f"output_dir {path} is a file, not a directory", "set output_dir to a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(
            f"output_dir {path} cannot be created ({exc.strerror or exc})",
            "choose an output_dir in a writable location",
        ) from None
    _check_writable(path)
    lock = _take_lock(path, (lambda m: None) if restarted else emit)
    try:
        _restore_moved_aside(path, emit)
        entries = run_entries(path)
        if entries and not resume and not overwrite:
            shown = ", ".join(entries[:4]) + (" ..." if len(entries) > 4 else "")
            raise BadInput(
                f"output_dir {path} already holds a run ({shown})",
                "continue it with --resume, replace it with --overwrite, or choose another output_dir",
            )
        _clean_temporaries(path, emit)
        if entries and overwrite and not resume:
            _overwrite(path, entries, emit)
    except BaseException:
        RunDir(path, lock).release()
        raise
    return RunDir(path, lock)


__all__ = ["RunDir", "open_run_dir", "check_space", "run_entries", "FINAL_TMP_PREFIX", "LOCK_NAME", "RUN_FILES"]
