"""oomdoctor.explain.core: every OOM wording in tests/data/oom parses to the numbers written in it, the phase its traceback
shows and the cause its numbers point to. The expected sizes below are copied from the message texts."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomdoctor.errors import BadInput
from oomdoctor.explain.core import CAUSE_IDS, PHASES, _logits_match, detect_phase, diagnose, explain, parse_oom
from oomdoctor.units import parse_size

DATA = Path(__file__).parent / "data" / "oom"
S = parse_size
GiB = 2**30

# file: (kind, format, device, requested, total, free, allocated, reserved_unallocated, other, phase, top cause)
# None = the message does not say (or says something impossible).
CASES = {
    "v22-forward-llama-trainer": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "172.00 MiB",
        "23.64 GiB",
        "95.81 MiB",
        "22.87 GiB",
        "211.16 MiB",
        0,
        "forward",
        "fragmentation",
    ),
    "v22-fragmentation-backward": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "1.25 GiB",
        "39.38 GiB",
        "731.38 MiB",
        "33.14 GiB",
        "5.02 GiB",
        0,
        "backward",
        "fragmentation",
    ),
    "v22-other-processes": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "512.00 MiB",
        "23.68 GiB",
        "301.56 MiB",
        "11.41 GiB",
        "276.46 MiB",
        S("9.86 GiB") + S("1.37 GiB"),
        "forward",
        "other-processes",
    ),
    "v29-ranks-private-pools-optimizer": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "2.03 GiB",
        "79.19 GiB",
        "1.58 GiB",
        "74.12 GiB",
        "2.84 GiB",
        0,
        "optimizer-step",
        "fragmentation",
    ),
    "v21-capacty-eval-logits": (
        "cuda-allocator",
        "torch-2.1",
        "cuda:0",
        "7.83 GiB",
        "39.39 GiB",
        "5.61 GiB",
        "30.28 GiB",
        "2.98 GiB",
        0,
        "evaluation",
        "huge-allocation",
    ),
    "v20-old-format-loss": (
        "cuda-allocator",
        "torch<=2.0",
        "cuda:0",
        "3.91 GiB",
        "79.15 GiB",
        "2.31 GiB",
        "72.38 GiB",
        S("76.10 GiB") - S("72.38 GiB"),
        None,
        "loss",
        "capacity",
    ),
    "v113-allowed-backward": (
        "cuda-allocator",
        "torch<=2.0",
        "cuda:0",
        "768.00 MiB",
        "23.69 GiB",
        "10.71 GiB",
        "10.94 GiB",
        S("11.50 GiB") - S("10.94 GiB"),
        None,
        "backward",
        "capacity",
    ),
    "v14-cached-forward": (
        "cuda-allocator",
        "torch<1.5",
        "cuda:0",
        "96.00 MiB",
        "10.92 GiB",
        "85.38 MiB",
        "9.87 GiB",
        S("10.16 GiB") - S("9.87 GiB"),
        None,
        "forward",
        "fragmentation",
    ),
    "wsl-absurd-process-values": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "250.00 MiB",
        "8.00 GiB",
        0,
        "6.91 GiB",
        "183.27 MiB",
        None,
        "backward",
        "capacity",
    ),
    "zero-free-checkpoint-merge": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "2.00 MiB",
        "15.70 GiB",
        0,
        "15.31 GiB",
        "64.52 MiB",
        0,
        "checkpoint-save",
        "fragmentation",
    ),
    "fsdp-clone-warning-save": (
        "fsdp-clone-warning",
        "torch<=2.0",
        "cuda:0",
        "172.00 MiB",
        "79.15 GiB",
        "49.25 MiB",
        "76.02 GiB",
        S("77.94 GiB") - S("76.02 GiB"),
        None,
        "checkpoint-save",
        "fragmentation",
    ),
    "cuda-error-context": (
        "cuda-error",
        "cuda-runtime",
        "cuda",
        None,
        None,
        None,
        None,
        None,
        None,
        "model-load",
        "other-processes",
    ),
    "cublas-alloc-failed-forward": (
        "cuda-error",
        "cuda-runtime",
        "cuda",
        None,
        None,
        None,
        None,
        None,
        None,
        "forward",
        "other-processes",
    ),
    "cpu-allocator-not-enough": (
        "cpu-allocator",
        "torch-cpu",
        "cpu",
        655360000,
        None,
        None,
        None,
        None,
        None,
        "model-load",
        "capacity",
    ),
    "cpu-allocator-cant-allocate-optimizer": (
        "cpu-allocator",
        "torch-cpu",
        "cpu",
        536870912,
        None,
        None,
        None,
        None,
        None,
        "optimizer-step",
        "capacity",
    ),
    "bnb-dispatched-cpu-disk": (
        "quantized-offload",
        "transformers/accelerate",
        "cuda",
        None,
        None,
        None,
        None,
        None,
        None,
        "model-load",
        "capacity",
    ),
    "accelerate-8bit-offload-train": (
        "quantized-offload",
        "transformers/accelerate",
        "cuda",
        None,
        None,
        None,
        None,
        None,
        None,
        "model-load",
        "capacity",
    ),
    "hip-rocm-backward": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:3",
        "14.68 GiB",
        "191.98 GiB",
        "9.21 GiB",
        "176.33 GiB",
        "5.87 GiB",
        None,
        "backward",
        "capacity",
    ),
    "mps-backend": (
        "mps-allocator",
        "torch-mps",
        "mps",
        594 * 2**20,
        S("18.13 GiB"),
        None,
        S("16.97 GiB"),
        None,
        None,
        "forward",
        "capacity",
    ),
    "packing-bug-huge-request": (
        "cuda-allocator",
        "torch-2.1",
        "cuda:0",
        "341.58 GiB",
        "79.15 GiB",
        "62.04 GiB",
        "15.53 GiB",
        "916.95 MiB",
        0,
        "forward",
        "huge-allocation",
    ),
    "container-own-pid-hidden": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "2.32 GiB",
        "21.98 GiB",
        "1.07 GiB",
        "19.84 GiB",
        "579.21 MiB",
        0,
        "loss",
        "huge-allocation",
    ),
    "wrapped-lightning-validation": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "3.12 GiB",
        "11.72 GiB",
        "1.12 GiB",
        "7.94 GiB",
        "2.41 GiB",
        0,
        "evaluation",
        "huge-allocation",
    ),
    "gc-recompute-backward": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "344.00 MiB",
        "44.53 GiB",
        "187.25 MiB",
        "43.41 GiB",
        "431.77 MiB",
        0,
        "backward",
        "fragmentation",
    ),
    "jupyter-colab-backward": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "1.02 GiB",
        "14.75 GiB",
        "469.06 MiB",
        "12.91 GiB",
        "1.24 GiB",
        0,
        "backward",
        "fragmentation",
    ),
    "xpu-intel-forward": (
        "cuda-allocator",
        "torch-xpu",
        "xpu:0",
        "136.00 MiB",
        "15.11 GiB",
        None,
        "14.62 GiB",
        "171.35 MiB",
        None,
        "forward",
        "fragmentation",
    ),
    "accelerate-batch-size-exhausted": (
        "batch-size-exhausted",
        "accelerate",
        "cuda",
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        "capacity",
    ),
    "linux-oom-killer-offload": (
        "cpu-oom-killer",
        "linux-oom-killer",
        "cpu",
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        "capacity",
    ),
    "deepspeed-save-checkpoint": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "1002.00 MiB",
        "23.55 GiB",
        "817.94 MiB",
        "21.47 GiB",
        "827.63 MiB",
        0,
        "checkpoint-save",
        "capacity",
    ),
    # Issue 28's misreadings, one sample each (every row fails on the code before the fix): a lone process line is
    # this process; one large allocation is its own cause; load/save/eval phases; formats read as no OOM at all.
    "v23-lone-process-is-self": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:1",
        "384.00 MiB",
        "23.68 GiB",
        "361.69 MiB",
        "20.31 GiB",
        "92.17 MiB",
        0,
        "backward",
        "capacity",
    ),
    "wsl-process-listed-twice": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "224.00 MiB",
        "8.00 GiB",
        0,
        "6.62 GiB",
        "102.42 MiB",
        0,
        "forward",
        "capacity",
    ),
    "v26-full-vocab-logits-loss": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "15.66 GiB",
        "79.19 GiB",
        "4.17 GiB",
        "73.40 GiB",
        "634.88 MiB",
        0,
        "loss",
        "huge-allocation",
    ),
    "v24-eval-gathered-logits": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "9.28 GiB",
        "39.39 GiB",
        "3.74 GiB",
        "34.73 GiB",
        "378.92 MiB",
        0,
        "evaluation",
        "huge-allocation",
    ),
    "trl-sft-eval-full-logits": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "4.64 GiB",
        "23.64 GiB",
        "1.10 GiB",
        "21.72 GiB",
        "358.40 MiB",
        0,
        "evaluation",
        "huge-allocation",
    ),
    "cudnn-not-supported-after-oom": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "2.44 GiB",
        "15.77 GiB",
        "870.38 MiB",
        "14.20 GiB",
        "285.61 MiB",
        0,
        "forward",
        "huge-allocation",
    ),
    "v25-load-allocator-warmup": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "13.54 GiB",
        "14.74 GiB",
        "11.97 GiB",
        "2.35 GiB",
        "20.44 MiB",
        0,
        "model-load",
        "huge-allocation",
    ),
    "v24-load-trainer-moves-fp32-model": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "224.00 MiB",
        "23.64 GiB",
        "215.81 MiB",
        "23.02 GiB",
        "1.95 MiB",
        0,
        "model-load",
        "capacity",
    ),
    "mps-load-to-device": (
        "mps-allocator",
        "torch-mps",
        "mps",
        1002 * 2**20,
        S("18.13 GiB"),
        None,
        S("17.44 GiB"),
        None,
        None,
        "model-load",
        "capacity",
    ),
    "mps-invalid-buffer-size-logits": (
        "mps-allocator",
        "torch-mps-buffer",
        "mps",
        S("15.62 GiB"),
        None,
        None,
        None,
        None,
        None,
        "loss",
        "huge-allocation",
    ),
    "fsdp2-full-state-dict-gather": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "1.96 GiB",
        "79.19 GiB",
        "937.69 MiB",
        "77.10 GiB",
        "621.40 MiB",
        0,
        "checkpoint-save",
        "capacity",
    ),
    "lightning-validation-epoch-end-cat": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "5.86 GiB",
        "23.64 GiB",
        "5.78 GiB",
        "17.20 GiB",
        "215.04 MiB",
        0,
        "evaluation",
        "huge-allocation",
    ),
    "v24-memory-fraction-cap": (
        "cuda-allocator",
        "torch>=2.2",
        "cuda:0",
        "1.00 GiB",
        "79.19 GiB",
        "39.20 GiB",
        "38.90 GiB",
        "410.00 MiB",
        0,
        "backward",
        "capacity",
    ),
    "cudnn-not-supported-whisper": (
        "cuda-error",
        "cudnn",
        "cuda",
        None,
        None,
        None,
        None,
        None,
        None,
        "forward",
        "capacity",
    ),
    "oom-killer-cgroup-journal": (
        "cpu-oom-killer",
        "linux-oom-killer-cgroup",
        "cpu",
        None,
        67108864 * 1024,
        None,
        None,
        None,
        None,
        None,
        "capacity",
    ),
}


def _b(v):
    return S(v) if isinstance(v, str) else v


def test_data_set_covers_every_format_cause_and_phase():
    files = {p.stem for p in DATA.glob("*.txt") if not p.stem.startswith("no-oom")}
    assert files == set(CASES), "every OOM file has expectations and vice versa"
    assert len(files) >= 15
    kinds = {c[0] for c in CASES.values()}
    assert kinds == {
        "cuda-allocator",
        "fsdp-clone-warning",
        "cuda-error",
        "cpu-allocator",
        "mps-allocator",
        "quantized-offload",
        "batch-size-exhausted",
        "cpu-oom-killer",
    }
    formats = {c[1] for c in CASES.values()}
    assert {"torch>=2.2", "torch-2.1", "torch<=2.0", "torch<1.5"} <= formats
    assert {c[9] for c in CASES.values()} >= set(PHASES)
    assert {c[10] for c in CASES.values()} == set(CAUSE_IDS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_numbers_phase_and_top_cause(name):
    kind, fmt, dev, req, total, free, alloc, unalloc, other, phase, top = CASES[name]
    d = explain((DATA / f"{name}.txt").read_text())
    r = d.report
    assert (r.kind, r.format, r.device) == (kind, fmt, dev)
    assert r.requested_bytes == _b(req)
    assert r.total_bytes == _b(total)
    assert r.free_bytes == _b(free)
    assert r.allocated_bytes == _b(alloc)
    assert r.reserved_unallocated_bytes == _b(unalloc)
    assert r.other_processes_bytes == _b(other)
    assert r.phase == phase
    assert d.causes[0].id == top, [(c.id, c.score) for c in d.causes]
    # Every cause carries evidence and at least one concrete fix; ids are from the published set.
    assert {c.id for c in d.causes} <= set(CAUSE_IDS)
    assert any(c.id == "capacity" for c in d.causes)
    for c in d.causes:
        assert c.evidence and c.fixes
        assert all(f.how for f in c.fixes)
    scores = [c.score for c in d.causes]
    assert scores == sorted(scores, reverse=True)


def test_json_keys_and_nulls():
    d = explain((DATA / "v20-old-format-loss.txt").read_text()).to_dict()
    for key in (
        "requested_bytes",
        "total_bytes",
        "free_bytes",
        "allocated_bytes",
        "reserved_unallocated_bytes",
        "other_processes_bytes",
        "phase",
        "causes",
    ):
        assert key in d
    assert d["other_processes_bytes"] is None  # torch <= 2.0 does not list processes
    assert d["phase"] == "loss"
    assert set(d["causes"][0]) >= {"id", "evidence", "fixes"}
    assert isinstance(d["causes"][0]["evidence"][0], str)
    assert set(d["causes"][0]["fixes"][0]) >= {"id", "text", "how"}


def test_ranks_and_occurrences():
    r = parse_oom((DATA / "v29-ranks-private-pools-optimizer.txt").read_text())
    assert r.ranks == (0, 1)
    assert r.occurrences == 2
    assert r.private_pool_bytes == S("2.00 GiB")
    assert r.alloc_conf_var == "PYTORCH_ALLOC_CONF"  # newer torch prints the new name: suggest that one
    frag = [
        c
        for c in explain((DATA / "v29-ranks-private-pools-optimizer.txt").read_text()).causes
        if c.id == "fragmentation"
    ][0]
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in frag.fixes[0].how or any(
        "export PYTORCH_ALLOC_CONF=expandable_segments:True" in f.how for f in frag.fixes
    )


def test_wsl_values_are_unknown_not_numbers():
    r = parse_oom((DATA / "wsl-absurd-process-values.txt").read_text())
    assert r.other_processes_bytes is None
    assert r.this_process_bytes is None
    assert all(p.bytes is None for p in r.processes)
    assert any("17179869184.00 GiB" in n for n in r.notes)
    assert r.free_bytes == 0  # "0 bytes is free" is real and kept


def test_zero_bytes_process_entry_is_unknown():
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "6.00 GiB of which 0 bytes is free. Process 812 has 0 bytes memory in use. Of the allocated memory 5.21 GiB "
        "is allocated by PyTorch, and 31.72 MiB is reserved by PyTorch but unallocated."
    )
    r = parse_oom(text)
    # The lone entry is this process (its usage unknown): no other process is listed.
    assert [p.is_self for p in r.processes] == [True]
    assert r.this_process_bytes is None
    assert r.other_processes_bytes == 0
    assert any("0 bytes" in n and "other processes' share is unknown" not in n for n in r.notes)
    assert r.requested_bytes == 20 * 2**20


def test_container_self_process_detected():
    r = parse_oom((DATA / "container-own-pid-hidden.txt").read_text())
    assert [p.is_self for p in r.processes] == [True]
    assert r.this_process_bytes == S("20.90 GiB")
    assert r.other_processes_bytes == 0
    assert any("container" in n for n in r.notes)


def test_fsdp_warning_is_checkpoint_save_and_names_tensor():
    r = parse_oom((DATA / "fsdp-clone-warning-save.txt").read_text())
    assert r.kind == "fsdp-clone-warning"
    assert r.tensor_name == "_fsdp_wrapped_module.model.layers.31.mlp.down_proj.weight"
    assert r.ranks == (0, 1)
    d = explain((DATA / "fsdp-clone-warning-save.txt").read_text())
    cap = [c for c in d.causes if c.id == "capacity"][0]
    assert cap.fixes[0].id == "fsdp-state-dict-offload"
    assert "offload_to_cpu=True" in cap.fixes[0].how


def test_fragmentation_fix_names_env_var_and_old_torch_gets_max_split():
    d = explain((DATA / "v22-fragmentation-backward.txt").read_text())
    frag = d.causes[0]
    assert frag.id == "fragmentation" and frag.score >= 0.9
    assert frag.fixes[0].how == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert any("5.02 GiB" in e and "1.25 GiB" in e for e in frag.evidence)
    old = explain((DATA / "v14-cached-forward.txt").read_text())
    ofrag = [c for c in old.causes if c.id == "fragmentation"][0]
    assert ofrag.fixes[0].how == "export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128"
    hip = parse_oom((DATA / "hip-rocm-backward.txt").read_text())
    assert hip.alloc_conf_var == "PYTORCH_HIP_ALLOC_CONF"


def test_other_processes_fix_lists_pids():
    d = explain((DATA / "v22-other-processes.txt").read_text())
    top = d.causes[0]
    assert top.id == "other-processes"
    assert "kill 41873 42210" in top.fixes[0].how


def test_eval_phase_puts_eval_fixes_first():
    d = explain((DATA / "v21-capacty-eval-logits.txt").read_text())
    huge = d.causes[0]
    assert huge.id == "huge-allocation"
    assert huge.fixes[0].id == "eval-batch-size"
    assert "per_device_eval_batch_size" in huge.fixes[0].how
    assert any("preprocess_logits_for_metrics" in f.how for f in huge.fixes)
    # 7.83 GiB = 16384 tokens x 128256 x 4 bytes: the fp32 logits of an eval batch of 8 x 2048 with Llama-3's vocab
    assert any("16384" in e and "128256" in e for e in huge.evidence)


def test_optimizer_phase_puts_optimizer_fixes_first():
    d = explain((DATA / "v29-ranks-private-pools-optimizer.txt").read_text())
    cap = [c for c in d.causes if c.id == "capacity"][0]
    assert cap.fixes[0].id == "optimizer:paged-adamw-8bit"


def test_packing_bug_request_larger_than_card():
    d = explain((DATA / "packing-bug-huge-request.txt").read_text())
    assert d.causes[0].id == "huge-allocation" and d.causes[0].score >= 0.9
    assert "more than the whole card" in d.causes[0].evidence[0]
    assert "attn_weights" in d.report.failing_frame


def test_memory_fraction_cap_is_recognised():
    d = explain((DATA / "v113-allowed-backward.txt").read_text())
    assert d.report.allowed_bytes == S("11.85 GiB")
    assert d.causes[0].id == "capacity" and d.causes[0].fixes[0].id == "memory-fraction"


def test_no_oom_is_bad_input():
    with pytest.raises(BadInput, match="no out-of-memory error found"):
        explain((DATA / "no-oom-keyerror.txt").read_text())
    with pytest.raises(BadInput):
        explain("")


@pytest.mark.parametrize(
    "code, func, path, phase",
    [
        ("loss.backward()", "<module>", "/x/train.py", "backward"),
        ("self.accelerator.backward(loss, **kwargs)", "training_step", "/t/transformers/trainer.py", "backward"),
        ("optimizer.step()", "train", "/x/train.py", "optimizer-step"),
        ("metrics = self.evaluate()", "_maybe_log_save_evaluate", "/t/transformers/trainer.py", "evaluation"),
        ("outputs = model(**inputs)", "prediction_step", "/t/transformers/trainer.py", "evaluation"),
        ("self.save_model(output_dir)", "_save_checkpoint", "/t/transformers/trainer.py", "checkpoint-save"),
        ("torch.save(state, path)", "save", "/x/ckpt.py", "checkpoint-save"),
        ("loss = self.loss_function(logits, labels)", "forward", "/t/transformers/models/llama/m.py", "loss"),
        ("loss = fixed_cross_entropy(logits, labels)", "ForCausalLMLoss", "/t/transformers/loss/loss_utils.py", "loss"),
        ("hidden_states = self.mlp(hidden_states)", "forward", "/t/transformers/models/llama/m.py", "forward"),
        # model load: transformers 5.x, the Trainer moving the model, bitsandbytes quantizing, peft's fp32 upcast
        (
            "_ = torch.empty(int(byte_count // 2), dtype=torch.float16, device=device, requires_grad=False)",
            "caching_allocator_warmup",
            "/t/transformers/modeling_utils.py",
            "model-load",
        ),
        ("model = model.to(device)", "_move_model_to_device", "/t/transformers/trainer.py", "model-load"),
        ("return self._apply(convert)", "to", "/t/torch/nn/modules/module.py", "model-load"),
        ("w = self.data.contiguous().to(device)", "_quantize", "/t/bitsandbytes/nn/modules.py", "model-load"),
        (
            "param.data = param.data.to(torch.float32)",
            "prepare_model_for_kbit_training",
            "/t/peft/utils/other.py",
            "model-load",
        ),
        ("model = load_checkpoint_and_dispatch(model, ckpt, device_map='auto')", "main", "/x/infer.py", "model-load"),
        # checkpoint save: DCP / FSDP2 gathers, DeepSpeed's 16-bit consolidation, accelerate's state-dict gather
        (
            "state_dict = get_model_state_dict(model, options=opts)",
            "save_consolidated",
            "/x/train.py",
            "checkpoint-save",
        ),
        (
            "return _iterate_state_dict(",
            "_gather_state_dict",
            "/t/torch/distributed/_state_dict_utils.py",
            "checkpoint-save",
        ),
        ("model_engine.save_16bit_model(out_dir)", "main", "/x/train.py", "checkpoint-save"),
        ("state_dict = accelerator.get_state_dict(model)", "main", "/x/train.py", "checkpoint-save"),
        # evaluation: Lightning's epoch-end hooks and loops, a trainer.validate() call
        ("logits = torch.cat(self.val_logits)", "on_validation_epoch_end", "/x/module.py", "evaluation"),
        (
            "self._on_evaluation_epoch_end()",
            "on_run_end",
            "/t/lightning/pytorch/loops/evaluation_loop.py",
            "evaluation",
        ),
        ("trainer.validate(module, datamodule=dm)", "<module>", "/x/run.py", "evaluation"),
    ],
)
def test_single_frame_phase(code, func, path, phase):
    assert detect_phase([(path, 10, func, code)])[0] == phase


def test_phase_precedence_outer_contexts():
    # bf16_full_eval moves the model inside the evaluation loop: evaluation, not model load
    frames = [
        ("/t/transformers/trainer.py", 2871, "evaluate", "output = self.evaluation_loop("),
        (
            "/t/transformers/trainer.py",
            2953,
            "evaluation_loop",
            "model = model.to(dtype=torch.bfloat16, device=args.device)",
        ),
        ("/t/torch/nn/modules/module.py", 1383, "to", "return self._apply(convert)"),
    ]
    assert detect_phase(frames)[0] == "evaluation"
    # a DTensor redistribute's autograd forward inside a state-dict gather is the save, not a forward pass
    frames = [
        ("/x/train.py", 131, "save_consolidated", "state_dict = get_model_state_dict(model, options=opts)"),
        ("/t/torch/distributed/tensor/_redistribute.py", 1918, "forward", "output = redistribute_local_tensor("),
    ]
    phase, frame = detect_phase(frames)
    assert phase == "checkpoint-save" and "get_model_state_dict" in frame


def test_phase_precedence_backward_over_checkpoint_recompute_forward():
    frames = [
        ("/x/train.py", 97, "<module>", "loss.backward()"),
        ("/t/torch/utils/checkpoint.py", 1124, "unpack_hook", "frame.recompute_fn(*args)"),
        ("/t/transformers/models/llama/modeling_llama.py", 303, "forward", "hidden_states = self.mlp(hidden_states)"),
    ]
    phase, frame = detect_phase(frames)
    assert phase == "backward" and "loss.backward()" in frame
    assert detect_phase([("/x/a.py", 1, "main", "x = 1")]) == (None, None)


def test_logits_matcher_is_strict():
    from oomdoctor.explain.logits import LogitsShape

    # 4 x 4096 tokens x 32000 x 4 bytes = 2,097,152,000 bytes -> torch prints "1.95 GiB"
    assert "32000" in _logits_match(S("1.95 GiB"), LogitsShape((32000,)))
    # the user's own micro-batch x seq (not a power of two) is accepted as a hint
    assert _logits_match(3 * 1000 * 32000 * 4, LogitsShape((32000,), tokens=3000)) is not None
    assert _logits_match(3 * 1000 * 32000 * 4, LogitsShape((32000,))) is None
    assert _logits_match(S("1.23 GiB"), LogitsShape((32000, 128256))) is None


def test_logits_matcher_names_the_given_model_and_whole_sequences():
    from oomdoctor.explain.logits import LogitsShape

    # 152 eval sequences of 1024 tokens gathered so far, bf16 logits of a 32000 vocabulary: 9500 MiB = "9.28 GiB"
    shape = LogitsShape((32000,), tokens=1024, seq_len=1024, model="meta-llama/Llama-2-13b-hf")
    match = _logits_match(S("9.28 GiB"), shape)
    assert "meta-llama/Llama-2-13b-hf" in match and "sequence(s) of your 1024 tokens" in match
    assert _logits_match(S("9.28 GiB"), LogitsShape((32000,))) is None  # 155648 tokens: no power of two


def test_tracking_cap_oom_round_trips():
    """The simulated OOM that oomdoctor's own tracker raises (a real torch.OutOfMemoryError from a real op under a
    memory cap, inside a phase) reads back with the same numbers."""
    import traceback

    torch = pytest.importorskip("torch")
    tracking = pytest.importorskip("oomdoctor.execute.tracking")
    MiB = 2**20
    text = None
    with tracking.LiveBytes(cap_bytes=3 * MiB) as lb:
        with lb.phase("forward"):
            a = torch.ones(2 * MiB // 4)  # 2 MiB live
            try:
                torch.ones(2 * MiB // 4)  # would need 4 MiB > 3 MiB cap
            except torch.OutOfMemoryError:
                text = traceback.format_exc()
    assert text is not None and a.numel()
    r = parse_oom(text)
    assert r.requested_bytes == 2 * MiB
    assert r.total_bytes == 3 * MiB
    assert r.free_bytes == 1 * MiB
    assert r.allocated_bytes == 2 * MiB
    # 2 MiB is 67% of the 3 MiB cap and twice what remained: one large request, by rule
    assert explain(text).causes[0].id == "huge-allocation"


def test_oom_killer_reads_resident_memory():
    r = parse_oom((DATA / "linux-oom-killer-offload.txt").read_text())
    assert r.this_process_bytes == 61423112 * 1024
    assert "48211" in r.message


def test_jupyter_traceback_frames():
    r = parse_oom((DATA / "jupyter-colab-backward.txt").read_text())
    assert r.phase == "backward"
    assert "loss.backward()" in r.phase_frame and "In[14]" in r.phase_frame
    assert r.failing_frame.endswith("_engine_run_backward(")


def test_nccl_cuda_failure_is_cuda_error():
    text = (
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\n"
        "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'"
    )
    d = explain(text)
    assert d.report.kind == "cuda-error"
    assert d.causes[0].id == "other-processes"


def test_wrapped_message_and_log_noise():
    text = "INFO step 3\n" + (DATA / "v22-forward-llama-trainer.txt").read_text().replace(". GPU 0", ".\nGPU 0")
    r = parse_oom(text)
    assert r.total_bytes == S("23.64 GiB") and r.phase == "forward"


def test_plan_flags_without_model_drop_fixes_already_applied():
    from oomdoctor.plan import Plan

    r = parse_oom((DATA / "v22-forward-llama-trainer.txt").read_text())
    plan = Plan(gradient_checkpointing=True, micro_batch=1)
    ids = [f.id for c in diagnose(r, plan=plan).causes if c.id == "capacity" for f in c.fixes]
    assert "gradient-checkpointing" not in ids and "micro-batch" not in ids
    assert "seq-len" in ids


def test_real_torch_cpu_oom_traceback():
    """A real CPU allocator failure raised by the installed torch, explained from its formatted traceback."""
    import traceback

    torch = pytest.importorskip("torch")
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError:
        text = traceback.format_exc()
    else:  # pragma: no cover - a machine with a petabyte of RAM
        pytest.skip("the allocation succeeded")
    d = explain(text)
    assert d.report.kind == "cpu-allocator"
    assert d.report.requested_bytes == 2**50
    assert d.causes[0].id == "huge-allocation"


def test_escaped_traceback_in_a_json_log():
    import json

    raw = (DATA / "v22-fragmentation-backward.txt").read_text()
    line = json.dumps({"level": "error", "exc": raw})  # the traceback as one escaped string
    r = parse_oom("some other log line\n" + line + "\n")
    assert r.phase == "backward"
    assert r.requested_bytes == S("1.25 GiB")


def test_memory_held_outside_pytorch_by_this_process():
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of "
        "15.77 GiB of which 12.38 MiB is free. Including non-PyTorch memory, this process has 15.75 GiB memory in use. "
        "Of the allocated memory 3.41 GiB is allocated by PyTorch, and 42.18 MiB is reserved by PyTorch but "
        "unallocated."
    )
    d = explain(text)
    cap = d.causes[0]
    assert cap.id == "capacity"
    assert any("outside PyTorch's allocator" in e for e in cap.evidence)
    assert cap.fixes[0].id == "non-pytorch-memory"
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in cap.fixes[0].how


def _cause(d, cause_id):
    return next(c for c in d.causes if c.id == cause_id)


def _explain(name: str, **kw):
    return explain((DATA / f"{name}.txt").read_text(), **kw)


# ---------------------------------------------------------------------------------------------- issue 28 misreadings


def test_lone_process_line_is_this_process():
    """A container hides the process's PID: its only 'Process N' line is this process, not another one."""
    d = _explain("v23-lone-process-is-self")
    r = d.report
    assert [(p.pid, p.is_self) for p in r.processes] == [(2786, True)]
    assert r.this_process_bytes == S("23.12 GiB") and r.other_processes_bytes == 0
    assert "other-processes" not in [c.id for c in d.causes]
    assert any("lists one process, process 2786" in n for n in r.notes)
    cap = d.causes[0]
    assert cap.id == "capacity"
    # 23.12 GiB in use vs 20.40 GiB reserved by PyTorch: 2.72 GiB outside the allocator, in this process
    assert any("outside PyTorch's allocator" in e and "2.72 GiB" in e for e in cap.evidence)
    assert cap.fixes[0].id == "non-pytorch-memory"


