"""``tune --emit`` works as written: for a model directory with weights, the emitted file trains with the trainer's own
command — ``trl sft --config FILE`` and the HF script ``python -m oomdoctor.execute.trainers.hf FILE`` — adding only
what a CPU machine needs (``--use_cpu``) and a step limit. Real subprocesses, the bundled tiny Llama with random
weights saved as a model directory, the bundled tokenizer and dataset."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from oomdoctor.resources import TINY_DATASET, bundled_path, tiny_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """The bundled tiny model with random weights and the bundled tokenizer, saved as ``from_pretrained`` reads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("tiny-weights")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir() / "model")).save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny_dir() / "tokenizer").save_pretrained(d)
    return d


def _run(args: list[str], cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _tune(weights_dir, tmp_path, target: str, *pins: str) -> dict:
    out = tmp_path / f"plan-{target}"
    r = _run(
        [
            sys.executable,
            "-m",
            "oomdoctor",
            "tune",
            str(weights_dir),
            "--gpu-mem",
            "1GB",
            "--seq-len",
            "64",
            "--global-batch",
            "4",
            "--emit",
            target,
            "--dataset",
            str(bundled_path(TINY_DATASET)),
            "--verify",
            "none",
            "--output",
            str(out),
            "--json",
            *pins,
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("pins", [(), ("--method", "qlora", "--quant", "nf4")], ids=["best", "qlora"])
def test_trl_sft_trains_the_emitted_file(weights_dir, tmp_path, pins):
    if shutil.which("trl") is None:
        pytest.skip("the trl command is not installed")
    d = _tune(weights_dir, tmp_path, "trl", *pins)
    assert d["plan"]["trainer"] == "trl"
    r = _run(
        [
            "trl",
            "sft",
            "--config",
            d["config_path"],
            "--use_cpu",
            "true",
            "--max_steps",
            "2",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'loss'" in r.stdout + r.stderr
    doc = yaml.safe_load(open(d["config_path"]))
    assert doc["per_device_train_batch_size"] * doc["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize(
    "pins", [(), ("--method", "qlora", "--quant", "int8", "--no-kbit-upcast")], ids=["best", "int8-no-upcast"]
)
def test_the_hf_script_trains_the_emitted_file(weights_dir, tmp_path, pins):
    d = _tune(weights_dir, tmp_path, "hf", *pins)
    assert d["plan"]["trainer"] == "hf"
    r = _run(
        [
            sys.executable,
            "-m",
            "oomdoctor.execute.trainers.hf",
            d["config_path"],
            "--use_cpu",
            "--max_steps",
            "2",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RuntimeWarning" not in r.stderr  # the module runs as a script without being imported twice
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
