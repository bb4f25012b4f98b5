"""Shared test set-up: offline hub, tiny model configs, the GPU skip marker, the sampling of slow grids."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OOMDOCTOR_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# measured block activations (oomdoctor.engines.blocks) are cached per test session, not in the user's cache
os.environ.setdefault("OOMDOCTOR_CACHE", tempfile.mkdtemp(prefix="oomdoctor-cache-"))
# measured in the test process, one after the other: a pool's workers each import torch (~8 s of CPU), more than a
# tiny config's measurements take (tests/test_block_pool.py runs the pool)
os.environ.setdefault("OOMDOCTOR_WORKERS", "1")

#: A tiny Llama-shaped config: 2 layers, hidden 64 (the size every CPU test uses).
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no usable torch means no GPU
        return False


#: ``make test`` (what CI runs) leaves out the tests marked ``heavy`` and, of a slow parametrized grid, runs only
#: every GRID_STRIDE-th case (the first always); ``make test-all`` (``OOMDOCTOR_TEST_ALL=1``) runs everything.
#: Tests marked ``every_case`` (each benchmark, each case a different script) are never sampled.
GRID_STRIDE = 8
TEST_ALL_ENV = "OOMDOCTOR_TEST_ALL"


def sampled_out(items: list) -> list:
    """The tests ``make test`` leaves to ``make test-all``, in collection order: the heavy ones and the cases of
    slow parametrized grids off the sample."""
    seen: dict[tuple, int] = {}
    out = []
    for item in items:
        if "heavy" in item.keywords:
            out.append(item)
            continue
        if not hasattr(item, "callspec") or "slow" not in item.keywords or "every_case" in item.keywords:
            continue
        key = (item.path, item.originalname)
        index = seen[key] = seen.get(key, -1) + 1
        if index % GRID_STRIDE:
            out.append(item)
    return out


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(pytest.mark.slow)  # make test-fast leaves them out too
    if not os.environ.get(TEST_ALL_ENV):
        dropped = set(map(id, sampled_out(items)))
        if dropped:
            config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
            items[:] = [i for i in items if id(i) not in dropped]
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_config() -> dict:
    return dict(TINY_LLAMA)


@pytest.fixture
def tiny_config_path(tmp_path, tiny_config) -> str:
    p = tmp_path / "tiny" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(tiny_config))
    return str(p)


@pytest.fixture
def tiny_spec(tiny_config):
    from oomdoctor.model.load import spec_from_config

    return spec_from_config(tiny_config, name="tiny-llama")


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(size, read_only=False)``: a real tmpfs of ``size`` bytes mounted under ``tmp_path`` (a disk that
    fills, or a read-only filesystem), unmounted at teardown; the test is skipped where mounting is not allowed (not
    root, no CAP_SYS_ADMIN)."""
    import subprocess

    mounted = []

    def mount(size: int, read_only: bool = False):
        from pathlib import Path

        d = Path(tmp_path) / f"fs{len(mounted)}"
        d.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