def test_process_listed_twice_is_this_process():
    """WSL: 'Process N' reports exactly what 'this process' reports: the same process, listed twice."""
    d = _explain("wsl-process-listed-twice")
    r = d.report
    assert [p.is_self for p in r.processes] == [True, True]
    assert r.other_processes_bytes == 0 and r.this_process_bytes == S("7.21 GiB")
    assert "other-processes" not in [c.id for c in d.causes]
    assert any("listed twice" in n for n in r.notes)
    # Another process with a different usage is still another process.
    other = (
        (DATA / "wsl-process-listed-twice.txt")
        .read_text()
        .replace("Process 1873 has 7.21 GiB", "Process 1873 has 512.00 MiB")
    )
    assert parse_oom(other).other_processes_bytes == S("512.00 MiB")


def test_one_large_request_is_its_own_cause_not_capacity():
    """15.66 GiB (20% of the card, 3.3x what remained) = the fp32 logits of 4 x 8192 tokens of Llama-3."""
    d = _explain("v26-full-vocab-logits-loss")
    huge = d.causes[0]
    assert huge.id == "huge-allocation"
    assert any("3.3x what remained" in e for e in huge.evidence)
    assert any("32768 tokens x vocab 128256 x 4 bytes" in e for e in huge.evidence)
    assert huge.fixes[0].id == "loss:chunked"
    assert "loss: chunked" in huge.fixes[0].how and "use_liger_kernel=True" in huge.fixes[0].how
    assert {"micro-batch", "seq-len"} <= {f.id for f in huge.fixes}
    cap = _cause(d, "capacity")
    assert any(e.startswith("headroom:") and "one large request ran out" in e for e in cap.evidence)


