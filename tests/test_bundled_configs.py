"""Every bundled config against the real transformers model built on the meta device.

For each registry entry: the config loads through ``oomdoctor.model.load.load_spec(id)``; the analytic inventory
(``oomdoctor.model.architectures``) has EXACTLY the parameter count of the transformers model (unique parameters,
tied ones once), the same parameter count per module path (block index folded into ``{i}``), and the same
set of linear modules (nn.Linear and its subclasses, GPT-2's Conv1D) with their shapes and biases; and the
count is within 1% of the published figure recorded in ``configs/models/registry.json``.

Meta-device builds allocate nothing; the largest (Llama-3.1-405B) builds in about 0.1 s with transformers 5.x,
so every model is built in full (no per-layer extrapolation).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from oomdoctor.model.load import MODELS_DIR, bundled_ids, listing_of, load_spec, registry_entry
from oomdoctor.model.spec import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REGISTRY = json.loads((MODELS_DIR / "registry.json").read_text())["models"]


def build_meta(cfg: dict):
    """The transformers model oomdoctor prices for this config, built on the meta device (no memory)."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        if str((cfg.get("architectures") or [""])[0]).endswith("ForSequenceClassification"):
            return transformers.AutoModelForSequenceClassification.from_config(hf_cfg)
        if cfg["model_type"] == "bert":
            return transformers.BertForSequenceClassification(hf_cfg)
        if cfg["model_type"] == "t5":
            return transformers.T5ForConditionalGeneration(hf_cfg)
        if type(hf_cfg) in transformers.AutoModelForCausalLM._model_mapping:
            return transformers.AutoModelForCausalLM.from_config(hf_cfg)
        return transformers.AutoModelForImageTextToText.from_config(hf_cfg)  # vision-language: no causal-LM class


_FIRST_INDEX = re.compile(r"\.\d+(?=\.|$)")


def fold(path: str) -> str:
    """``model.layers.7.self_attn.q_proj`` -> ``model.layers.{i}.self_attn.q_proj`` (first index only, so T5's
    ``block.3.layer.0`` keeps its sub-layer index). Paths already holding ``{i}`` are left alone."""
    if "{i}" in path:
        return path
    return _FIRST_INDEX.sub(".{i}", path, count=1)


def hf_inventory(model) -> tuple[int, dict[str, int], set[tuple[str, str, int, int, bool]]]:
    """(unique parameter count, numel per folded module path, linear set) of a transformers model."""
    from transformers.pytorch_utils import Conv1D

    per_path: dict[str, int] = defaultdict(int)
    total = 0
    for name, p in model.named_parameters():  # remove_duplicate=True: tied tensors appear once, first name wins
        total += p.numel()
        owner = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        per_path[fold(owner)] += p.numel()
    emb_weight = model.get_input_embeddings().weight
    linears = set()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            if m.weight is emb_weight:  # a tied head holds no weight of its own
                continue
            linears.add((fold(name), name.rsplit(".", 1)[-1], m.in_features, m.out_features, m.bias is not None))
        elif isinstance(m, Conv1D):
            i, o = m.weight.shape  # Conv1D stores (in, out)
            linears.add((fold(name), name.rsplit(".", 1)[-1], i, o, m.bias is not None))
    return total, dict(per_path), linears


def spec_inventory(spec: ModelSpec) -> tuple[dict[str, int], set[tuple[str, str, int, int, bool]]]:
    per_path: dict[str, int] = defaultdict(int)
    for g in spec.groups:  # fold: T5's relative_attention_bias lives at block.0, HF names fold it like the rest
        per_path[fold(g.path)] += g.total_numel
    linears = {(fold(g.path), g.name, g.in_features, g.out_features, g.bias) for g in spec.linear_groups}
    return dict(per_path), linears


@pytest.fixture(scope="module")
def hf_cache():
    """Meta builds keyed by config file: aliases share one build."""
    return {}


@pytest.mark.parametrize("entry", REGISTRY, ids=[e["id"] for e in REGISTRY])
def test_bundled_config_matches_transformers(entry, hf_cache):
    spec = load_spec(entry["id"])
    assert spec.source == "bundled"
    assert spec.family == entry["family"]
    cfg = json.loads((MODELS_DIR / entry["file"]).read_text())
    if entry["file"] not in hf_cache:
        hf_cache[entry["file"]] = hf_inventory(build_meta(cfg))
    total, hf_paths, hf_linears = hf_cache[entry["file"]]

    ours_paths, ours_linears = spec_inventory(spec)
    assert spec.num_params == total, f"{entry['id']}: ours {spec.num_params:,} vs transformers {total:,}"
    assert ours_paths == hf_paths
    assert ours_linears == hf_linears
    # Every group's leaf name is the last component of its path (LoRA target_modules match on it).
    for g in spec.groups:
        assert g.path.rsplit(".", 1)[-1] == g.name, g


