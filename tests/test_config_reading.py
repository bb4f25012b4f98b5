"""Every config.json read as transformers reads it: configs written by transformers 5.x (non-finite floats, per-layer
attributes), and one message — never transformers' own complaint or a traceback — for what it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan, validate

DATA = Path(__file__).parent / "data" / "configs"
PLAN = validate(Plan(method="lora", precision="bf16", seq_len=64))

#: transformers' own configs of the hybrids whose ``time_step_limit`` is (0, inf), at a CPU test size.
TINY_SSM = {
    "mamba2": dict(
        hidden_size=64,
        num_heads=8,
        head_dim=16,
        n_groups=1,
        state_size=16,
        chunk_size=64,
        expand=2,
        time_step_rank=8,
        num_hidden_layers=2,
        vocab_size=512,
    ),
    "falcon_h1": dict(
        hidden_size=64,
        intermediate_size=128,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=512,
    ),
    "nemotron_h": dict(
        hidden_size=64,
        intermediate_size=128,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=16,
        chunk_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        layers_block_type=["mamba", "attention", "moe"],
        vocab_size=512,
    ),
    "granitemoehybrid": dict(
        hidden_size=64,
        intermediate_size=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        layer_types=["mamba", "attention"],
        num_hidden_layers=2,
        vocab_size=512,
    ),
}


def written_by_transformers(tmp_path: Path, model_type: str, **kw) -> Path:
    """``config.json`` exactly as the installed transformers saves it (``PretrainedConfig.to_json_file``)."""
    from transformers import AutoConfig

    path = tmp_path / model_type / "config.json"
    path.parent.mkdir(parents=True)
    AutoConfig.for_model(model_type, **kw).to_json_file(str(path))
    return path


@pytest.mark.parametrize("model_type", TINY_SSM)
def test_a_config_saved_by_transformers_with_an_infinite_float_is_read(tmp_path, model_type):
    """transformers 5.x writes ``time_step_limit`` = (0, inf) as ``{"__float__": "Infinity"}`` and reads it back
    as a float; so does oomdoctor (a TypeError from transformers' validator before)."""
    path = written_by_transformers(tmp_path, model_type, **TINY_SSM[model_type])
    assert '"__float__": "Infinity"' in path.read_text()  # the premise: what transformers writes
    spec = load_spec(str(path))
    assert spec.config["time_step_limit"] == [0.0, float("inf")]
    assert spec.num_params > 0


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TINY_SSM)
def test_a_config_saved_by_transformers_with_an_infinite_float_is_priced(tmp_path, model_type):
    spec = load_spec(str(written_by_transformers(tmp_path, model_type, **TINY_SSM[model_type])))
    mem = estimate(spec, PLAN)  # its blocks replayed: the executor builds the model from the decoded config
    assert mem.peak_allocated > spec.num_params * 2  # bf16 weights and more
    assert any("measured by replaying" in n for n in mem.notes)


@pytest.mark.parametrize("fixture", ["mamba2-transformers-5.24.json", "mamba2-transformers-4.x.json"])
def test_the_fixtures_of_both_spellings_of_infinity_read_alike(fixture):
    """The file transformers 5.24 wrote (tagged floats) and the bare ``Infinity`` literal that transformers 4.x's
    ``json.dumps`` wrote are read alike."""
    spec = load_spec(str(DATA / fixture))
    assert spec.model_type == "mamba2" and spec.config["time_step_limit"][1] == float("inf")
    assert spec.num_params == load_spec(str(DATA / "mamba2-transformers-5.24.json")).num_params


def test_a_gemma4_config_with_per_layer_head_dims_is_read_and_its_blocks_measured(tmp_path):
    """Gemma 4's global-attention blocks have their own head_dim (``per_layer_config``): transformers refuses a
    global read of it. The inventory is the model transformers builds; the spec's head_dim is the widest block's;
    the blocks (and their kinds: the overrides) are measured."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from oomdoctor.engines.kinds import layer_kinds

    path = written_by_transformers(
        tmp_path,
        "gemma4_text",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_hidden_layers=3,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512,
        vocab_size=512,
        sliding_window=32,
        max_position_embeddings=512,
    )
    assert json.loads(path.read_text())["per_layer_config"] == {"2": {"head_dim": 32}}
    spec = load_spec(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path.parent)))
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.head_dim == 32 and spec.num_kv_heads == 2
    assert spec.group("q_proj").count == 2  # the two sliding blocks; the global block's q_proj is wider
    assert layer_kinds(spec, PLAN)[2] != layer_kinds(spec, PLAN)[1]
    mem = estimate(spec, PLAN)
    assert any("measured by replaying" in n for n in mem.notes)


def test_a_missing_optional_package_is_named_with_its_install_command(tmp_path):
    """Gemma-3n's vision tower is timm's: without timm transformers cannot build the model. The message names the
    package and the command, not "fix the config.json"."""
    pytest.importorskip("transformers.models.gemma3n")
    try:
        import timm  # noqa: F401 - whether it imports is the point
    except ImportError:
        pass
    else:
        pytest.skip("timm is installed here: the model builds")
    path = written_by_transformers(tmp_path, "gemma3n")
    with pytest.raises(BadInput) as e:
        load_spec(str(path))
    assert "optional package 'timm'" in e.value.message and "TimmWrapperModel" in e.value.message
    assert e.value.hint.startswith("pip install timm") and "fix the config" not in str(e.value)
    text = json.loads(path.read_text())["text_config"]  # the language model alone prices, as the hint says
    (tmp_path / "text.json").write_text(json.dumps(text))
    assert load_spec(str(tmp_path / "text.json")).model_type == "gemma3n_text"


@pytest.mark.parametrize(
    "cfg, says, hint",
    [
        (
            {"model_type": "no_such_kind_xyz"},
            "model kind 'no_such_kind_xyz' is not supported: model_type 'no_such_kind_xyz' is not a kind of model transformers",
            "pip install -U transformers",
        ),
        ({"model_type": "vit"}, "model kind 'vit' is not supported: oomdoctor prices causal LMs", "oomdoctor models"),
        (
            {"model_type": "mamba2", "num_heads": "eight"},
            "this 'mamba2' config is not supported: transformers",
            "fix num_heads in config.json",
        ),
    ],
)
def test_what_transformers_refuses_is_one_message_naming_the_kind(tmp_path, cfg, says, hint):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(BadInput) as e:
        load_spec(str(path))
    assert says in e.value.message and hint in e.value.hint
    assert "Should contain one of" not in str(e.value)  # not transformers' list of every model type


def test_the_cli_prints_the_refusal_without_a_traceback(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no_such_kind_xyz"}))
    p = subprocess.run(
        [sys.executable, "-m", "oomdoctor", "diagnose", str(path), "--method", "lora"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "is not supported" in p.stderr and "Traceback" not in p.stderr, p.stderr
