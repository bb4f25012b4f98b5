"""oomdoctor.explain.causes term by term: each reading of the numbers, on hand-made reports, and how the terms make a
cause's score."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomdoctor.explain import causes
from oomdoctor.explain.causes import Term, combine
from oomdoctor.explain.logits import LogitsShape
from oomdoctor.explain.pricing import PricedPlan
from oomdoctor.explain.report import Cause, OomReport, ProcessUse

GiB = 2**30
MiB = 2**20


def report(**numbers) -> OomReport:
    """A torch >= 2.2 caching-allocator report on a 24 GiB card with the given numbers."""
    base = dict(
        kind="cuda-allocator", format="torch>=2.2", device="cuda:0", message="CUDA out of memory.", total_bytes=24 * GiB
    )
    return OomReport(**(base | numbers))


def test_combine_floors_bonuses_ceilings():
    assert combine(0.5, []) == 0.5
    assert combine(0.5, [Term("a", floor=0.3), Term("b", floor=0.7)]) == 0.7
    assert combine(0.0, [Term("a", floor=0.75), Term("b", bonus=0.15), Term("c", bonus=0.1)]) == pytest.approx(1.0)
    assert combine(0.0, [Term("a", floor=0.75), Term("b", bonus=0.15), Term("c", bonus=0.1)], most=0.97) == 0.97
    assert combine(0.5, [Term("a", floor=0.9), Term("b", ceiling=0.4)]) == 0.4


def test_usable_free_respects_the_per_process_cap():
    r = report(free_bytes=10 * GiB)
    assert causes.usable_free(r) == 10 * GiB
    capped = replace(r, allowed_bytes=12 * GiB, reserved_bytes=11 * GiB)
    assert causes.usable_free(capped) == 1 * GiB
    assert causes.usable_free(replace(r, allowed_bytes=12 * GiB, reserved_bytes=13 * GiB)) == 0


def test_fragmentation_when_cached_blocks_exceed_the_request():
    roomy = report(requested_bytes=1 * GiB, reserved_unallocated_bytes=3 * GiB, free_bytes=2 * GiB)
    c = causes.fragmentation(roomy, causes.usable_free(roomy))
    assert c.id == "fragmentation" and c.score == causes.FRAGMENTATION_FIRST and len(c.evidence) == 1
    assert c.fixes[0].id == "expandable-segments"
    # Barely enough (< 5% of the card left after the request): still first; capacity's headroom says the rest.
    tight = replace(roomy, reserved_unallocated_bytes=1 * GiB + 10 * MiB, free_bytes=0)
    c = causes.fragmentation(tight, 0)
    assert c.score == causes.FRAGMENTATION_FIRST and len(c.evidence) == 1
    head = causes.headroom_term(tight, 0)
    assert head.floor == 0.85 and "10.00 MiB to spare" in head.evidence and "fail anyway" in head.evidence
    assert causes.headroom_term(roomy, 2 * GiB).floor is None


def test_fragmentation_first_over_every_other_cause():
    """U >= R outranks the strongest other readings: a huge request that fits the card, other processes."""
    r = report(
        requested_bytes=8 * GiB,
        reserved_unallocated_bytes=9 * GiB,
        free_bytes=0,
        allocated_bytes=14 * GiB,
        phase="loss",
        failing_frame="x.py:1 in f: logits = logits.float()",
        other_processes_bytes=0,
    )
    frag = causes.fragmentation(r, 0)
    huge = causes.huge_allocation(r, 0, LogitsShape())
    assert huge.score == causes.HUGE_MOST < frag.score


def test_fragmentation_cached_plus_free_and_weak_share():
    r = report(requested_bytes=4 * GiB, reserved_unallocated_bytes=2 * GiB, free_bytes=5 * GiB)
    assert causes.fragmentation(r, 5 * GiB).score == 0.75
    assert causes.fragmentation(r, 3 * GiB).score == 0.55  # 1 GiB left: under 5% of the card
    weak = replace(r, free_bytes=0)
    c = causes.fragmentation(weak, 0)
    assert c.score == 0.3 and len(c.evidence) == 1  # no "would be left" sentence for a weak reading
    assert causes.fragmentation(replace(weak, reserved_unallocated_bytes=100 * MiB), 0) is None
    assert causes.fragmentation(replace(r, kind="mps-allocator"), 5 * GiB) is None


def test_other_processes_listed_and_unlisted():
    r = report(
        requested_bytes=2 * GiB,
        free_bytes=1 * GiB,
        other_processes_bytes=6 * GiB,
        processes=(ProcessUse(4242, 6 * GiB), ProcessUse(None, 17 * GiB, is_self=True)),
    )
    c = causes.other_processes(r)
    assert c.score == 0.8 and "PID 4242" in c.evidence[0] and "would have fit" in c.evidence[0]
    assert "kill 4242" in c.fixes[0].how
    assert causes.other_processes(replace(r, other_processes_bytes=10 * MiB)) is None
    unlisted = report(requested_bytes=2 * GiB, non_pytorch_bytes=6 * GiB)
    assert causes.other_processes(unlisted).score == 0.45
    assert causes.unlisted_processes_term(report(kind="cuda-error", total_bytes=None)).floor == 0.6


def test_huge_allocation_adds_logits_line_and_phase():
    vocab, tokens = 32000, 8192
    shape = LogitsShape((vocab,))
    r = report(
        requested_bytes=tokens * vocab * 4, failing_frame="x.py:1 in forward: logits = self.lm_head(h)", phase="loss"
    )
    terms = [
        causes.request_size_term(r),
        causes.logits_term(r, shape),
        causes.failing_line_term(r),
        causes.logits_phase_term(r),
    ]
    assert terms[0] is None  # 0.98 GiB is 4% of the card: not big by itself
    assert terms[1].bonus == 0.15 and "vocab 32000" in terms[1].evidence
    assert terms[2].bonus == 0.1 and terms[3].bonus == 0.1
    c = causes.huge_allocation(r, None, shape)
    assert c.score == pytest.approx(0.3 + 0.15 + 0.1 + 0.1)
    assert c.fixes[0].id == "loss:chunked"
    whole_card = report(requested_bytes=30 * GiB, phase="evaluation", failing_frame="a.py:1 in f: logits = x")
    c = causes.huge_allocation(whole_card, None, shape)
    assert c.score == 0.97 and c.fixes[0].id == "eval-batch-size"
    assert causes.huge_allocation(report(requested_bytes=20 * MiB), None, shape) is None


def test_large_against_the_card_or_against_what_remained():
    """The two readings that make one request its own cause, and their thresholds."""
    assert causes.request_size_term(report(requested_bytes=2 * GiB)) is None  # 8% of 24 GiB
    assert causes.request_size_term(report(requested_bytes=3 * GiB)).floor == 0.6  # 12.5%
    assert causes.request_size_term(report(requested_bytes=7 * GiB)).floor == 0.85  # 29%
    r = report(requested_bytes=2 * GiB, reserved_unallocated_bytes=200 * MiB)
    assert causes.remaining_term(r, 800 * MiB) is not None  # 2 GiB vs 1000 MiB left: 2.0x, 8% of the card
    assert causes.remaining_term(r, 900 * MiB) is None  # 1.9x: not far more
    small = report(requested_bytes=1 * GiB, reserved_unallocated_bytes=0)
    assert causes.remaining_term(small, 0) is None  # 4% of the card: the card is full, not one tensor too big
    both = causes.huge_allocation(replace(r, requested_bytes=4 * GiB), 800 * MiB, LogitsShape(()))
    assert both.score == pytest.approx(0.6 + 0.2)  # against the card (17%) and what remained (4.1x)
    # Capacity states the shortfall but does not claim the plan is too big when one request explains it.
    big = replace(r, requested_bytes=4 * GiB, free_bytes=800 * MiB)
    assert causes.headroom_term(big, 800 * MiB).floor is None
    assert causes.headroom_term(replace(big, requested_bytes=1 * GiB), 0).floor == 0.85


def test_capacity_terms():
    cap = report(requested_bytes=2 * GiB, free_bytes=40 * GiB, allowed_bytes=31 * GiB, reserved_bytes=30 * GiB)
    assert causes.memory_cap_term(cap).floor == 0.9
    assert causes.memory_cap_term(replace(cap, free_bytes=1 * GiB)) is None  # the card, not the cap, is full
    outside = report(this_process_bytes=15 * GiB, reserved_bytes=3 * GiB)
    assert causes.outside_pytorch_term(outside).floor == 0.6
    assert causes.outside_pytorch_term(replace(outside, this_process_bytes=4 * GiB)) is None
    assert causes.live_tensors_term(report(allocated_bytes=22 * GiB)).floor == 0.75
    assert causes.live_tensors_term(report(allocated_bytes=10 * GiB)).floor is None
    short = report(requested_bytes=1 * GiB, reserved_unallocated_bytes=256 * MiB, other_processes_bytes=256 * MiB)
    head = causes.headroom_term(short, 256 * MiB)
    assert head.floor == 0.85 and "short by 256.00 MiB" in head.evidence
    fits_with_others = causes.headroom_term(short, 600 * MiB)
    assert fits_with_others.floor is None and "other processes hold" in fits_with_others.evidence


def test_plan_term_confirms_or_weakens_capacity():
    over = PricedPlan(peak_bytes=30 * GiB, peak_phase="backward", fixes=())
    assert causes.plan_term(over, 24 * GiB).floor == 0.9
    within = replace(over, peak_bytes=20 * GiB)
    assert causes.plan_term(within, 24 * GiB).ceiling == 0.4
    assert causes.plan_term(None, 24 * GiB) is None and causes.plan_term(over, None) is None
    r = report(allocated_bytes=23 * GiB)
    assert causes.capacity(r, None, [], within, 24 * GiB).score == 0.4


def test_capacity_gives_way_to_a_strong_other_cause():
    r = report(allocated_bytes=20 * GiB)
    assert causes.capacity(r, None, [], None, 24 * GiB).score == 0.65
    strong = Cause("fragmentation", 0.9, (), ())
    assert causes.capacity(r, None, [strong], None, 24 * GiB).score == 0.4
    # The memory model's verdict is not overridden.
    over = PricedPlan(peak_bytes=30 * GiB, peak_phase="backward", fixes=())
    assert causes.capacity(r, None, [strong], over, 24 * GiB).score == 0.9


def test_capacity_fixes_follow_kind_and_numbers():
    host = report(kind="cpu-oom-killer", device="cpu", total_bytes=None, this_process_bytes=60 * GiB)
    c = causes.capacity(host, None, [], None, None)
    assert c.score == 0.8 and c.fixes[0].id == "host-ram"
    outside = report(this_process_bytes=15 * GiB, reserved_bytes=3 * GiB)
    assert causes.capacity(outside, None, [], None, 24 * GiB).fixes[0].id == "non-pytorch-memory"