@pytest.mark.parametrize("entry", REGISTRY, ids=[e["id"] for e in REGISTRY])
def test_bundled_count_close_to_published(entry):
    spec = load_spec(entry["id"])
    published = entry["published_params"]
    assert spec.published_params == published
    assert abs(spec.num_params - published) <= 0.01 * published, (
        f"{entry['id']}: ours {spec.num_params:,} vs published {published:,}"
    )
    assert entry["note"].strip()


@pytest.mark.parametrize("entry", REGISTRY, ids=[e["id"] for e in REGISTRY])
def test_registry_listing_is_the_spec(entry):
    """``oomdoctor models`` prints the registry's precomputed listing: it must be what load_spec builds."""
    assert entry["listing"] == listing_of(load_spec(entry["id"])), (
        f"{entry['id']}: stale listing in registry.json; run python scripts/registry_listing.py"
    )


def test_registry_is_well_formed():
    ids = [e["id"] for e in REGISTRY]
    assert len(ids) == len(set(ids))
    names = [i.lower() for i in ids] + [a.lower() for e in REGISTRY for a in e.get("aliases", [])]
    assert len(names) == len(set(names)), "an alias collides with an id or another alias"
    for e in REGISTRY:
        assert e["file"] == e["id"].replace("/", "__") + ".json"
        assert (MODELS_DIR / e["file"]).is_file()
        assert isinstance(e["published_params"], int) and e["published_params"] > 0
        for a in e.get("aliases", []):
            assert registry_entry(a) is e or registry_entry(a)["id"] == e["id"]
    files = {p.name for p in MODELS_DIR.glob("*.json")} - {"registry.json"}
    assert files == {e["file"] for e in REGISTRY}, "a config file without a registry entry (or the reverse)"
    assert bundled_ids() == sorted(ids)


REQUIRED = [
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Llama-2-13b-hf",
    "meta-llama/Llama-2-70b-hf",
    "openlm-research/open_llama_3b",
    "openlm-research/open_llama_7b",
    "openlm-research/open_llama_13b",
    "tiiuae/falcon-7b",
    "tiiuae/falcon-40b",
    "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "mistralai/Mistral-7B-v0.1",
    "mistralai/Mixtral-8x7B-v0.1",
    "google/gemma-2b",
    "google/gemma-2-9b",
    "microsoft/phi-2",
    "microsoft/Phi-3-mini-4k-instruct",
    "Qwen/Qwen2-7B",
    "Qwen/Qwen2.5-7B",
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
    "openai-community/gpt2",
    "google-bert/bert-base-uncased",
    "google-t5/t5-small",
]


def test_required_models_are_bundled():
    missing = [m for m in REQUIRED if m not in bundled_ids()]
    assert not missing


@pytest.mark.parametrize(
    "model_id, kind, mlp, norm, parallel, experts, head",
    [
        ("meta-llama/Llama-2-7b-hf", "decoder", "gated", "rms", False, 0, "lm_head"),
        ("mistralai/Mixtral-8x7B-v0.1", "decoder", "gated", "rms", False, 8, "lm_head"),
        ("tiiuae/falcon-7b", "decoder", "plain", "layer", True, 0, "lm_head"),
        ("microsoft/phi-2", "decoder", "plain", "layer", True, 0, "lm_head"),
        ("microsoft/Phi-3-mini-4k-instruct", "decoder", "gated", "rms", False, 0, "lm_head"),
        ("openai-community/gpt2", "decoder", "plain", "layer", False, 0, "lm_head"),
        ("google-bert/bert-base-uncased", "encoder", "plain", "layer", False, 0, "classifier"),
        ("google-t5/t5-small", "encoder-decoder", "plain", "rms", False, 0, "lm_head"),
    ],
)
def test_structural_fields(model_id, kind, mlp, norm, parallel, experts, head):
    s = load_spec(model_id)
    assert (s.arch_kind, s.mlp_kind, s.norm_kind, s.parallel_attn, s.num_experts, s.head_name) == (
        kind,
        mlp,
        norm,
        parallel,
        experts,
        head,
    )


