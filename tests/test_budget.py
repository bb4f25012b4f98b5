"""The one memory budget (oomdoctor.plan.budget): capacity sources, margin forms, the fits rule, paged optimizer state
shown but not counted, and diagnose / tune / train --dry-run agreeing on "fits" for the same plan and capacity."""

from __future__ import annotations

import pytest

from oomdoctor.engines import estimate
from oomdoctor.errors import BadInput, DoesNotFit
from oomdoctor.gpu import GpuInfo
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.model.load import load_spec
from oomdoctor.plan import Plan
from oomdoctor.plan.budget import DEFAULT_MARGIN_BYTES, Budget, parse_margin, resolve_budget

GB = 10**9


def _gpu(free: int, total: int = 24 * GB, others: int = 0) -> GpuInfo:
    return GpuInfo(
        index=0,
        name="NVIDIA RTX A6000",
        total_bytes=total,
        free_bytes=free,
        used_bytes=total - free,
        used_by_others_bytes=others,
        other_processes=((4242, others),) if others else (),
    )


def _mem(peak_device: int, paged: int = 0, peak_allocated: int = 0) -> MemoryBreakdown:
    return MemoryBreakdown(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, paged_optimizer=paged, peak_allocated=peak_allocated, peak_device=peak_device
    )


# ------------------------------------------------------------------------------------------- sources


def test_sources_flag_config_nvml_free_and_none():
    b = resolve_budget(24 * GB, None, None)
    assert (b.capacity_bytes, b.source, b.notes) == (24 * GB, "--gpu-mem", ())
    b = resolve_budget(16 * GB, None, None, gpu_mem_source="config gpu_mem")
    assert b.source == "config gpu_mem"
    # NVML: the free memory (other processes' usage subtracted), never the total
    gpu = _gpu(free=20 * GB, total=48 * GB, others=27 * GB)
    b = resolve_budget(None, None, gpu)
    assert (b.capacity_bytes, b.source) == (20 * GB, "nvml free")
    assert "other process" in b.notes[0]
    # the flag wins over the GPU, with a note when it names more than is free
    b = resolve_budget(80 * GB, None, gpu)
    assert b.capacity_bytes == 80 * GB and b.source == "--gpu-mem" and "more than" in b.notes[0]
    assert resolve_budget(None, "10%", None) is None
    for bad in (0, -5, True):
        with pytest.raises(BadInput):
            resolve_budget(bad, None, None)


def test_train_run_budget_order(tmp_path):
    from oomdoctor.train.config import config_from_plan
    from oomdoctor.train.sizing import run_budget

    cfg = config_from_plan(
        "bundled:tiny/model/config.json",
        Plan(seq_len=64),
        init="random",
        tokenizer="bundled:tiny/tokenizer",
        dataset="bundled:tiny/train.jsonl",
        gpu_mem=3 * GB,
    )
    assert run_budget(cfg, 2 * GB, on_cpu=True).source == "--gpu-mem"
    b = run_budget(cfg, None, on_cpu=True)
    assert (b.capacity_bytes, b.source, b.counted) == (3 * GB, "config gpu_mem", "peak_allocated")
    assert run_budget(cfg, None, on_cpu=False).counted == "resident_device"


# ------------------------------------------------------------------------------------------- margins