def test_large_eval_request_gets_eval_batch_fixes():
    """TRL SFTTrainer's eval asks for the logits (prediction_loss_only=False): 16384 tokens x 151936 x 2 bytes."""
    d = _explain("trl-sft-eval-full-logits")
    huge = d.causes[0]
    assert huge.id == "huge-allocation" and d.report.phase == "evaluation"
    hows = " ".join(f.how for f in huge.fixes)
    for key in ("per_device_eval_batch_size", "eval_accumulation_steps", "prediction_loss_only", "max_length"):
        assert key in hows
    assert "gradient-checkpointing" not in [f.id for f in huge.fixes]  # nothing is saved for backward in eval


def test_gathered_eval_logits_put_keeping_logits_off_the_gpu_first():
    d = _explain("v24-eval-gathered-logits")
    huge = d.causes[0]
    assert huge.id == "huge-allocation"
    assert huge.fixes[0].id == "eval-logits"  # the failing frame concatenates batch after batch
    assert "eval_accumulation_steps" in huge.fixes[0].how


def test_eval_logits_of_the_given_model_are_named():
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan import Plan

    d = _explain(
        "v24-eval-gathered-logits", spec=load_spec("meta-llama/Llama-2-13b-hf"), plan=Plan(method="lora", seq_len=1024)
    )
    huge = d.causes[0]
    assert huge.id == "huge-allocation"
    assert any(
        "logits of meta-llama/Llama-2-13b-hf" in e and "sequence(s) of your 1024 tokens" in e for e in huge.evidence
    )


