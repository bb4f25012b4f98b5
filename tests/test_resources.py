"""Bundled files (oomdoctor/resources.py): ``bundled:`` names, path resolution, and the packaging that ships them.

The wheel install itself is exercised in tests/test_wheel.py (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from oomdoctor.errors import BadInput
from oomdoctor.resources import (
    TINY_DATASET,
    TINY_MODEL_CONFIG,
    TINY_SFT_DATASET,
    TINY_TOKENIZER,
    TINY_TRAIN_CONFIG,
    bundled_path,
    configs_dir,
    is_bundled,
    models_dir,
    package_dir,
    resolve_path,
    tiny_dir,
)

REPO = Path(__file__).resolve().parent.parent


def test_bundled_names_point_at_package_files():
    for name in (TINY_DATASET, TINY_SFT_DATASET, TINY_MODEL_CONFIG, TINY_TRAIN_CONFIG):
        assert is_bundled(name) and bundled_path(name).is_file(), name
    assert bundled_path(TINY_TOKENIZER) == tiny_dir() / "tokenizer"
    assert (bundled_path(TINY_TOKENIZER) / "tokenizer.json").is_file()
    assert tiny_dir().is_relative_to(package_dir())
    # run from source, configs/ is the checkout's top-level folder (not a copy inside the package)
    assert configs_dir() == REPO / "configs" and models_dir() == REPO / "configs" / "models"
    assert not is_bundled("data/tiny/train.jsonl")


def test_bad_bundled_names_are_bad_input():
    with pytest.raises(BadInput, match="no bundled tree 'nope'") as exc:
        bundled_path("bundled:nope/x.json")
    assert "bundled:tiny/" in exc.value.hint
    with pytest.raises(BadInput, match="no such bundled file") as exc:
        bundled_path("bundled:tiny/trian.jsonl")
    assert "train.jsonl" in exc.value.hint  # lists what the folder holds
    with pytest.raises(BadInput, match="'..'"):
        bundled_path("bundled:tiny/../../errors.py")


def test_resolve_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_path(TINY_DATASET, []) == str(tiny_dir() / "train.jsonl")
    assert resolve_path("bundled:tiny/missing.jsonl", []) is None
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "cfgdir" / "mine.jsonl").write_text("{}\n")
    assert resolve_path("mine.jsonl", [tmp_path, tmp_path / "cfgdir"]) == str(tmp_path / "cfgdir" / "mine.jsonl")
    assert resolve_path(str(tmp_path / "cfgdir" / "mine.jsonl"), []) == str(tmp_path / "cfgdir" / "mine.jsonl")
    assert resolve_path("mine.jsonl", [tmp_path]) is None
    # a file in the base directory wins over the bundled one of the same repository-layout name
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "tiny" / "train.jsonl").write_text("{}\n")
    assert resolve_path("data/tiny/train.jsonl", [tmp_path]) == str(tmp_path / "data" / "tiny" / "train.jsonl")
    # the repository-layout spellings written before the data moved into the package still resolve, from anywhere
    assert resolve_path("data/tiny/sft.jsonl", [tmp_path]) == str(tiny_dir() / "sft.jsonl")
    assert resolve_path("configs/train/tiny-cpu.yaml", [tmp_path]) == str(bundled_path(TINY_TRAIN_CONFIG))


def test_train_config_and_model_take_bundled_names(tmp_path, monkeypatch):
    from oomdoctor.model.load import load_spec
    from oomdoctor.train.config import load_train_config

    monkeypatch.chdir(tmp_path)
    cfg = load_train_config(TINY_TRAIN_CONFIG)
    assert cfg.model.config == str(bundled_path(TINY_MODEL_CONFIG))
    assert cfg.model.tokenizer == str(bundled_path(TINY_TOKENIZER))
    assert cfg.dataset.path == str(bundled_path(TINY_DATASET))
    spec = load_spec(TINY_MODEL_CONFIG)
    assert spec.source == "local" and spec.num_layers == 2
    with pytest.raises(BadInput, match="no such bundled file"):
        load_spec("bundled:tiny/model/missing.json")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_pyproject_lists_every_package():
    st = _pyproject()["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "oomdoctor").rglob("__init__.py")}
    mapped = set(st["package-dir"])
    assert set(st["packages"]) == on_disk | mapped, "keep [tool.setuptools] packages in step with oomdoctor/"
    assert st["package-dir"] == {"oomdoctor.configs": "configs"}


def test_package_data_covers_every_bundled_file():
    """Every file under oomdoctor/data and configs/ matches a package-data glob (so the wheel ships it)."""
    st = _pyproject()["tool"]["setuptools"]
    globs = st["package-data"]
    shipped = {p for g in globs["oomdoctor"] for p in (REPO / "oomdoctor").glob(g) if p.is_file()}
    shipped |= {p for g in globs["oomdoctor.configs"] for p in (REPO / "configs").glob(g) if p.is_file()}
    files = {p for p in (REPO / "oomdoctor" / "data").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    files |= {p for p in (REPO / "configs").rglob("*") if p.is_file()}
    assert files and files <= shipped, sorted(str(p.relative_to(REPO)) for p in files - shipped)
