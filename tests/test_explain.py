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
    "v22-forward-llama-trainer": ("cuda-allocator", "torch>=2.2", "cuda:0", "172.00 MiB", "23.64 GiB", "95.81 MiB",
                                  "22.87 GiB", "211.16 MiB", 0, "forward", "capacity"),
    "v22-fragmentation-backward": ("cuda-allocator", "torch>=2.2", "cuda:0", "1.25 GiB", "39.38 GiB", "731.38 MiB",
                                   "33.14 GiB", "5.02 GiB", 0, "backward", "fragmentation"),
    "v22-other-processes": ("cuda-allocator", "torch>=2.2", "cuda:0", "512.00 MiB", "23.68 GiB", "301.56 MiB",
                            "11.41 GiB", "276.46 MiB", S("9.86 GiB") + S("1.37 GiB"), "forward", "other-processes"),
    "v29-ranks-private-pools-optimizer": ("cuda-allocator", "torch>=2.2", "cuda:0", "2.03 GiB", "79.19 GiB",
                                          "1.58 GiB", "74.12 GiB", "2.84 GiB", 0, "optimizer-step", "capacity"),
    "v21-capacty-eval-logits": ("cuda-allocator", "torch-2.1", "cuda:0", "7.83 GiB", "39.39 GiB", "5.61 GiB",
                                "30.28 GiB", "2.98 GiB", 0, "evaluation", "huge-allocation"),
    "v20-old-format-loss": ("cuda-allocator", "torch<=2.0", "cuda:0", "3.91 GiB", "79.15 GiB", "2.31 GiB",
                            "72.38 GiB", S("76.10 GiB") - S("72.38 GiB"), None, "loss", "capacity"),
    "v113-allowed-backward": ("cuda-allocator", "torch<=2.0", "cuda:0", "768.00 MiB", "23.69 GiB", "10.71 GiB",
                              "10.94 GiB", S("11.50 GiB") - S("10.94 GiB"), None, "backward", "capacity"),
    "v14-cached-forward": ("cuda-allocator", "torch<1.5", "cuda:0", "96.00 MiB", "10.92 GiB", "85.38 MiB",
                           "9.87 GiB", S("10.16 GiB") - S("9.87 GiB"), None, "forward", "capacity"),
    "wsl-absurd-process-values": ("cuda-allocator", "torch>=2.2", "cuda:0", "250.00 MiB", "8.00 GiB", 0,
                                  "6.91 GiB", "183.27 MiB", None, "backward", "capacity"),
    "zero-free-checkpoint-merge": ("cuda-allocator", "torch>=2.2", "cuda:0", "2.00 MiB", "15.70 GiB", 0,
                                   "15.31 GiB", "64.52 MiB", 0, "checkpoint-save", "capacity"),
    "fsdp-clone-warning-save": ("fsdp-clone-warning", "torch<=2.0", "cuda:0", "172.00 MiB", "79.15 GiB",
                                "49.25 MiB", "76.02 GiB", S("77.94 GiB") - S("76.02 GiB"), None, "checkpoint-save",
                                "capacity"),
    "cuda-error-context": ("cuda-error", "cuda-runtime", "cuda", None, None, None, None, None, None, None,
                           "other-processes"),
    "cublas-alloc-failed-forward": ("cuda-error", "cuda-runtime", "cuda", None, None, None, None, None, None,
                                    "forward", "other-processes"),
    "cpu-allocator-not-enough": ("cpu-allocator", "torch-cpu", "cpu", 655360000, None, None, None, None, None, None,
                                 "capacity"),
    "cpu-allocator-cant-allocate-optimizer": ("cpu-allocator", "torch-cpu", "cpu", 536870912, None, None, None, None,
                                              None, "optimizer-step", "capacity"),
    "bnb-dispatched-cpu-disk": ("quantized-offload", "transformers/accelerate", "cuda", None, None, None, None, None,
                                None, None, "capacity"),
    "accelerate-8bit-offload-train": ("quantized-offload", "transformers/accelerate", "cuda", None, None, None, None,
                                      None, None, None, "capacity"),
    "hip-rocm-backward": ("cuda-allocator", "torch>=2.2", "cuda:3", "14.68 GiB", "191.98 GiB", "9.21 GiB",
                          "176.33 GiB", "5.87 GiB", None, "backward", "capacity"),
    "mps-backend": ("mps-allocator", "torch-mps", "mps", 594 * 2**20, S("18.13 GiB"), None, S("16.97 GiB"), None,
                    None, "forward", "capacity"),
    "packing-bug-huge-request": ("cuda-allocator", "torch-2.1", "cuda:0", "341.58 GiB", "79.15 GiB", "62.04 GiB",
                                 "15.53 GiB", "916.95 MiB", 0, "forward", "huge-allocation"),
    "container-own-pid-hidden": ("cuda-allocator", "torch>=2.2", "cuda:0", "2.32 GiB", "21.98 GiB", "1.07 GiB",
                                 "19.84 GiB", "579.21 MiB", 0, "loss", "capacity"),
    "wrapped-lightning-validation": ("cuda-allocator", "torch>=2.2", "cuda:0", "3.12 GiB", "11.72 GiB", "1.12 GiB",
                                     "7.94 GiB", "2.41 GiB", 0, "evaluation", "huge-allocation"),
    "gc-recompute-backward": ("cuda-allocator", "torch>=2.2", "cuda:0", "344.00 MiB", "44.53 GiB", "187.25 MiB",
                              "43.41 GiB", "431.77 MiB", 0, "backward", "capacity"),
    "jupyter-colab-backward": ("cuda-allocator", "torch>=2.2", "cuda:0", "1.02 GiB", "14.75 GiB", "469.06 MiB",
                               "12.91 GiB", "1.24 GiB", 0, "backward", "capacity"),
    "xpu-intel-forward": ("cuda-allocator", "torch-xpu", "xpu:0", "136.00 MiB", "15.11 GiB", None, "14.62 GiB",
                          "171.35 MiB", None, "forward", "capacity"),
    "accelerate-batch-size-exhausted": ("batch-size-exhausted", "accelerate", "cuda", None, None, None, None, None,
                                        None, None, "capacity"),
    "linux-oom-killer-offload": ("cpu-oom-killer", "linux-oom-killer", "cpu", None, None, None, None, None, None,
                                 None, "capacity"),
    "deepspeed-save-checkpoint": ("cuda-allocator", "torch>=2.2", "cuda:0", "1002.00 MiB", "23.55 GiB",
                                  "817.94 MiB", "21.47 GiB", "827.63 MiB", 0, "checkpoint-save", "capacity"),
}


