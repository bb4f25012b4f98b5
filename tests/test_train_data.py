"""Data as TRL's SFTTrainer reads it (text, prompt/completion, messages; chat templates; loss masks; BOS/EOS;
packing without cross-sample attention), file formats, deterministic order, loading a pretrained weights directory."""

from __future__ import annotations

import json

import pytest
from train_util import ROOT, load_weights, max_abs_diff, tiny_cfg

from oomdoctor.errors import BadInput
from oomdoctor.resources import tiny_dir
from oomdoctor.train.config import DatasetConfig, ModelConfig
from oomdoctor.train.data import (
    CHATML,
    IGNORE,
    Sample,
    SampleOrder,
    collate,
    count_targets,
    load_records,
    pack_bfd,
    tokenize,
)


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
    for ds in (
        DatasetConfig(path=str(tmp_path / "a.txt")),
        DatasetConfig(path=str(tmp_path / "a.json"), text_field="body"),
        DatasetConfig(path=str(tmp_path / "a.parquet")),
    ):
        assert tokenize(ds, tok, 64).samples == ref, ds
    with pytest.raises(BadInput, match="text_field"):
        tokenize(DatasetConfig(path=str(tmp_path / "a.json")), tok, 64)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(BadInput, match=r"bad.jsonl:2: not valid JSON"):
        load_records(DatasetConfig(path=str(tmp_path / "bad.jsonl")))


CHAT = str(tiny_dir() / "chat.jsonl")
SFT = str(tiny_dir() / "sft.jsonl")
TEXT = str(tiny_dir() / "train.jsonl")


@pytest.fixture(scope="module")
def bos_tok():
    """The tiny tokenizer, made to add BOS to plain text (as Llama's does)."""
    from tokenizers.processors import TemplateProcessing

    from oomdoctor.execute.load import load_tokenizer

    t = load_tokenizer(tiny_cfg("/tmp/unused").model)
    t._tokenizer.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 2)])
    return t


def _targets(tok, s: Sample) -> str:
    return tok.decode([t for t in s.labels if t != IGNORE])


def test_bos_and_eos_as_the_tokenizer_defines_them(tmp_path, tok, bos_tok):
    (tmp_path / "t.jsonl").write_text('{"text": "the cat is red."}\n{"text": "the dog is blue.</s>"}\n')
    ds = DatasetConfig(path=str(tmp_path / "t.jsonl"))
    plain = tokenize(ds, tok, 64).samples
    assert plain[0].input_ids == tok("the cat is red.")["input_ids"] + [tok.eos_token_id]  # tiny adds no BOS
    assert plain[1].input_ids.count(tok.eos_token_id) == 1  # EOS already last: not doubled
    with_bos = tokenize(ds, bos_tok, 64).samples
    for s in with_bos:
        assert s.input_ids[0] == bos_tok.bos_token_id and s.input_ids.count(bos_tok.bos_token_id) == 1
        assert s.input_ids[-1] == bos_tok.eos_token_id and s.input_ids.count(bos_tok.eos_token_id) == 1
    assert (
        tokenize(DatasetConfig(path=str(tmp_path / "t.jsonl"), add_eos=False), tok, 64).samples[0].input_ids[-1]
        != tok.eos_token_id
    )
    # conversations: the default template starts with BOS exactly when the tokenizer adds one; no EOS appended
    chat = tokenize(DatasetConfig(path=CHAT, max_samples=3), bos_tok, 512).samples
    assert all(s.input_ids[0] == bos_tok.bos_token_id and s.input_ids.count(bos_tok.bos_token_id) == 1 for s in chat)
    chat = tokenize(DatasetConfig(path=CHAT, max_samples=3), tok, 512).samples
    assert all(tok.bos_token_id not in s.input_ids and tok.eos_token_id not in s.input_ids for s in chat)


