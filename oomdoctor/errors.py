"""Exceptions that the CLI turns into one clear line and an exit code (in ``oomdoctor.cli``, one place).

Exit codes (documented in the README): 0 done / fits, 2 bad input, 3 does not fit, 4 OOM not recoverable,
74 a write failed (disk full, I/O error: nothing half-written, earlier files and checkpoints intact), 130 interrupted
(Ctrl-C; ``train`` saves a checkpoint first). 75 is internal to sharded ``train`` runs: a rank that ran
out of memory exits with it so that torchrun restarts the job smaller (``oomdoctor.train.restart``).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3
EXIT_OOM = 4
EXIT_INTERRUPTED = 130
#: Writing a file or a checkpoint failed (disk full, quota, I/O error): BSD ``EX_IOERR``.
EXIT_WRITE_FAILED = 74
#: A rank of a sharded (FSDP) run ran out of memory and asks torchrun for a restart (BSD ``EX_TEMPFAIL``).
EXIT_OOM_RESTART = 75


class OomDoctorError(Exception):
    """Base class: ``message`` says what is wrong, ``hint`` the next command to run."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n{self.hint}"


class BadInput(OomDoctorError):
    """Unknown model, malformed config, impossible plan, bad size string... (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class ConfigErrors(BadInput):
    """Several problems in one config file, all reported at once (torchtune style)."""

    def __init__(self, source: str, problems: list[str], hint: str | None = None):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}", hint)


class DoesNotFit(OomDoctorError):
    exit_code = EXIT_DOES_NOT_FIT


class UnrecoverableOOM(OomDoctorError):
    exit_code = EXIT_OOM


class NoGPU(OomDoctorError):
    """An action needs a CUDA GPU and none is present (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class WriteFailed(OomDoctorError):
    """Writing a file or a checkpoint failed midway (disk full, quota, I/O error): what was half-written is removed,
    earlier files and checkpoints are intact, the message says where and how much space is free (exit 74)."""

    exit_code = EXIT_WRITE_FAILED


class Interrupted(OomDoctorError):
    """The user stopped a run (Ctrl-C); ``train`` saved a checkpoint at the step boundary (exit 130)."""

    exit_code = EXIT_INTERRUPTED
