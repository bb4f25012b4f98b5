"""Writing user files (``tune --output``, ``diagnose --plot``): a path that cannot take the file is refused before any
work with one message (exit 2); a write that fails midway leaves nothing behind and says how much space is free
(exit 74). Real filesystems: a read-only and a full tmpfs."""

from __future__ import annotations

import os

import pytest
from train_util import run_main

from oomdoctor.errors import EXIT_BAD_INPUT, EXIT_WRITE_FAILED, BadInput, WriteFailed
from oomdoctor.files import check_output_path, write_file_atomic

TINY = "bundled:tiny/model/config.json"


def test_a_directory_a_file_parent_and_an_existing_file_are_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    with pytest.raises(BadInput, match="is a directory") as e:
        check_output_path(tmp_path / "adir")
    assert "adir/plan.yaml" in e.value.hint
    with pytest.raises(BadInput, match="afile is a file, not a directory"):
        check_output_path(tmp_path / "afile" / "sub" / "plan.yaml")
    with pytest.raises(BadInput, match="exists; not overwriting"):
        check_output_path(tmp_path / "afile")
    assert check_output_path(tmp_path / "afile", overwrite=True) == tmp_path / "afile"
    assert check_output_path(tmp_path / "new" / "deeper" / "plan.yaml") == tmp_path / "new" / "deeper" / "plan.yaml"


def test_a_read_only_filesystem_is_refused_before_writing(small_fs):
    ro = small_fs(1 << 20, read_only=True)
    with pytest.raises(BadInput, match="read-only filesystem"):
        check_output_path(ro / "plan.yaml")
    with pytest.raises(BadInput, match="read-only filesystem"):
        write_file_atomic(ro / "sub" / "plan.yaml", "a: 1\n")


def test_a_full_disk_leaves_the_old_file_and_no_temporary(small_fs):
    disk = small_fs(64 * 1024)
    old = disk / "plan.yaml"
    old.write_text("a: 1\n")
    with pytest.raises(WriteFailed) as e:
        write_file_atomic(old, b"x" * (512 * 1024), overwrite=True)
    assert e.value.exit_code == EXIT_WRITE_FAILED == 74
    assert "No space left on device" in e.value.message and "free there" in e.value.message
    assert "unchanged" in e.value.message
    assert old.read_text() == "a: 1\n"
    assert sorted(os.listdir(disk)) == ["plan.yaml"]  # the half-written temporary is gone


def test_tune_refuses_an_output_it_cannot_write_before_searching(tmp_path, small_fs, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    ro = small_fs(1 << 20, read_only=True)
    for out, why in (
        (tmp_path / "adir", "is a directory"),
        (tmp_path / "afile" / "plan.yaml", "is a file"),
        (ro / "plan.yaml", "read-only filesystem"),
    ):
        for emit in ("oomdoctor", "trl"):
            code, stdout, err = run_main(
                ["tune", TINY, "--gpu-mem", "1GB", "--verify", "none", "--emit", emit, "-o", str(out)], capsys
            )
            assert code == EXIT_BAD_INPUT, err
            assert why in err and "Traceback" not in err and "searching plans" not in err
            assert err.count("error:") == 1 and not stdout


def test_diagnose_refuses_a_plot_it_cannot_write_before_pricing(tmp_path, small_fs, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "d.png").mkdir()
    ro = small_fs(1 << 20, read_only=True)
    for out, why in (
        (tmp_path / "d.png", "is a directory"),
        (tmp_path / "afile" / "m.png", "is a file"),
        (ro / "m.html", "read-only filesystem"),
    ):
        code, stdout, err = run_main(["diagnose", TINY, "--plot", str(out)], capsys)
        assert code == EXIT_BAD_INPUT and why in err and "Traceback" not in err, err
        assert not stdout  # refused before the table was priced and printed


def test_a_plot_on_a_full_disk_says_so(small_fs, capsys):
    pytest.importorskip("matplotlib")
    disk = small_fs(16 * 1024)
    code, _, err = run_main(
        [
            "diagnose",
            TINY,
            "--method",
            "lora",
            "--precision",
            "bf16-mixed",
            "--optimizer",
            "adamw",
            "--plot",
            str(disk / "m.png"),
        ],
        capsys,
    )
    assert code == EXIT_WRITE_FAILED and "No space left on device" in err and "Traceback" not in err, err
    assert os.listdir(disk) == []