def test_model_load_phase_and_fixes():
    d = _explain("v25-load-allocator-warmup")
    assert d.report.phase == "model-load" and "from_pretrained" in d.report.phase_frame
    assert "caching_allocator_warmup" in d.report.failing_frame
    huge = d.causes[0]
    assert huge.id == "huge-allocation"
    ids = [f.id for f in huge.fixes]
    assert ids[0] == "load-quantized" and {"load-dtype", "free-before-load"} <= set(ids)
    assert "loss:chunked" not in ids and "gradient-checkpointing" not in ids
    d = _explain("v24-load-trainer-moves-fp32-model")
    assert d.report.phase == "model-load" and "_move_model_to_device" in d.report.phase_frame
    cap = d.causes[0]
    assert cap.id == "capacity" and cap.fixes[0].id == "load-quantized"
    assert "dtype=torch.bfloat16" in next(f.how for f in cap.fixes if f.id == "load-dtype")
    assert _explain("mps-load-to-device").report.phase == "model-load"


def test_checkpoint_save_phase_from_a_state_dict_gather():
    d = _explain("fsdp2-full-state-dict-gather")
    assert d.report.phase == "checkpoint-save" and "get_model_state_dict" in d.report.phase_frame
    cap = _cause(d, "capacity")
    assert cap.fixes[0].id == "fsdp-state-dict-offload" and "cpu_offload=True" in cap.fixes[0].how
    assert {"deepspeed-save-sharded", "save-only-model"} <= {f.id for f in cap.fixes}