def test_structural_details():
    mix = load_spec("mistralai/Mixtral-8x7B-v0.1")
    assert mix.experts_per_token == 2
    assert not any(g.kind == "linear" for g in mix.groups if "experts" in g.path)  # fused 3D experts
    f7, f40 = load_spec("tiiuae/falcon-7b"), load_spec("tiiuae/falcon-40b")
    assert (f7.num_kv_heads, f40.num_kv_heads) == (1, 8)
    assert f7.tie_word_embeddings and f7.head_group is None
    assert not any(g.quantizable for g in f7.linear_groups)  # FalconLinear: skipped by bnb in transformers 5.x
    gpt2 = load_spec("gpt2")
    assert {g.module for g in gpt2.linear_groups} == {"Conv1D"} and all(g.quantizable for g in gpt2.linear_groups)
    bert = load_spec("bert-base-uncased")
    assert bert.num_labels == 2 and bert.encoder_layers == 12 and bert.head_group.name == "classifier"
    t5 = load_spec("t5-small")
    assert (t5.num_layers, t5.encoder_layers) == (12, 6)
    assert load_spec("meta-llama/Llama-3.2-1B").tie_word_embeddings
    assert load_spec("meta-llama/Llama-3.2-1B").head_group is None
    assert load_spec("Qwen/Qwen2.5-7B").group("q_proj").bias and not load_spec("Qwen/Qwen2.5-7B").group("o_proj").bias
    assert load_spec("Qwen/Qwen2.5-7B").sliding_window is None  # use_sliding_window is false
    assert load_spec("mistralai/Mistral-7B-v0.1").sliding_window == 4096
    phi3 = load_spec("microsoft/Phi-3-mini-4k-instruct")
    assert phi3.group("qkv_proj").out_features == 3 * 3072 and phi3.group("gate_up_proj").out_features == 2 * 8192


# ---------------------------------------------------------------------------------------------- config variants
# Branches of the builders that no bundled config takes, checked the same way on tiny configs.

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
}

VARIANTS = {
    "llama-biases-headdim": {
        **_TINY,
        "model_type": "llama",
        "attention_bias": True,
        "mlp_bias": True,
        "head_dim": 32,
        "num_key_value_heads": 2,
    },
    "llama-tied": {**_TINY, "model_type": "llama", "tie_word_embeddings": True},
    "mistral-headdim": {**_TINY, "model_type": "mistral", "head_dim": 8, "num_key_value_heads": 2},
    "qwen2-untied": {**_TINY, "model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": False},
    "qwen3": {**_TINY, "model_type": "qwen3", "head_dim": 16, "num_key_value_heads": 2},
    "olmo2": {**_TINY, "model_type": "olmo2", "num_key_value_heads": 2},
    "granite": {**_TINY, "model_type": "granite"},
    "gemma-untied": {
        **_TINY,
        "model_type": "gemma",
        "head_dim": 16,
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
    },
    "gemma2-default-tie": {**_TINY, "model_type": "gemma2", "head_dim": 16, "num_key_value_heads": 2},
    "mixtral-4x-top1": {
        **_TINY,
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "num_key_value_heads": 2,
    },
    "phi-qk-layernorm": {**_TINY, "model_type": "phi", "qk_layernorm": True},
    "phi-tied": {**_TINY, "model_type": "phi", "tie_word_embeddings": True},
    "phi3-gqa": {**_TINY, "model_type": "phi3", "num_key_value_heads": 2, "pad_token_id": 0, "eos_token_id": 1},
    "falcon-rw-sequential": {
        "model_type": "falcon",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "parallel_attn": False,
        "bias": True,
        "multi_query": False,
        "alibi": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "falcon-new-one-ln": {
        "model_type": "falcon",
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_kv_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 128,
        "new_decoder_architecture": True,
        "num_ln_in_parallel_attn": 1,
        "ffn_hidden_size": 96,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "gpt2-n-inner-untied": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 32,
        "n_inner": 96,
        "vocab_size": 128,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "bert-5-labels": {**_TINY, "model_type": "bert", "num_labels": 5, "max_position_embeddings": 40},
    "bert-id2label": {**_TINY, "model_type": "bert", "id2label": {"0": "a", "1": "b", "2": "c"}},
    # Decoders saved as sequence classifiers (reward models): lm_head -> score (hidden -> num_labels, no bias).
    "llama-seqcls-tied": {
        **_TINY,
        "model_type": "llama",
        "tie_word_embeddings": True,
        "num_labels": 1,
        "architectures": ["LlamaForSequenceClassification"],
    },
    "qwen2-seqcls": {
        **_TINY,
        "model_type": "qwen2",
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "architectures": ["Qwen2ForSequenceClassification"],
        "id2label": {"0": "bad", "1": "good"},
    },
    "gpt2-seqcls": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 32,
        "vocab_size": 128,
        "num_labels": 3,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "architectures": ["GPT2ForSequenceClassification"],
    },
    "phi-seqcls": {**_TINY, "model_type": "phi", "architectures": ["PhiForSequenceClassification"]},
    "t5-gated-untied-asym": {
        "model_type": "t5",
        "d_model": 64,
        "d_ff": 96,
        "d_kv": 8,
        "num_heads": 4,
        "num_layers": 2,
        "num_decoder_layers": 3,
        "vocab_size": 128,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_builder_variant_matches_transformers(name):
    from oomdoctor.model.load import spec_from_config

    cfg = VARIANTS[name]
    spec = spec_from_config(dict(cfg), name=name)
    total, hf_paths, hf_linears = hf_inventory(build_meta(dict(cfg)))
    ours_paths, ours_linears = spec_inventory(spec)
    assert spec.num_params == total
    assert ours_paths == hf_paths
    assert ours_linears == hf_linears
