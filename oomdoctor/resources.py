"""Files shipped inside the package, found through :mod:`importlib.resources` (one place for every bundled file).

Two bundled trees, named ``bundled:<tree>/<path>`` anywhere a path is accepted (train YAML ``model.path``,
``model.config``, ``model.tokenizer``, ``dataset.path``; ``diagnose``/``tune`` MODEL):

- ``bundled:tiny/...``: the tiny training assets in ``oomdoctor/data/tiny`` (``model/config.json``, ``tokenizer/``,
  ``train.jsonl``, ``sft.jsonl``).
- ``bundled:configs/...``: the repository's top-level ``configs/`` (``models/`` registry, ``train/`` examples).
  pyproject maps it into the wheel as ``oomdoctor/configs``; in a source checkout (editable install) it is read
  where it lives, beside the package.

These names resolve the same after a wheel install, from any working directory, so ``tune`` writes them.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from oomdoctor.errors import BadInput

#: Prefix that names a bundled file: ``bundled:tiny/train.jsonl``.
PREFIX = "bundled:"

#: Bundled sample dataset (``{"text": ...}`` records).
TINY_DATASET = PREFIX + "tiny/train.jsonl"
#: Bundled prompt/response dataset (``{"prompt": ..., "response": ...}``).
TINY_SFT_DATASET = PREFIX + "tiny/sft.jsonl"
#: Bundled BPE tokenizer matching the tiny model's vocabulary.
TINY_TOKENIZER = PREFIX + "tiny/tokenizer"
#: Bundled tiny Llama-shaped config (2 layers, hidden 64).
TINY_MODEL_CONFIG = PREFIX + "tiny/model/config.json"
#: Bundled train config of the CPU smoke run.
TINY_TRAIN_CONFIG = PREFIX + "configs/train/tiny-cpu.yaml"

#: Repository-layout spellings of the bundled trees (``data/tiny/...``, ``configs/...`` as written before the data
#: moved into the package): a relative path found nowhere else resolves through these.
_REPO_LAYOUT = {"data/tiny/": "tiny/", "configs/": "configs/"}


def package_dir() -> Path:
    """Directory of the installed ``oomdoctor`` package (a real directory: the assets are opened by path)."""
    return Path(str(files("oomdoctor")))


def tiny_dir() -> Path:
    """``oomdoctor/data/tiny``: the tiny model config, tokenizer and datasets."""
    return package_dir() / "data" / "tiny"


def configs_dir() -> Path:
    """The ``configs/`` tree: ``oomdoctor/configs`` in a wheel install, the checkout's top-level ``configs/`` when
    the package runs from source (editable install or the repository as working directory)."""
    shipped = package_dir() / "configs"
    return shipped if shipped.is_dir() else package_dir().parent / "configs"


def models_dir() -> Path:
    """Bundled model configs (``configs/models``) or ``$OOMDOCTOR_MODELS_DIR`` when set."""
    env = os.environ.get("OOMDOCTOR_MODELS_DIR")
    return Path(env) if env else configs_dir() / "models"


#: The bundled trees by name: ``bundled:<name>/...``.
_TREES = {"tiny": tiny_dir, "configs": configs_dir}


def is_bundled(ref: str) -> bool:
    """True for a ``bundled:...`` name."""
    return isinstance(ref, str) and ref.startswith(PREFIX)


def _locate(ref: str) -> Path:
    """Filesystem path a ``bundled:<tree>/<path>`` name stands for (may not exist); BadInput for an unknown tree."""
    rel = ref[len(PREFIX) :].lstrip("/")
    tree, _, rest = rel.partition("/")
    if tree not in _TREES:
        raise BadInput(
            f"{ref!r}: no bundled tree {tree!r}",
            f"bundled names start with {', '.join(PREFIX + t + '/' for t in _TREES)}",
        )
    parts = Path(rest).parts
    if ".." in parts:
        raise BadInput(f"{ref!r}: '..' is not allowed in a bundled name")
    return _TREES[tree]().joinpath(*parts)


def bundled_path(ref: str) -> Path:
    """Existing file or directory named by ``bundled:<tree>/<path>``; BadInput (with what is there) otherwise."""
    path = _locate(ref)
    if not path.exists():
        parent = path.parent
        there = sorted(p.name for p in parent.iterdir()) if parent.is_dir() else []
        raise BadInput(
            f"{ref!r}: no such bundled file",
            f"{PREFIX}{ref[len(PREFIX) :].rsplit('/', 1)[0]}/ holds: {', '.join(there)}"
            if there
            else f"bundled names start with {', '.join(PREFIX + t + '/' for t in _TREES)}",
        )
    return path


def resolve_path(p: str, base_dirs: list[Path]) -> str | None:
    """Absolute path of ``p``, or None when it exists nowhere.

    ``bundled:...`` names resolve inside the package. A plain relative path resolves against each of
    ``base_dirs`` in turn (the current directory, the config's directory), then through the repository-layout
    spellings of the bundled trees (``data/tiny/...``, ``configs/...``)."""
    if is_bundled(p):
        path = _locate(p)
        return str(path) if path.exists() else None
    path = Path(os.path.expanduser(p))
    if path.is_absolute():
        return str(path) if path.exists() else None
    for base in base_dirs:
        cand = base / path
        if cand.exists():
            return str(cand.resolve())
    posix = path.as_posix()
    for layout, tree in _REPO_LAYOUT.items():
        if posix.startswith(layout):
            cand = _locate(PREFIX + tree + posix[len(layout) :])
            if cand.exists():
                return str(cand)
    return None
