"""Silence third-party messages that say nothing about the user's run (one place, called by the CLI and train)."""

from __future__ import annotations

import logging
import warnings


def quiet_third_party() -> None:
    """bitsandbytes warns at import that an optional CPU 4-bit speed kernel (the ``kernels`` package) is missing;
    transformers 5.x warns on every gradient-checkpointing call that the name changes in v6. Neither is actionable
    for an oomdoctor user."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6.*", category=FutureWarning)
