"""`oomdoctor diagnose` end to end through the CLI: JSON contract, verdicts, advice, error paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oomdoctor.cli import main


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def run_ok(args, capsys):
    try:
        main(args)
        code = 0
    except SystemExit as e:  # typer exits 0 via SystemExit in standalone mode
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


MEMORY_KEYS = {
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "peak_device_bytes",
    "parameters_bytes",
    "gradients_bytes",
    "optimizer_states_bytes",
    "activations_bytes",
    "logits_bytes",
}


def test_json_contract_full_matrix(capsys):
    code, out, _ = run_ok(["diagnose", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB", "--json"], capsys)
    assert code in (0, None)
    data = json.loads(out)
    assert data["capacity_bytes"] == 24 * 10**9
    plans = data["plans"]
    assert len(plans) > 20
    for p in plans:
        assert set(p) >= {"settings", "fits", "memory"}
        assert p["fits"] in (True, False)
        assert MEMORY_KEYS <= set(p["memory"])
        m = p["memory"]
        assert m["peak_allocated_bytes"] <= m["peak_reserved_bytes"] <= m["peak_device_bytes"]
        assert all(isinstance(v, int) for k, v in m.items() if k.endswith("_bytes"))
        assert p["fits"] == (m["resident_device_bytes"] <= 24 * 10**9)
    # A 7B model: full fp32 AdamW never fits 24 GB, QLoRA with GC does.
    full = next(p for p in plans if p["settings"]["method"] == "full" and p["settings"]["precision"] == "fp32")
    assert full["fits"] is False and full["advice"]["changes"]
    assert any(p["fits"] for p in plans if p["settings"]["method"] == "qlora")


def test_all_pinned_gives_exactly_one_plan(capsys):
    args = [
        "diagnose",
        "meta-llama/Llama-2-7b-hf",
        "--method",
        "lora",
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "adamw",
        "--attn",
        "sdpa",
        "--gradient-checkpointing",
        "--lora-r",
        "8",
        "--lora-targets",
        "q_proj,v_proj",
        "--micro-batch",
        "2",
        "--seq-len",
        "512",
        "--json",
    ]
    code, out, _ = run_ok(args, capsys)
    data = json.loads(out)
    assert len(data["plans"]) == 1
    s = data["plans"][0]["settings"]
    assert s["lora_r"] == 8 and s["lora_targets"] == ["q_proj", "v_proj"] and s["micro_batch_size"] == 2
    assert data["plans"][0]["fits"] is None  # no --gpu-mem, no GPU -> no verdict


def test_non_fitting_plan_gets_changes_that_fit_with_bytes(capsys):
    args = [
        "diagnose",
        "meta-llama/Llama-2-7b-hf",
        "--method",
        "lora",
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "adamw",
        "--no-gradient-checkpointing",
        "--micro-batch",
        "8",
        "--seq-len",
        "2048",
        "--gpu-mem",
        "24GB",
        "--json",
    ]
    code, out, _ = run_ok(args, capsys)
    (plan,) = json.loads(out)["plans"]
    assert plan["fits"] is False
    changes = plan["advice"]["changes"]
    assert changes and all(c["saves_bytes"] > 0 for c in changes)
    fitting = [c for c in changes if c["fits"]] or plan["advice"]["path"]
    assert fitting, "some change or combination must make a 7B LoRA plan fit 24 GB"


def test_nothing_fits_suggests_smaller_model_of_same_family(capsys):
    code, out, _ = run_ok(["diagnose", "meta-llama/Llama-2-70b-hf", "--gpu-mem", "16GB", "--json"], capsys)
    data = json.loads(out)
    assert not any(p["fits"] for p in data["plans"])
    sm = data["smaller_model"]
    assert sm is not None and sm["model"].startswith("meta-llama/Llama-2-") and sm["params"] < 70e9
    assert sm["memory"]["peak_device_bytes"] <= 16 * 10**9


def test_table_output_and_local_config(capsys, tiny_config_path):
    code, out, _ = run_ok(["diagnose", tiny_config_path, "--gpu-mem", "1GiB"], capsys)
    assert "plan" in out and "fits" in out and "qlora" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["diagnose", "meta-llama/Llama-9-7b"], "unknown model"),
        (["diagnose", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24 parsecs"], "--gpu-mem"),
        (["diagnose", "meta-llama/Llama-2-7b-hf", "--method", "full", "--quant", "nf4"], "--method full"),
        (["diagnose", "meta-llama/Llama-2-7b-hf", "--optimizer", "adam"], "optimizer"),
        (["diagnose", "meta-llama/Llama-2-7b-hf", "--micro-batch", "0"], "micro_batch"),
        (["diagnose", "meta-llama/Llama-2-7b-hf", "--engine", "guess"], "engine"),
    ],
)
def test_bad_input_exits_2_with_one_clear_message(args, needle, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_malformed_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    code, _, err = run_cli(["diagnose", str(bad)], capsys)
    assert code == 2 and "not valid JSON" in err


def test_help_imports_no_torch():
    """``--help`` stays instant because nothing heavy loads at start-up (its time: benchmarks/latency.py)."""
    code = (
        "import sys; from oomdoctor.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit: pass\n"
        "assert 'torch' not in sys.modules, 'torch imported at start-up'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_analytic_diagnose_imports_no_torch():
    code = (
        "import sys\nfrom oomdoctor.diagnose.report import diagnose\n"
        "diagnose('meta-llama/Llama-2-7b-hf', gpu_mem=24*10**9)\n"
        "assert 'torch' not in sys.modules, 'torch imported by the analytic path'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_fits_only_and_top(capsys):
    code, out, _ = run_ok(
        ["diagnose", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB", "--fits-only", "--top", "3", "--json"], capsys
    )
    d = json.loads(out)
    assert len(d["plans"]) == 3 and all(p["fits"] for p in d["plans"])
    assert d["plans_priced"] > d["plans_fitting"] >= 3


def test_smaller_model_never_contradicts_the_advice():
    """A smaller model is suggested only when no change in the advice makes a plan fit."""
    from oomdoctor.diagnose.report import diagnose

    for cap in (6 * 10**9, 10**9):
        rep = diagnose("meta-llama/Llama-2-7b-hf", {"seq_len": 512}, gpu_mem=cap)
        rescued = any(r.advice and (r.advice.path_fits or any(c.fits for c in r.advice.single)) for r in rep.results)
        assert not (rescued and rep.smaller_model)


def test_gpus_span_the_strategies_per_rank(capsys):
    """--gpus 8 without --strategy prices each stack under ddp, fsdp, zero2 and zero3, per GPU (issue 13)."""
    args = [
        "diagnose",
        "meta-llama/Llama-2-7b-hf",
        "--gpus",
        "8",
        "--method",
        "full",
        "--precision",
        "bf16-mixed",
        "--gradient-checkpointing",
        "--gpu-mem",
        "24GB",
        "--json",
    ]
    code, out, _ = run_ok(args, capsys)
    assert code in (0, None)
    plans = [p for p in json.loads(out)["plans"] if p["settings"]["optimizer"] == "adamw"]
    by = {(p["settings"]["strategy"], p["settings"]["offload_optimizer"]): p for p in plans}
    assert set(by) == {
        ("ddp", False),
        ("fsdp", False),
        ("zero2", False),
        ("zero2", True),
        ("zero3", False),
        ("zero3", True),
    }
    assert all(p["settings"]["world_size"] == 8 for p in plans)
    assert by[("ddp", False)]["fits"] is False and by[("fsdp", False)]["fits"] is True
    assert by[("fsdp", False)]["memory"]["comm_buffers_bytes"] > 0
    assert by[("fsdp", False)]["memory"]["nccl_buffers_bytes"] > 0
    assert by[("zero3", True)]["memory"]["host_per_node_bytes"] > 100 * 2**30  # DeepSpeed: 150.65 GiB per CPU
    assert by[("fsdp", False)]["memory"]["host_per_node_bytes"] == 0
    ddp_advice = by[("ddp", False)]["advice"]
    assert any(c["id"] == "strategy:fsdp" and c["fits"] for c in ddp_advice["changes"])


def test_topology_flags_pin_and_render(capsys):
    args = [
        "diagnose",
        "meta-llama/Llama-2-7b-hf",
        "--gpus",
        "8",
        "--strategy",
        "fsdp",
        "--shard-group",
        "4",
        "--no-reshard-after-forward",
        "--method",
        "full",
        "--precision",
        "bf16-mixed",
        "--optimizer",
        "adamw",
        "--gradient-checkpointing",
        "--gpu-mem",
        "80GB",
    ]
    code, out, _ = run_ok(args, capsys)
    assert code in (0, None)
    assert "per GPU of 8" in out and "hsdp 2x4" in out and "keep-gathered" in out
    assert "NCCL buffers" in out
    code, _, err = run_cli(
        [
            "diagnose",
            "meta-llama/Llama-2-7b-hf",
            "--gpus",
            "8",
            "--strategy",
            "ddp",
            "--bucket-size",
            "0",
            "--method",
            "full",
        ],
        capsys,
    )
    assert code != 0 and "bucket_size" in err and "Traceback" not in err


def test_fits_only_when_nothing_fits_says_so_without_a_table(capsys):
    from oomdoctor.cli import main

    try:
        main(["diagnose", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "8GB", "--method", "full", "--fits-only"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = capsys.readouterr().out
    assert "plans fits; run without --fits-only" in out and "Traceback" not in out


def test_a_70b_qlora_on_48gb_is_advised_to_skip_the_k_bit_upcast(capsys):
    """Llama-3.3-70B QLoRA in pure bf16 at 2,048 tokens misses 48 GB by a few hundred MB: peft's k-bit upcast (fp32
    embeddings, norms and head, an fp32 residual stream) is what does not fit, and the advice says how to skip it;
    pinned off, the same plan fits (one QLoRA row per stack: the table shows the upcast only when pinned)."""
    args = [
        "diagnose",
        "meta-llama/Llama-3.3-70B-Instruct",
        "--method",
        "qlora",
        "--quant",
        "nf4",
        "--double-quant",
        "--precision",
        "bf16",
        "--optimizer",
        "adamw",
        "--gradient-checkpointing",
        "--loss",
        "chunked",
        "--seq-len",
        "2048",
        "--gpu-mem",
        "48GB",
        "--json",
    ]
    code, out, _ = run_ok(args, capsys)
    (plan,) = json.loads(out)["plans"]
    assert plan["fits"] is False and plan["settings"]["kbit_upcast"] is True
    skip = next(c for c in plan["advice"]["changes"] if c["id"] == "kbit-upcast:off")
    assert skip["fits"] and skip["flags"] == "--no-kbit-upcast" and skip["yaml"] == "kbit_upcast: false"
    assert skip["saves_bytes"] > 4 * 10**9  # 2.1 B unquantized weights at 2 bytes less, and half the activations
    code, out, _ = run_ok(args + ["--no-kbit-upcast"], capsys)
    (off,) = json.loads(out)["plans"]
    assert off["fits"] is True and off["settings"]["kbit_upcast"] is False
