"""The measured engine: a clear NoGPU (exit 2) without CUDA; on a GPU, the real step next to the simulation."""

from __future__ import annotations

import pytest

from oomdoctor.plan import Plan, validate


def test_measure_without_gpu_says_so_and_exits_2(tiny_spec, monkeypatch):
    import torch

    from oomdoctor.engines import estimate
    from oomdoctor.errors import EXIT_BAD_INPUT, NoGPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoGPU) as ei:
        estimate(tiny_spec, validate(Plan(seq_len=16)), "measure")
    assert "needs a CUDA GPU; none found" in ei.value.message
    assert "--engine simulate" in (ei.value.hint or "")
    assert ei.value.exit_code == EXIT_BAD_INPUT == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [
        Plan(seq_len=256),
        Plan(method="lora", seq_len=256, gradient_checkpointing=True),
        Plan(method="qlora", seq_len=256),
    ],
    ids=lambda p: p.label(),
)
def test_measured_tensor_peak_close_to_simulation(tiny_spec, plan):
    from oomdoctor.engines.measure import measure_plan
    from oomdoctor.engines.simulate import simulate_plan

    plan = validate(plan)
    m = measure_plan(tiny_spec, plan)
    s = simulate_plan(tiny_spec, plan)
    assert m.breakdown.tensor_sum() == m.breakdown.peak_allocated
    # tiny model: the cuBLAS workspace (32 MiB on Hopper) dominates max_memory_allocated; compare tracked tensors
    assert abs(m.tracked_peak - s.breakdown.peak_allocated) <= 0.05 * s.breakdown.peak_allocated + 2 * 2**20


def test_measure_refuses_several_ranks_with_a_hint(tiny_spec, monkeypatch):
    import torch

    from oomdoctor.engines.measure import measure_plan
    from oomdoctor.errors import BadInput

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BadInput, match="one process") as ei:
        measure_plan(tiny_spec, validate(Plan(seq_len=16, world_size=2, strategy="fsdp")))
    assert "--engine simulate" in ei.value.hint


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [
        Plan(seq_len=256, strategy="fsdp"),
        Plan(seq_len=256, strategy="fsdp", precision="bf16-mixed", gradient_checkpointing=True),
    ],
    ids=lambda p: p.label(),
)
def test_world_1_fsdp2_on_the_gpu_allocates_what_the_fake_pg_replay_says(tiny_spec, plan):
    """Issue 13: a one-rank FSDP2 step on CUDA (NCCL group of one) against the fake-process-group simulation."""
    from oomdoctor.engines.measure import measure_plan
    from oomdoctor.engines.simulate import simulate_plan

    plan = validate(plan)
    m = measure_plan(tiny_spec, plan)
    s = simulate_plan(tiny_spec, plan)
    assert abs(m.tracked_peak - s.breakdown.peak_allocated) <= 0.02 * s.breakdown.peak_allocated + 2 * 2**20