@pytest.mark.parametrize(
    "text,nbytes,form",
    [
        (None, DEFAULT_MARGIN_BYTES, "default"),
        ("0.1", 2 * GB, "fraction"),
        (0.05, GB, "fraction"),
        ("10%", 2 * GB, "percent"),
        ("2.5%", GB // 2, "percent"),
        ("0", 0, "fraction"),
        ("2GB", 2 * GB, "size"),
        ("512MiB", 512 * 2**20, "size"),
    ],
)
def test_margin_forms_become_bytes(text, nbytes, form):
    assert parse_margin(text, 20 * GB) == (nbytes, form)
    b = resolve_budget(20 * GB, text, None)
    assert (b.margin_bytes, b.margin_form, b.limit_bytes) == (nbytes, form, 20 * GB - nbytes)
    assert b.to_dict()["margin_bytes"] == nbytes


@pytest.mark.parametrize("bad", ["95%", "-1", "abc%", "1.5", "lots", "19GB", True])
def test_bad_margins(bad):
    with pytest.raises(BadInput):
        parse_margin(bad, 20 * GB)


def test_default_margin_is_zero_bytes():
    """The breakdown already holds the allocator/fragmentation allowance: no flat extra margin by default."""
    assert DEFAULT_MARGIN_BYTES == 0
    assert resolve_budget(24 * GB, None, None).limit_bytes == 24 * GB


# ------------------------------------------------------------------------------------------- the rule


def test_fits_is_resident_peak_at_most_capacity_minus_margin():
    b = resolve_budget(10 * GB, "1GB", None)
    assert b.fits(_mem(9 * GB)) and b.headroom(_mem(9 * GB)) == 0
    assert not b.fits(_mem(9 * GB + 1)) and b.headroom(_mem(9 * GB + 1)) == -1
    # a CPU run's cap counts live tensor bytes, not the device peak
    cpu = resolve_budget(10 * GB, None, None, on_cpu=True)
    assert cpu.counted == "peak_allocated"
    assert cpu.fits(_mem(50 * GB, peak_allocated=10 * GB)) and not cpu.fits(_mem(0, peak_allocated=10 * GB + 1))


def test_paged_optimizer_state_is_shown_not_counted():
    m = _mem(10 * GB, paged=2 * GB)
    assert m.resident_device == 8 * GB
    d = m.to_dict()
    assert d["paged_optimizer_bytes"] == 2 * GB and d["resident_device_bytes"] == 8 * GB
    assert d["peak_device_bytes"] == 10 * GB
    assert Budget(8 * GB, "--gpu-mem").fits(m) and not Budget(8 * GB - 1, "--gpu-mem").fits(m)
    # on a real plan: the paged variant keeps its states visible, and only its resident part is counted
    spec = load_spec("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
    base = Plan(method="qlora", quant="nf4", lora_r=64, gradient_checkpointing=True, seq_len=256)
    paged = estimate(spec, base.with_(optimizer="paged-adamw-8bit"), "analytic")
    plain = estimate(spec, base.with_(optimizer="adamw-8bit"), "analytic")
    assert paged.paged_optimizer > 0
    assert paged.peak_device == plain.peak_device  # same bytes either way ...
    assert paged.resident_device == plain.resident_device - paged.paged_optimizer  # ... fewer of them resident


QLORA_PAPER = Plan(
    method="qlora",
    quant="nf4",
    double_quant=True,
    precision="bf16",
    optimizer="paged-adamw-8bit",
    gradient_checkpointing=True,
    lora_r=64,
    lora_targets=("all-linear",),
    micro_batch=1,
    seq_len=512,
)


def test_qlora_paper_65b_class_plan_fits_48gb():
    """QLoRA (Dettmers et al. 2023): a 65B model fine-tunes on one 48 GB GPU with nf4 + double quantization, paged
    AdamW 8-bit, gradient checkpointing, LoRA r=64 on every linear. Llama-2-70B (69B) stands in for LLaMA-65B.
    Analytic engine: peak_device 46.6 GB of which 1.6 GB paged optimizer state -> resident 45.0 GB: fits 48 GB.
    The old tune rule (peak_device <= 90 % of the card) said no."""
    spec = load_spec("meta-llama/Llama-2-70b-hf")
    mem = estimate(spec, QLORA_PAPER, "analytic")
    card = resolve_budget(48 * GB, None, None)
    assert card.fits(mem)
    assert mem.paged_optimizer > GB and mem.resident_device == mem.peak_device - mem.paged_optimizer
    assert mem.peak_device > 0.9 * 48 * GB  # what tune's former flat 10 % margin rejected
    assert not resolve_budget(48 * GB, "10%", None).fits(mem)


# ------------------------------------------------------------------------------------------- one verdict everywhere


def _verdicts(model: str, plan: Plan, capacity: int, tmp_path) -> tuple[bool, bool, bool]:
    from oomdoctor.diagnose.report import diagnose
    from oomdoctor.train.config import config_from_plan
    from oomdoctor.train.dryrun import dry_run
    from oomdoctor.tune.tuner import tune

    pins = {
        k: getattr(plan, k)
        for k in (
            "method",
            "precision",
            "optimizer",
            "attn",
            "gradient_checkpointing",
            "lora_r",
            "lora_targets",
            "quant",
            "double_quant",
            "micro_batch",
            "seq_len",
            "offload_optimizer",
            "offload_activations",
            "offload_params",
        )
    }
    rep = diagnose(model, pins, gpu_mem=capacity)
    assert len(rep.results) == 1 and rep.results[0].plan == plan
    try:
        t = tune(
            model,
            gpu_mem=capacity,
            seq_len=plan.seq_len,
            global_batch=plan.micro_batch,
            pins=pins,
            verify_mode="none",
            gpu=None,
        )
        tuned = t.plan == plan
    except DoesNotFit:
        tuned = False
    cfg = config_from_plan(model, plan, dataset="bundled:tiny/train.jsonl", global_batch_size=plan.micro_batch)
    d = dry_run(cfg, gpu_mem=capacity)
    assert d.plan == plan
    return rep.results[0].fits, tuned, d.fits


@pytest.mark.parametrize(
    "plan",
    [
        Plan(method="lora", precision="bf16-mixed", optimizer="adamw", gradient_checkpointing=True, seq_len=256),
        Plan(
            method="qlora",
            quant="nf4",
            precision="bf16-mixed",
            optimizer="paged-adamw-8bit",
            lora_r=64,
            gradient_checkpointing=True,
            seq_len=256,
        ),
    ],
    ids=["lora", "qlora-paged"],
)
def test_diagnose_tune_and_dry_run_agree_at_the_boundary(plan, tmp_path):
    model = "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"
    need = estimate(load_spec(model), plan, "analytic").resident_device
    assert _verdicts(model, plan, need, tmp_path) == (True, True, True)
    assert _verdicts(model, plan, need - 1, tmp_path) == (False, False, False)
