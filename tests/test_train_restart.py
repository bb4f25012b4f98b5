"""The bookkeeping of the OOM restart across ranks (oomdoctor.train.restart): no processes, no torch."""

from __future__ import annotations

from oomdoctor.train import restart
from oomdoctor.train.restart import Job, OOMRestart


def _rec(run_id: str, attempt: int) -> OOMRestart:
    return OOMRestart(
        step=3,
        failed_micro_batch=8,
        new_micro_batch=4,
        phase="forward",
        message="CUDA out of memory",
        rank=1,
        run_id=run_id,
        attempt=attempt,
    )


def test_the_marker_is_read_by_the_next_attempt_of_the_same_launch_only(tmp_path):
    restart.write_marker(tmp_path, _rec("job-a", 0))
    assert restart.pending(tmp_path, Job("job-a", 1, 3)) == _rec("job-a", 0)
    assert restart.pending(tmp_path, Job("job-a", 2, 3)) is None  # an older OOM: already consumed
    assert restart.pending(tmp_path, Job("job-b", 1, 3)) is None  # another launch
    assert restart.pending(tmp_path, Job("", 0, 0)) is None  # not under torchrun
    assert restart.peer_ran_out(tmp_path, Job("job-a", 0, 3)) and not restart.peer_ran_out(tmp_path, Job("job-a", 1, 3))
    assert _rec("job-a", 0).to_dict()["restart"] is True
    restart.clear(tmp_path)
    assert restart.pending(tmp_path, Job("job-a", 1, 3)) is None


def test_restart_budget_injection_and_failure_record(tmp_path, monkeypatch):
    assert Job("j", 2, 3).restarts_left and not Job("j", 3, 3).restarts_left and not Job().restarts_left
    monkeypatch.setenv(restart.INJECT_OOM_ENV, "2:1")
    assert restart.injected_oom(2, 1, Job("j", 0, 3))
    assert not restart.injected_oom(2, 0, Job("j", 0, 3)) and not restart.injected_oom(3, 1, Job("j", 0, 3))
    assert not restart.injected_oom(2, 1, Job("j", 1, 3))  # the first attempt only
    # torchrun's per-launch directory: <launch>/attempt_N/<rank>/error.json
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "launch" / "attempt_0" / "1" / "error.json"))
    (tmp_path / "launch").mkdir()
    assert restart.earlier_failure(Job("j", 1, 3)) is None
    restart.record_failure(2, Job("j", 0, 3))
    restart.record_failure(1, Job("j", 0, 3))  # the first rank to fail wins
    assert restart.earlier_failure(Job("j", 1, 3)) == 2
    assert (
        restart.earlier_failure(Job("j", 0, 3)) is None
        and restart.earlier_failure(Job("j", 0, 3), any_attempt=True) == 2
    )