def test_lightning_validation_epoch_end_is_evaluation():
    d = _explain("lightning-validation-epoch-end-cat")
    assert d.report.phase == "evaluation" and "evaluation_loop.py" in d.report.phase_frame
    assert "on_validation_epoch_end" in d.report.failing_frame
    assert d.causes[0].id == "huge-allocation"
    assert d.causes[0].fixes[0].id == "eval-logits" and ".cpu()" in d.causes[0].fixes[0].how


def test_fragmentation_first_when_reserved_unallocated_covers_the_request():
    """431.77 MiB reserved but unallocated >= the 344 MiB request: fragmentation first, the headroom next to
    capacity (87.77 MiB to spare, under 5% of the card left: capacity comes right after)."""
    d = _explain("gc-recompute-backward")
    assert [c.id for c in d.causes] == ["fragmentation", "capacity"]
    cap = d.causes[1]
    head = next(e for e in cap.evidence if e.startswith("headroom:"))
    assert "431.77 MiB reserved but unallocated vs the 344.00 MiB request" in head and "87.77 MiB to spare" in head
    assert "fail anyway" in head and cap.score >= 0.85
    # Roomy (11% of the card left after the request): capacity stays far behind, the headroom says so too.
    d = _explain("v22-fragmentation-backward")
    cap = _cause(d, "capacity")
    assert d.causes[0].id == "fragmentation" and cap.score < 0.5
    assert any(e.startswith("headroom:") and "fail anyway" not in e for e in cap.evidence)