def test_prompt_completion(tmp_path, tok, bos_tok):
    data = tokenize(DatasetConfig(path=SFT, max_samples=20), bos_tok, 64)
    assert data.kind == "prompt_completion"  # the bundled records say "response": read as the completion
    recs = load_records(DatasetConfig(path=SFT, max_samples=20))
    for r, s in zip(recs, data.samples):
        n = sum(1 for t in s.labels if t == IGNORE)
        assert s.labels[:n] == [IGNORE] * n and s.labels[n:] == s.input_ids[n:]  # the prompt (and BOS) masked
        assert s.input_ids[0] == bos_tok.bos_token_id and s.input_ids[-1] == bos_tok.eos_token_id
        assert _targets(bos_tok, s).strip() == r["response"].strip() + "</s>"
    full = tokenize(DatasetConfig(path=SFT, max_samples=20, completion_only_loss=False), bos_tok, 64)
    assert all(s.labels == s.input_ids for s in full.samples)
    # TRL field names, and our older key names through the YAML
    (tmp_path / "pc.jsonl").write_text(json.dumps({"prompt": "what is one plus one?", "completion": " two."}) + "\n")
    s = tokenize(DatasetConfig(path=str(tmp_path / "pc.jsonl")), tok, 64).samples[0]
    assert _targets(tok, s) == " two.</s>"
    (tmp_path / "qa.jsonl").write_text(json.dumps({"q": "what is one plus one?", "a": " two."}) + "\n")
    from oomdoctor.train.config import load_train_config

    y = tmp_path / "c.yaml"
    y.write_text(
        f"model: {{config: {tiny_dir()}/model/config.json, tokenizer: {tiny_dir()}/tokenizer}}\n"
        f"dataset: {{path: {tmp_path}/qa.jsonl, type: prompt_response, prompt_field: q, response_field: a}}\n"
    )
    dcfg = load_train_config(y).dataset
    assert dcfg.completion_field == "a"
    assert tokenize(dcfg, tok, 64).samples[0] == s
    with pytest.raises(BadInput, match="completion_field"):
        tokenize(DatasetConfig(path=str(tmp_path / "qa.jsonl"), type="prompt_completion"), tok, 64)


def test_messages_and_assistant_only_loss(tmp_path, tok):
    recs = load_records(DatasetConfig(path=CHAT))
    assert 24 <= len(recs) <= 100
    every = tokenize(DatasetConfig(path=CHAT), tok, 512)
    assert every.kind == "messages" and "default ChatML" in every.notes[0]
    assert all(s.labels == s.input_ids for s in every.samples)  # assistant_only_loss off: every token
    assert tok.decode(every.samples[0].input_ids) == tok.apply_chat_template(
        recs[0]["messages"], chat_template=CHATML, tokenize=False, add_bos=False
    )
    only = tokenize(DatasetConfig(path=CHAT, assistant_only_loss=True), tok, 512)
    for r, s in zip(recs, only.samples):
        replies = [m["content"] + "<|im_end|>" for m in r["messages"] if m["role"] == "assistant"]
        assert _targets(tok, s) == "".join(replies)  # the replies and their end-of-turn, nothing else
    # the chat template: a string, a file, or the bundled chatml; the tokenizer's own when it has one
    plain = (
        "{% for m in messages %}{{ m['role'] }}: {% generation %}{{ m['content'] }}{% endgeneration %}\n{% endfor %}"
    )
    (tmp_path / "t.jinja").write_text(plain)
    for t in (plain, str(tmp_path / "t.jinja")):
        d = tokenize(DatasetConfig(path=CHAT, max_samples=2, chat_template=t), tok, 512)
        assert tok.decode(d.samples[0].input_ids).startswith(recs[0]["messages"][0]["role"] + ": ") and not d.notes
    tok.chat_template = plain.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    try:
        own = tokenize(DatasetConfig(path=CHAT, max_samples=2), tok, 512)
        assert not own.notes and "<|im_start|>" not in tok.decode(own.samples[0].input_ids)
        with pytest.raises(BadInput, match="generation"):  # no {% generation %}: the assistant cannot be told apart
            tokenize(DatasetConfig(path=CHAT, assistant_only_loss=True), tok, 512)
        assert (
            tokenize(
                DatasetConfig(path=CHAT, max_samples=2, assistant_only_loss=True, chat_template="chatml"), tok, 512
            ).samples
            == only.samples[:2]
        )
    finally:
        tok.chat_template = None
    with pytest.raises(BadInput, match="not conversational"):
        tokenize(DatasetConfig(path=TEXT, assistant_only_loss=True), tok, 64)
    with pytest.raises(BadInput, match="neither"):
        tokenize(DatasetConfig(path=CHAT, chat_template=str(tmp_path / "missing.jinja")), tok, 64)


