"""Generate the bundled tiny training assets under oomdoctor/data/tiny/ (package data, named ``bundled:tiny/...``;
committed; re-run to regenerate, deterministic).

- ``train.jsonl``: short generated English-like texts (``{"text": ...}``), learnable patterns so the loss
  of a 2-layer model visibly goes down within a minute on CPU.
- ``sft.jsonl``: prompt/response pairs (``{"prompt": ..., "response": ...}``), e.g. small arithmetic.
- ``chat.jsonl``: TRL ``messages`` conversations (user/assistant turns, some with a system turn) from the
  same small arithmetic/color questions, for chat runs (``configs/train/tiny-chat-cpu.yaml``); drawn from its own
  generator and not part of the tokenizer corpus, so the other assets do not change.
- ``tokenizer/``: a BPE tokenizer trained with the ``tokenizers`` library on that text (vocab 512), saved
  as ``tokenizer.json`` + ``tokenizer_config.json`` (loadable by ``transformers.AutoTokenizer`` /
  ``PreTrainedTokenizerFast``), with ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` specials.
- ``model/config.json``: a Llama-shaped config (2 layers, hidden 64) whose vocab matches the tokenizer.

Usage: ``python scripts/make_tiny_assets.py`` (from the repo root).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

#: The package's tiny tree (what ``oomdoctor.resources.tiny_dir()`` reads; written here in the checkout).
OUT = Path(__file__).resolve().parent.parent / "oomdoctor" / "data" / "tiny"
VOCAB = 512

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
ANIMALS = ["cat", "dog", "fox", "owl", "bear", "wolf", "hare", "crow"]
PLACES = ["the forest", "the river", "the garden", "the hill", "the market", "the old house"]
VERBS = ["sees", "follows", "feeds", "finds", "greets", "watches"]
COLORS = ["red", "blue", "green", "yellow", "white", "black"]
NUMS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
]


def text_sample(rng: random.Random) -> str:
    n = rng.choice(NAMES)
    a = rng.choice(ANIMALS)
    c = rng.choice(COLORS)
    p = rng.choice(PLACES)
    v = rng.choice(VERBS)
    k = rng.randint(1, 6)
    parts = [
        f"{n} {v} a {c} {a} near {p}.",
        f"the {a} is {c} and it lives near {p}.",
        f"{n} counts {' '.join(NUMS[1 : k + 1])}.",
        f"every morning {n} walks to {p} with the {a}.",
    ]
    rng.shuffle(parts)
    return " ".join(parts[: rng.randint(2, 4)])


def sft_sample(rng: random.Random) -> dict:
    x, y = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        return {
            "prompt": f"question: what is {NUMS[x]} plus {NUMS[y]}? answer:",
            "response": f" {NUMS[x]} plus {NUMS[y]} is {NUMS[x + y]}.",
        }
    a, c = rng.choice(ANIMALS), rng.choice(COLORS)
    return {"prompt": f"question: what color is the {c} {a}? answer:", "response": f" the {a} is {c}."}


def chat_sample(rng: random.Random) -> dict:
    turns = []
    if rng.random() < 0.3:
        turns.append({"role": "system", "content": "you answer in one short sentence."})
    for _ in range(rng.randint(1, 2)):
        q = sft_sample(rng)
        turns.append({"role": "user", "content": q["prompt"].removeprefix("question: ").removesuffix(" answer:")})
        turns.append({"role": "assistant", "content": q["response"].strip()})
    return {"messages": turns}


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    OUT.mkdir(parents=True, exist_ok=True)
    texts = [text_sample(rng) for _ in range(600)]
    sft = [sft_sample(rng) for _ in range(300)]
    with open(OUT / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    with open(OUT / "sft.jsonl", "w") as f:
        for r in sft:
            f.write(json.dumps(r) + "\n")

    chat_rng = random.Random(1)
    with open(OUT / "chat.jsonl", "w") as f:
        for _ in range(48):
            f.write(json.dumps(chat_sample(chat_rng)) + "\n")

    specials = ["<unk>", "<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = texts + [r["prompt"] + r["response"] for r in sft]
    tok.train_from_iterator(corpus, trainer=trainer)

    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=512,
    )
    tdir = OUT / "tokenizer"
    fast.save_pretrained(tdir)
    vocab = len(fast)

    mdir = OUT / "model"
    mdir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
        "use_cache": False,
    }
    (mdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {OUT}: {len(texts)} texts, {len(sft)} prompt/response pairs, vocab {vocab}")


if __name__ == "__main__":
    main()
