"""Data (jsonl / json / text / parquet, packing, deterministic order) and loading a pretrained weights directory."""

from __future__ import annotations

import json

import pytest

from train_util import load_weights, max_abs_diff, tiny_cfg

from oomdoctor.errors import BadInput
from oomdoctor.resources import tiny_dir
from oomdoctor.train.config import DatasetConfig, ModelConfig
from oomdoctor.train.data import IGNORE, SampleOrder, collate, count_targets, load_records, tokenize


@pytest.fixture(scope="module")
def tok():
    from oomdoctor.execute.load import load_tokenizer

    return load_tokenizer(tiny_cfg("/tmp/unused").model)


def test_formats_agree(tmp_path, tok):
    texts = [json.loads(line)["text"] for line in (tiny_dir() / "train.jsonl").read_text().splitlines()[:20]]
    (tmp_path / "a.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "a.json").write_text(json.dumps({"train": [{"body": t} for t in texts]}))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet")
    ref = tokenize(DatasetConfig(path=str(tiny_dir() / "train.jsonl"), max_samples=20), tok, 64).samples
    for ds in (DatasetConfig(path=str(tmp_path / "a.txt")),
               DatasetConfig(path=str(tmp_path / "a.json"), text_field="body"),
               DatasetConfig(path=str(tmp_path / "a.parquet"))):
        assert tokenize(ds, tok, 64).samples == ref, ds
    with pytest.raises(BadInput, match="text_field"):
        tokenize(DatasetConfig(path=str(tmp_path / "a.json")), tok, 64)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(BadInput, match=r"bad.jsonl:2: not valid JSON"):
        load_records(DatasetConfig(path=str(tmp_path / "bad.jsonl")))


def test_packing_and_padding(tok):
    packed = tokenize(DatasetConfig(path=str(tiny_dir() / "train.jsonl"), packing=True), tok, 64)
    assert packed.packed and all(len(ids) == 64 for ids, _ in packed.samples)
    plain = tokenize(DatasetConfig(path=str(tiny_dir() / "train.jsonl")), tok, 16)
    assert plain.truncated > 0 and all(len(ids) <= 16 for ids, _ in plain.samples)
    batch = collate(plain.samples[:3], plain.pad_id, pad_to_multiple_of=8)
    assert batch["input_ids"].shape[1] % 8 == 0
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()
    assert count_targets(plain.samples[:3]) == int((batch["labels"][:, 1:] != IGNORE).sum())


def test_order_is_a_function_of_position():
    a = SampleOrder(10, seed=3, shuffle=True)
    b = SampleOrder(10, seed=3, shuffle=True)
    full = a.take(0, 25)
    assert b.take(13, 12) == full[13:]  # resuming at sample 13 continues the same sequence
    assert sorted(full[:10]) == list(range(10)) and full[:10] != full[10:20]  # new permutation per epoch
    assert SampleOrder(5, 0, shuffle=False).take(3, 4) == [3, 4, 0, 1]


def test_pretrained_weights_directory(tmp_path):
    """model.path with config.json + safetensors + tokenizer: from_pretrained straight into the target dtype;
    training from the saved random model reproduces training from the same random init."""
    import torch
    from transformers import AutoModelForCausalLM

    from oomdoctor.train.loop import train
    from oomdoctor.execute.load import hf_config, load_tokenizer

    cfg = tiny_cfg(tmp_path / "random", max_steps=2)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model))
    wdir = tmp_path / "weights"
    model.save_pretrained(wdir)
    load_tokenizer(cfg.model).save_pretrained(wdir)
    r1 = train(cfg)
    r2 = train(tiny_cfg(tmp_path / "pre", max_steps=2,
                        model=ModelConfig(path=str(wdir), init="pretrained")))
    assert r2.losses == pytest.approx(r1.losses, rel=1e-5)
    assert max_abs_diff(load_weights(r1.checkpoint), load_weights(r2.checkpoint)) < 1e-5
    r3 = train(tiny_cfg(tmp_path / "pre-bf16", max_steps=1, precision="bf16",
                        model=ModelConfig(path=str(wdir), init="pretrained")))
    assert all(t.dtype == torch.bfloat16 for t in load_weights(r3.checkpoint).values())