def test_dataset_keys_in_yaml(tmp_path):
    """TRL spellings are accepted; a chat_template file is found next to the YAML; a missing one is reported."""
    from oomdoctor.errors import ConfigErrors
    from oomdoctor.train.config import load_train_config

    (tmp_path / "t.jinja").write_text(CHATML)
    head = f"model: {{config: {tiny_dir()}/model/config.json, tokenizer: {tiny_dir()}/tokenizer}}\n"
    y = tmp_path / "c.yaml"
    y.write_text(
        head + f"dataset: {{path: {CHAT}, dataset_text_field: body, chat_template: t.jinja, "
        "assistant_only_loss: true, completion_only_loss: false, packing: true}\n"
    )
    d = load_train_config(y).dataset
    assert (d.text_field, d.chat_template, d.assistant_only_loss, d.completion_only_loss, d.packing_strategy) == (
        "body",
        str(tmp_path / "t.jinja"),
        True,
        False,
        "bfd",
    )
    y.write_text(head + f"dataset: {{path: {CHAT}, chat_template: nope.jinja, packing_strategy: bdf, type: chat}}\n")
    with pytest.raises(ConfigErrors) as err:
        load_train_config(y)
    msg = str(err.value)
    assert "dataset.chat_template: 'nope.jinja'" in msg and "did you mean 'bfd'" in msg and "dataset.type" in msg


def test_conversational_prompt_completion(tmp_path, tok):
    rec = {
        "prompt": [{"role": "user", "content": "what color is the red fox?"}],
        "completion": [{"role": "assistant", "content": "the fox is red."}],
    }
    (tmp_path / "c.jsonl").write_text(json.dumps(rec) + "\n")
    s = tokenize(DatasetConfig(path=str(tmp_path / "c.jsonl")), tok, 512).samples[0]
    assert _targets(tok, s) == "the fox is red.<|im_end|>\n"  # the completion as the template writes it
    both = tokenize(DatasetConfig(path=str(tmp_path / "c.jsonl"), assistant_only_loss=True), tok, 512).samples[0]
    assert _targets(tok, both) == "the fox is red.<|im_end|>"  # and only its {% generation %} span


def test_bfd_packing(tok):
    seqs = [(list(range(1, n + 1)), list(range(1, n + 1))) for n in (30, 5, 64, 20, 40, 90, 12, 24)]
    rows = pack_bfd(seqs, 64)
    assert all(len(r.input_ids) <= 64 and sum(r.seq_lengths) == len(r.input_ids) for r in rows)
    pieces = []
    for r in rows:
        k = 0
        for n in r.seq_lengths:
            pieces.append(tuple(r.input_ids[k : k + n]))
            assert r.labels[k] == IGNORE and r.labels[k + 1 : k + n] == r.input_ids[k + 1 : k + n]
            k += n
    assert sorted(pieces) == sorted(tuple(ids[:64]) for ids, _ in seqs)  # every sequence once, whole (or truncated)
    # best fit decreasing: longest first, each into the fullest row it fits (the 90 is cut to 64)
    assert [r.seq_lengths for r in rows] == [(64,), (64,), (40, 24), (30, 20, 12), (5,)]
    data = tokenize(DatasetConfig(path=TEXT, packing=True), tok, 64)
    assert data.reset_positions and data == tokenize(DatasetConfig(path=TEXT, packing=True), tok, 64)
    assert sum(len(s.seq_lengths) for s in data.samples) == 600
    batch = collate(data.samples[:3], data.pad_id, pad_to_multiple_of=8, reset_positions=True)
    assert "attention_mask" not in batch and set(batch) == {"input_ids", "labels", "position_ids"}
    for i, s in enumerate(data.samples[:3]):
        starts = (batch["position_ids"][i, : len(s.input_ids)] == 0).nonzero().flatten().tolist()
        assert starts == [sum(s.seq_lengths[:j]) for j in range(len(s.seq_lengths))]
    wrapped = tokenize(DatasetConfig(path=TEXT, packing=True, packing_strategy="wrapped"), tok, 64)
    assert not wrapped.reset_positions and all(len(s.input_ids) == 64 for s in wrapped.samples[:-1])


def test_padding(tok):
    plain = tokenize(DatasetConfig(path=TEXT), tok, 16)
    assert plain.truncated > 0 and all(len(s.input_ids) <= 16 for s in plain.samples)
    batch = collate(plain.samples[:3], plain.pad_id, pad_to_multiple_of=8)
    assert batch["input_ids"].shape[1] % 8 == 0 and "position_ids" not in batch
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def tiny_model(request):
    import torch
    from transformers import AutoModelForCausalLM

    from oomdoctor.execute.load import hf_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        hf_config(tiny_cfg("/tmp/unused").model), attn_implementation=request.param
    ).eval()