def test_memory_fraction_cap_in_the_new_wording():
    """torch >= 2.1 prints 'M allowed; ' before 'Of the allocated memory' under set_per_process_memory_fraction."""
    d = _explain("v24-memory-fraction-cap")
    assert d.report.allowed_bytes == S("39.59 GiB")
    assert d.causes[0].id == "capacity" and d.causes[0].fixes[0].id == "memory-fraction"
    assert "fragmentation" not in [c.id for c in d.causes]


def test_cudnn_not_supported_is_an_oom_in_disguise():
    d = _explain("cudnn-not-supported-whisper")
    assert (d.report.kind, d.report.format, d.report.phase) == ("cuda-error", "cudnn", "forward")
    assert any("non-contiguous" in n for n in d.report.notes)
    assert d.causes[0].id == "capacity" and "micro-batch" in [f.id for f in d.causes[0].fixes]


def test_cudnn_error_after_an_oom_is_noted():
    r = parse_oom((DATA / "cudnn-not-supported-after-oom.txt").read_text())
    assert r.kind == "cuda-allocator" and r.requested_bytes == S("2.44 GiB")
    assert any("later CUDNN_STATUS_NOT_SUPPORTED" in n for n in r.notes)


def test_oom_killer_cgroup_and_old_kernel_wordings():
    d = _explain("oom-killer-cgroup-journal")
    r = d.report
    assert r.total_bytes == 64 * GiB and r.this_process_bytes == 61254180 * 1024
    assert d.causes[0].fixes[0].id == "container-memory-limit"
    old = (
        "[ 8812.114532] Out of memory: Kill process 3114 (python) score 912 or sacrifice child\n"
        "[ 8812.118203] Killed process 3114 (python) total-vm:71328400kB, anon-rss:60113232kB, file-rss:1024kB\n"
    )
    r = parse_oom(old)
    assert (r.kind, r.format) == ("cpu-oom-killer", "linux-oom-killer")
    assert r.this_process_bytes == 60113232 * 1024


