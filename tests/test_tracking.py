"""LiveBytes: live storage bytes, frees, peaks, phases, categories, the memory cap, existing tensors."""

from __future__ import annotations

import gc

import pytest
import torch

from oomdoctor.execute.tracking import LiveBytes, capped_memory, round_bytes


def test_round_bytes_like_cuda_allocator():
    assert round_bytes(0) == 0
    assert round_bytes(1) == 512
    assert round_bytes(512) == 512
    assert round_bytes(513) == 1024
    assert round_bytes(1000, 1) == 1000


def test_counts_known_tensors_views_and_frees():
    with LiveBytes(round_to=1) as lb:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        assert lb.current == 4000
        v = a.view(10, 100)  # view: same storage, no bytes
        a.add_(1)  # in-place: nothing new
        assert lb.current == 4000
        b = torch.empty(10, dtype=torch.bfloat16)  # 20 B
        assert lb.current == 4020
        del a
        assert lb.current == 4020  # the view keeps the storage alive
        del v
        gc.collect()
        assert lb.current == 20
        del b
        assert lb.current == 0
    assert lb.peak == 4020


def test_rounding_and_peak_reset():
    with LiveBytes() as lb:  # 512-byte granularity
        x = torch.zeros(3)  # 12 B -> 512
        assert lb.current == 512
        y = torch.zeros(200)  # 800 B -> 1024
        assert lb.current == 1536
        del y
        assert lb.peak == 1536 and lb.current == 512
        lb.reset_peak()
        assert lb.peak == 512
        z = torch.zeros(1)
        assert lb.peak == 1024
        del x, z


def test_phases_and_categories_in_a_real_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(16, 64)
    lb = LiveBytes(round_to=1, record_timeline=True)
    lb.track_module(model)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert lb.current == param_bytes
    with lb:
        for _ in range(2):
            with lb.phase("forward"):
                loss = model(x).square().mean()
            with lb.phase("backward"):
                loss.backward()
            del loss
            with lb.phase("optimizer-step"):
                opt.step()
                lb.track_optimizer(opt)
            opt.zero_grad(set_to_none=True)
    cats = lb.current_categories()
    assert cats["parameters"] == param_bytes
    # AdamW: exp_avg + exp_avg_sq per parameter (fp32) + one scalar step tensor per parameter
    n_params = len(list(model.parameters()))
    assert cats["optimizer_states"] == 2 * param_bytes + 4 * n_params
    assert cats["gradients"] == 0  # set_to_none freed them
    peaks = lb.phase_peaks
    assert set(peaks) == {"forward", "backward", "optimizer-step"}
    assert lb.peak == max(peaks.values())
    pc = lb.peak_categories()
    assert sum(pc.values()) == lb.peak
    # in backward of step 2, the gradients are classified as gradients
    bev = lb.phase_peak_events()["backward"]
    assert lb.categories_at(bev)["gradients"] > 0
    # forward of step 1: the hidden activations saved for backward are activations
    fwd_span = [s for s in lb.spans() if s[0] == "forward"][0]
    assert lb.categories_at(fwd_span[2])["activations"] >= 16 * 64 * 4
    tl = lb.timeline()
    assert tl and all(sum(c.values()) >= 0 for _, _, c in tl)
    assert max(sum(c.values()) for _, _, c in tl) == lb.peak


def test_region_overrides_phase_category():
    with LiveBytes(round_to=1) as lb:
        with lb.phase("forward"):
            a = torch.ones(10)
            with lb.region("logits"):
                b = torch.ones(20)
        cats = lb.current_categories()
        assert cats["activations"] == 40 and cats["logits"] == 80
        del a, b


def test_cap_raises_cuda_like_oom_and_frees_nothing():
    keep = torch.zeros(256)  # 1024 B created before entering
    with capped_memory(4096, round_to=1) as lb:
        lb.track_existing([keep], "parameters")
        assert lb.current == 1024
        a = torch.zeros(512)  # 2048 B -> 3072 live
        with pytest.raises(torch.OutOfMemoryError) as ei:
            torch.zeros(512)  # would reach 5120 > 4096
        msg = str(ei.value)
        assert "Tried to allocate 2.00 KiB" in msg and "of which 1.00 KiB is free" in msg
        assert lb.current == 3072 and lb.oom_count == 1
        assert a.sum().item() == 0  # still usable
        b = torch.zeros(256)  # 1024 B fits exactly
        assert lb.current == 4096
        del a, b
    assert lb.peak == 4096


def test_cap_in_training_step_with_registered_module():
    model = torch.nn.Linear(256, 256)
    with capped_memory(300_000, model=model, round_to=1) as lb:
        assert lb.current == (256 * 256 + 256) * 4
        with pytest.raises(torch.OutOfMemoryError):
            model(torch.randn(512, 256)).sum().backward()
    assert lb.peak <= 300_000


def test_track_existing_does_not_double_count_and_reclassifies():
    t = torch.zeros(100)
    with LiveBytes(round_to=1) as lb:
        assert lb.track_existing([t, t.view(10, 10)], "parameters") == 400
        assert lb.current == 400
        lb.classify(t, "optimizer_state")  # alias accepted
        assert lb.current_categories()["optimizer_states"] == 400
        with pytest.raises(ValueError):
            lb.classify(t, "nonsense")


def test_fake_tensors_are_counted_without_memory():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with LiveBytes(round_to=1) as lb:
            big = torch.empty(1 << 20, 1 << 10)  # 4 GiB, fake
            assert lb.current == 4 << 30
            del big
            assert lb.current == 0


def test_views_of_untracked_existing_tensors_are_not_new_allocations():
    w = torch.zeros(1000)
    with LiveBytes(round_to=1) as lb:
        v = w.view(10, 100)
        w.mul_(2)
        assert lb.current == 0
        y = v * 2  # a real new allocation
        assert lb.current == 4000
        del y, v


def test_cap_tracker_keeps_no_history_of_dead_storages():
    with LiveBytes(cap_bytes=10**9, round_to=1) as lb:
        for _ in range(100):
            torch.zeros(10)
        assert lb.current == 0 and lb.peak == 40
    assert not lb.history and len(lb._all) == 0