def test_packed_samples_do_not_attend_to_each_other(tiny_model, tok):
    """The logits of a sequence packed after another equal its logits alone (transformers' block-diagonal mask
    from the restarting position_ids); concatenated without the reset they do not."""
    import torch

    data = tokenize(DatasetConfig(path=TEXT, packing=True), tok, 64)
    row = next(s for s in data.samples if len(s.seq_lengths) >= 2)
    a, n = row.seq_lengths[0], row.seq_lengths[1]
    second = row.input_ids[a : a + n]
    short = Sample(second, second, (n,))  # a padded row in the same batch: padding is a sequence of its own
    with torch.no_grad():
        batch = collate([row, short], data.pad_id, reset_positions=True)
        packed = tiny_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone = tiny_model(input_ids=torch.tensor([second])).logits[0]
        flat = collate([short, row], data.pad_id, reset_positions=True, flatten=True)
        flat_logits = tiny_model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits[0]
        leaky = tiny_model(input_ids=torch.tensor([row.input_ids])).logits[0]
    assert torch.allclose(packed[0, a : a + n], alone, atol=1e-5)
    assert torch.allclose(packed[1, :n], alone, atol=1e-5)
    assert torch.allclose(flat_logits[n + a : n + a + n], alone, atol=1e-5)
    assert (leaky[a : a + n] - alone).abs().max() > 1e-2  # the control: plain concatenation leaks


def test_loss_tokens_are_the_shifted_targets(tiny_model, tok):
    """count_targets (the summary's loss_tokens) is what transformers' causal LM loss averages over."""
    import torch

    packed = tokenize(DatasetConfig(path=TEXT, packing=True), tok, 64)
    padded = tokenize(DatasetConfig(path=SFT), tok, 64)
    chat = tokenize(DatasetConfig(path=CHAT, assistant_only_loss=True, packing=True), tok, 256)
    for data in (packed, padded, chat):
        rows = data.samples[:4]
        batch = collate(rows, data.pad_id, reset_positions=data.reset_positions)
        with torch.no_grad():
            total = tiny_model(**batch, num_items_in_batch=1).loss  # sum over targets
            mean = tiny_model(**batch).loss
        assert count_targets(rows) == int((batch["labels"][:, 1:] != IGNORE).sum())
        assert float(total / mean) == pytest.approx(count_targets(rows), rel=1e-4)


@pytest.mark.slow
def test_chat_run_end_to_end(tmp_path):
    """`oomdoctor train` on the bundled chat YAML: 2 steps, the JSON summary counts tokens and loss tokens."""
    from train_util import cli

    y = tmp_path / "chat.yaml"
    y.write_text(
        (ROOT / "configs/train/tiny-chat-cpu.yaml")
        .read_text()
        .replace("output_dir: runs/tiny-chat-cpu", f"output_dir: {tmp_path / 'run'}")
    )
    r = cli("train", y, "--max-steps", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["optimizer_steps"] == 2 and 0 < out["loss_tokens"] < out["tokens"], out
    assert any("ChatML" in n for n in out["notes"])


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

    from oomdoctor.execute.load import hf_config, load_tokenizer
    from oomdoctor.train.loop import train

    cfg = tiny_cfg(tmp_path / "random", max_steps=2)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model))
    wdir = tmp_path / "weights"
    model.save_pretrained(wdir)
    load_tokenizer(cfg.model).save_pretrained(wdir)
    r1 = train(cfg)
    r2 = train(tiny_cfg(tmp_path / "pre", max_steps=2, model=ModelConfig(path=str(wdir), init="pretrained")))
    assert r2.losses == pytest.approx(r1.losses, rel=1e-5)
    assert max_abs_diff(load_weights(r1.checkpoint), load_weights(r2.checkpoint)) < 1e-5
    r3 = train(
        tiny_cfg(
            tmp_path / "pre-bf16", max_steps=1, precision="bf16", model=ModelConfig(path=str(wdir), init="pretrained")
        )
    )
    assert all(t.dtype == torch.bfloat16 for t in load_weights(r3.checkpoint).values())