def test_mps_buffer_larger_than_metal_allows():
    d = _explain("mps-invalid-buffer-size-logits")
    huge = d.causes[0]
    assert huge.id == "huge-allocation" and huge.score >= 0.9
    assert any("largest single buffer" in e for e in huge.evidence)
    assert huge.fixes[0].id == "loss:chunked"


def test_which_process_entry_is_this_process():
    """The rules, one by one: a lone entry; the entry listed twice; the one entry holding PyTorch's reservation."""
    from oomdoctor.explain.parsers.cuda import holding_reservation, identify_self, listed_twice, lone_entry
    from oomdoctor.explain.report import ProcessUse

    me, other = ProcessUse(7, 23 * GiB), ProcessUse(8, 3 * GiB)
    assert lone_entry([me], None)[0] is me
    assert lone_entry([ProcessUse(None, 5 * GiB, is_self=True)], None) is None
    twin = ProcessUse(None, 23 * GiB, is_self=True)
    assert listed_twice([me, twin], None)[0] is me
    assert listed_twice([other, twin], None) is None  # a different usage: another process
    # Containers, two processes: this one holds the 19 GiB reservation plus 4 GiB outside the allocator.
    assert holding_reservation([other, me], 19 * GiB)[0] is me
    procs, notes = identify_self([other, me], 19 * GiB)
    assert [p.is_self for p in procs] == [False, True] and "19.00 GiB reservation" in notes[0]
    # Two entries above the reservation: only one within 2 GiB of context is taken, else none.
    close = ProcessUse(9, 20 * GiB)
    assert holding_reservation([me, close], 19 * GiB)[0] is close
    assert holding_reservation([me, ProcessUse(9, 24 * GiB)], 19 * GiB) is None
