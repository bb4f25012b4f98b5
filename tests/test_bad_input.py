"""Bad input answers at once with one message and a documented exit code, never a traceback or a hang: absurd sizes,
configs transformers refuses, train configs the run could not honour (dry run and run alike), the keys command the
messages point at."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from train_util import TINY_YAML, cli, run_main, tiny_cfg, write_yaml

from oomdoctor.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, ConfigErrors

LLAMA = "meta-llama/Llama-2-7b-hf"
TINY = "bundled:tiny/model/config.json"


# ---------------------------------------------------------------------------------------------- absurd sizes


def test_a_sequence_beyond_the_models_positions_is_refused_before_pricing(capsys):
    for verb in (["diagnose", LLAMA], ["tune", LLAMA, "--gpu-mem", "24GB", "--verify", "none"]):
        code, out, err = run_main(verb + ["--seq-len", "10000000"], capsys)
        assert code == EXIT_BAD_INPUT, err
        assert "--seq-len 10,000,000 is beyond the 4,096 positions" in err and "Traceback" not in err
        assert "--seq-len 4096 or less" in err and not out and "ranking" not in err


def test_the_position_limit_counts_rope_scaling_and_relative_positions():
    from oomdoctor.model.load import load_spec

    assert load_spec("meta-llama/Llama-3.1-8B").position_limit == 131072  # llama3 rope: already extended
    yarn = replace(
        load_spec("Qwen/Qwen2.5-7B"),
        max_position_embeddings=32768,
        config={"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    )
    assert yarn.position_limit == 131072  # Qwen's YaRN recipe keeps max_position_embeddings at the original
    assert load_spec("google-t5/t5-small").position_limit == 0  # relative buckets: no limit


def test_tune_seq_len_max_stops_at_the_models_positions(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(
        ["tune", TINY, "--gpu-mem", "80GB", "--seq-len", "max", "--no-tiled-mlp", "--verify", "none", "--json"], capsys
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["seq_len"] == 512 and any("up to the model's 512 positions" in n for n in d["notes"])


def test_an_absurd_micro_batch_is_priced_in_closed_form(capsys):
    """10^12 sequences: the analytic formulas price it (no loop over the size, no tensor of that size); tune's
    longest-context search answers that no plan fits."""
    pins = [
        "--method",
        "lora",
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "adamw",
        "--gradient-checkpointing",
        "--attn",
        "sdpa",
        "--loss",
        "standard",
        "--lora-r",
        "8",
        "--no-tiled-mlp",
    ]
    code, out, err = run_main(
        ["diagnose", LLAMA, "--micro-batch", "1000000000000", "--gpu-mem", "24GB", "--json"] + pins, capsys
    )
    assert code == 0, err
    (plan,) = json.loads(out)["plans"]
    one = json.loads(run_main(["diagnose", LLAMA, "--micro-batch", "1", "--json"] + pins, capsys)[1])["plans"][0]
    assert plan["fits"] is False
    assert 0.99e12 < plan["memory"]["activations_bytes"] / one["memory"]["activations_bytes"] < 1.01e12
    code, _, err = run_main(
        ["tune", LLAMA, "--gpu-mem", "24GB", "--seq-len", "max", "--micro-batch", "1000000000000", "--verify", "none"]
        + pins[:7],
        capsys,
    )
    assert code == EXIT_DOES_NOT_FIT and "no plan fits" in err and "Traceback" not in err


def test_an_absurd_global_batch_is_planned_without_factoring_it():
    """--global-batch 10**18: the micro-batch is a divisor up to what fits, found among those (trial division up to
    10**9 before: no answer in minutes)."""
    from oomdoctor.plan.batch import choose_micro_batch, divisors
    from oomdoctor.tune.tuner import tune

    assert divisors(10**18, upto=10) == [1, 2, 4, 5, 8, 10] and divisors(36, upto=10) == [1, 2, 3, 4, 6, 9]
    assert choose_micro_batch(400, 10**18).micro_batch == 400
    r = tune(TINY, gpu_mem=10**9, seq_len=64, global_batch=10**18, gpu=None, verify_mode="none")
    assert r.plan.micro_batch * r.plan.grad_accum == 10**18 and r.plan.micro_batch <= 1024


# ---------------------------------------------------------------------------------------------- configs


def _config(tmp_path, name: str, **changes) -> str:
    from oomdoctor.model.load import load_config

    raw, _, _ = load_config(TINY)
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps({**raw, **changes}))
    return str(p)


def test_a_model_kind_transformers_does_not_know_says_so(tmp_path, capsys):
    code, _, err = run_main(["diagnose", _config(tmp_path, "blorp", model_type="blorpformer")], capsys)
    assert code == EXIT_BAD_INPUT and "Traceback" not in err
    assert "model_type 'blorpformer' is not a kind of model transformers" in err
    assert "pip install -U transformers" in err and "oomdoctor models" in err
    assert "Should contain one of" not in err  # not transformers' own complaint (its list of every model type)


def test_train_refuses_configs_transformers_refuses_in_the_dry_run_and_the_run(tmp_path):
    bad = _config(tmp_path, "yarn", rope_parameters={"rope_type": "yarn"})  # YaRN without its factor
    cfg = tiny_cfg(tmp_path / "out", model=replace(tiny_cfg(tmp_path).model, config=bad))
    yaml = write_yaml(tmp_path / "c.yaml", cfg)
    for args in (["--dry-run"], []):
        p = cli("train", yaml, *args)
        assert p.returncode == EXIT_BAD_INPUT and "Traceback" not in p.stderr, p.stderr
        assert "model.config" in p.stderr and "refuses this llama config" in p.stderr and "'factor'" in p.stderr
    assert not (tmp_path / "out").exists()  # refused before output_dir was touched


# ---------------------------------------------------------------------------------------------- train


def test_train_lists_every_problem_the_model_and_data_show_dry_run_and_run_alike(tmp_path):
    """A packed dataset shorter than one row, a seq_len beyond the model's 512 positions: one error listing both,
    from --dry-run and from the run (before output_dir exists)."""
    data = tmp_path / "short.jsonl"
    data.write_text('{"text": "hello world."}\n')
    base = tiny_cfg(tmp_path / "out")
    cfg = replace(base, seq_len=100_000, dataset=replace(base.dataset, path=str(data), packing=True))
    yaml = write_yaml(tmp_path / "c.yaml", cfg)
    outputs = []
    for args in (["--dry-run"], []):
        p = cli("train", yaml, *args)
        assert p.returncode == EXIT_BAD_INPUT and "Traceback" not in p.stderr, p.stderr
        assert "2 problem(s)" in p.stderr
        assert "seq_len 100,000 is beyond the 512 positions" in p.stderr
        assert "fewer than one packed row of seq_len 100,000" in p.stderr
        assert "`oomdoctor keys` lists every key" in p.stderr
        # progress lines ("[  2.0s] ...") say how long a stage took: the rest is the same message
        outputs.append([ln for ln in p.stderr.splitlines() if not ln.startswith("[")])
    assert outputs[0] == outputs[1]
    assert not (tmp_path / "out").exists()


def test_a_dataset_shorter_than_one_packed_row_is_refused_precisely(tmp_path):
    """Packed: the tokens as the run encodes them (EOS included) must fill one row of seq_len; unpacked, each sample
    is its own padded row and a short dataset trains."""
    from oomdoctor.execute.load import load_tokenizer
    from oomdoctor.train.data import dataset_tokens
    from oomdoctor.train.dryrun import dry_run
    from oomdoctor.train.preflight import model_source

    data = tmp_path / "short.jsonl"
    data.write_text('{"text": "hello world."}\n{"text": "the fox is red."}\n')
    base = tiny_cfg(tmp_path / "out")
    packed = replace(base, dataset=replace(base.dataset, path=str(data), packing=True))
    n = dataset_tokens(packed.dataset, load_tokenizer(model_source(packed)), 10**9)
    assert 2 < n < 64
    with pytest.raises(ConfigErrors, match=f"dataset: {n} tokens in all"):
        dry_run(replace(packed, seq_len=n + 1))
    assert dry_run(replace(packed, seq_len=n)).plan.seq_len == n  # exactly one row: fine
    assert dry_run(replace(packed, dataset=replace(packed.dataset, packing=False))).plan.seq_len == 64


def test_a_negative_max_steps_is_refused_in_code_too(tmp_path):
    from oomdoctor.train.dryrun import dry_run
    from oomdoctor.train.loop import train
    from oomdoctor.train.sizing import total_steps

    cfg = tiny_cfg(tmp_path / "out", max_steps=-5)
    with pytest.raises(ConfigErrors, match="max_steps: must be >= 1, got -5"):
        dry_run(cfg)
    with pytest.raises(ConfigErrors, match="max_steps: must be >= 1, got -5"):
        train(cfg)
    assert not (tmp_path / "out").exists()
    assert total_steps(replace(cfg, max_steps=-1, num_train_epochs=2.0), 10, 5) == 4  # HF's -1: unset
    p = cli("train", TINY_YAML, "--max-steps", "-5")
    assert p.returncode == EXIT_BAD_INPUT and "--max-steps must be >= 1" in p.stderr


# ---------------------------------------------------------------------------------------------- keys


def test_keys_lists_every_train_key_with_its_meaning(capsys):
    from oomdoctor.train.config.schema import DATASET_KEYS, MODEL_KEYS, TOP_KEYS

    code, out, _ = run_main(["keys", "--json"], capsys)
    assert code == 0
    docs = {d["key"]: d for d in json.loads(out)["keys"]}
    assert set(docs) == (
        {k.name for k in TOP_KEYS}
        | {f"model.{k.name}" for k in MODEL_KEYS}
        | {f"dataset.{k.name}" for k in DATASET_KEYS}
    )
    assert all(d["help"] for d in docs.values())
    assert "per_device_train_batch_size" in docs["micro_batch_size"]["aliases"]
    code, out, _ = run_main(["keys", "packing"], capsys)
    assert code == 0 and "dataset.packing" in out and "learning_rate" not in out
    code, _, err = run_main(["keys", "nosuchkey"], capsys)
    assert code == EXIT_BAD_INPUT and "no train key matches" in err


def test_config_errors_point_at_the_keys_command(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(TINY_YAML.read_text() + "learning_rat: 1\n")
    r = cli("train", p, "--dry-run")
    assert r.returncode == EXIT_BAD_INPUT and "`oomdoctor keys`" in r.stderr and "docs/" not in r.stderr
