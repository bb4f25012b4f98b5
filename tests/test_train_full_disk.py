"""A disk that fills while ``train`` writes: the checkpoint (or the final model) being written is removed, the previous
checkpoint stays whole, the run stops with one message naming the directory and the free space (exit 74), and
``--resume`` continues once there is room. Real full filesystems (a small tmpfs), real runs of the tiny model."""

from __future__ import annotations

import errno
import json
import subprocess

import pytest
from train_util import cli, load_weights, tiny_cfg, write_yaml

from oomdoctor.errors import EXIT_WRITE_FAILED, WriteFailed


def _run_cfg(tmp_path, out_dir, **kw):
    return write_yaml(tmp_path / "c.yaml", tiny_cfg(out_dir, **kw))


def _temporaries(out_dir) -> list[str]:
    return [p.name for p in out_dir.iterdir() if p.name.startswith(".tmp-")]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_resume_continues(tmp_path, small_fs):
    from oomdoctor.train.checkpoint import latest_checkpoint, read_state

    disk = small_fs(4500 * 1024)  # room for two checkpoints of the tiny model (~1.7 MB each), not a third
    out = disk / "run"
    yaml = _run_cfg(tmp_path, out, max_steps=4, save_steps=1, save_total_limit=2)
    p = cli("train", yaml)
    assert p.returncode == EXIT_WRITE_FAILED == 74, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("error:") == 1
    assert "No space left on device" in p.stderr and "free there" in p.stderr and str(out) in p.stderr
    kept = latest_checkpoint(out)
    assert kept is not None and f"{kept.name} is intact" in p.stderr
    assert "one checkpoint needs about" in p.stderr and "--resume" in p.stderr
    assert not _temporaries(out)  # the partial checkpoint is gone
    state = read_state(kept)
    assert load_weights(kept) and state["step"] == int(kept.name.split("-")[1]) < 4
    subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)  # room again
    p = cli("train", yaml, "--resume", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["resumed_from"] == str(kept) and s["optimizer_steps"] == 4
    assert (out / "model.safetensors").exists() and not _temporaries(out)


@pytest.mark.heavy  # the same atomic writer as the checkpoint's (the test before)
def test_a_full_disk_while_the_final_model_is_written_leaves_no_partial_model(tmp_path, small_fs):
    disk = small_fs(2000 * 1024)  # the last checkpoint fits, the final model next to it does not
    out = disk / "run"
    yaml = _run_cfg(tmp_path, out, max_steps=2, save_steps=0)
    p = cli("train", yaml)
    assert p.returncode == EXIT_WRITE_FAILED, p.stderr
    assert "final model" in p.stderr and "checkpoint-2 is intact" in p.stderr and "Traceback" not in p.stderr
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert not _temporaries(out)
    subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
    p = cli("train", yaml, "--resume")
    assert p.returncode == 0, p.stderr
    assert (out / "model.safetensors").exists()


def test_write_errors_are_told_from_other_failures(tmp_path):
    """The OS cause under the writers' exceptions (torch.save into a file chains it, safetensors and DCP name the
    errno); any failure removes the partial directory, only an OS one becomes WriteFailed."""
    from oomdoctor.train.checkpoint import os_error, writing

    assert (
        os_error(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")).errno
        == errno.ENOSPC
    )
    assert os_error(RuntimeError("rank 1: OSError: [Errno 122] Disk quota exceeded")).errno == errno.EDQUOT
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904 - as torch
            # raises it: the OSError only as the implicit __context__
    except RuntimeError as exc:
        assert os_error(exc).errno == errno.ENOSPC
    assert os_error(ValueError("a bug")) is None
    out = tmp_path / "run"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "trainer_state.json").write_text('{"step": 1}')
    for exc, expected in ((OSError(errno.EIO, "Input/output error"), WriteFailed), (ValueError("a bug"), ValueError)):
        tmp = out / ".tmp-checkpoint-2-1"
        with pytest.raises(expected) as e:
            with writing(tmp, "checkpoint", out / "checkpoint-2", out):
                tmp.mkdir()
                (tmp / "model.safetensors").write_bytes(b"partial")
                raise exc
        assert not tmp.exists()
        if expected is WriteFailed:
            assert "Input/output error" in e.value.message and "checkpoint-1 is intact" in e.value.message


def test_a_metrics_line_that_cannot_be_written_stops_the_run_with_one_message(tmp_path, monkeypatch):
    from oomdoctor.train.report import Reporter

    rep = Reporter(tmp_path, [], run_name="r", config={})

    class Full:
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    monkeypatch.setattr(rep, "_fh", Full())
    with pytest.raises(WriteFailed, match="metrics .*metrics.jsonl: writing it failed .No space left on device"):
        rep.log(1, {"loss": 1.0})


def test_the_run_refuses_to_start_without_room_for_one_checkpoint(tmp_path, small_fs):
    disk = small_fs(512 * 1024)
    p = cli("train", _run_cfg(tmp_path, disk / "run", max_steps=1))
    assert p.returncode == 2 and "one checkpoint needs about" in p.stderr and "Traceback" not in p.stderr