def _b(v):
    return S(v) if isinstance(v, str) else v


def test_data_set_covers_every_format_cause_and_phase():
    files = {p.stem for p in DATA.glob("*.txt") if not p.stem.startswith("no-oom")}
    assert files == set(CASES), "every OOM file has expectations and vice versa"
    assert len(files) >= 15
    kinds = {c[0] for c in CASES.values()}
    assert kinds == {"cuda-allocator", "fsdp-clone-warning", "cuda-error", "cpu-allocator", "mps-allocator",
                     "quantized-offload", "batch-size-exhausted", "cpu-oom-killer"}
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
    for key in ("requested_bytes", "total_bytes", "free_bytes", "allocated_bytes", "reserved_unallocated_bytes",
                "other_processes_bytes", "phase", "causes"):
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
    frag = [c for c in explain((DATA / "v29-ranks-private-pools-optimizer.txt").read_text()).causes
            if c.id == "fragmentation"][0]
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in frag.fixes[0].how or any(
        "export PYTORCH_ALLOC_CONF=expandable_segments:True" in f.how for f in frag.fixes)


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
    assert r.other_processes_bytes is None
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
    assert cap.fixes[0].id == "optimizer-8bit"


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
        ("loss = fixed_cross_entropy(logits, labels)", "ForCausalLMLoss", "/t/transformers/loss/loss_utils.py",
         "loss"),
        ("hidden_states = self.mlp(hidden_states)", "forward", "/t/transformers/models/llama/m.py", "forward"),
    ],
)
def test_single_frame_phase(code, func, path, phase):
    assert detect_phase([(path, 10, func, code)])[0] == phase


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
    # 4 x 4096 tokens x 32000 x 4 bytes = 2,097,152,000 bytes -> torch prints "1.95 GiB"
    assert "32000" in _logits_match(S("1.95 GiB"), (32000,))
    # the user's own micro-batch x seq (not a power of two) is accepted as a hint
    assert _logits_match(3 * 1000 * 32000 * 4, (32000,), tokens_hint=3000) is not None
    assert _logits_match(3 * 1000 * 32000 * 4, (32000,)) is None
    assert _logits_match(S("1.23 GiB"), (32000, 128256)) is None


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
    assert explain(text).causes[0].id == "capacity"


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
