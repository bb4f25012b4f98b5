"""oomdoctor's on-disk cache: what is slow to find and the same every time for the same inputs — the block
measurements of a model under a plan (``engines/blocks.py``), the parameter inventory of a model transformers builds
(``model/inventory.py``).

One directory, ``$OOMDOCTOR_CACHE``, else ``$XDG_CACHE_HOME/oomdoctor``, else ``~/.cache/oomdoctor``, one
subdirectory per kind of entry, one JSON file per entry named by a hash of what decides it (:func:`key_of`: the
inputs, the library versions whose code decides the result, a version of the entry's format). Entries are written
to a file at the side and renamed into place (``files.write_file_atomic``): a reader sees a whole entry or none. A
damaged or unreadable entry is made again; a cache that cannot be written (read-only, full) only costs the next run
the work again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from oomdoctor.errors import BadInput, WriteFailed
from oomdoctor.files import write_file_atomic

#: Environment variable naming the cache directory (default ``$XDG_CACHE_HOME/oomdoctor``, else ``~/.cache/oomdoctor``).
CACHE_ENV = "OOMDOCTOR_CACHE"


def cache_dir(kind: str) -> Path:
    """The directory of the entries of ``kind`` (``blocks``, ``specs``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / kind
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "oomdoctor" / kind


@functools.cache
def versions(*libs: str) -> dict[str, str]:
    """The installed versions of ``libs`` (whose code decides an entry) and of oomdoctor (whose code reads it), looked
    up once per process (~1 ms each: a tune prices hundreds of plans); ``""`` for one not installed as a
    distribution (a source tree on ``PYTHONPATH``)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(lib: str) -> str:
        try:
            return version(lib)
        except PackageNotFoundError:
            return ""

    return {lib: of(lib) for lib in ("oomdoctor", *libs)}


def key_of(doc: dict) -> str:
    """The key of the entry ``doc`` (everything that decides it) describes."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def entry_path(kind: str, key: str) -> Path:
    """The file of the entry ``key`` of ``kind``."""
    return cache_dir(kind) / f"{key}.json"


def read_json(kind: str, key: str) -> dict | None:
    """The entry ``key`` of ``kind``; None when there is none or it cannot be read."""
    try:
        doc = json.loads(entry_path(kind, key).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_json(kind: str, key: str, doc: dict) -> None:
    """Write the entry ``key`` of ``kind`` (atomically); a cache that cannot be written is left as it is."""
    try:
        write_file_atomic(entry_path(kind, key), json.dumps(doc), what=f"{kind} cache entry", overwrite=True)
    except (BadInput, WriteFailed):
        pass
