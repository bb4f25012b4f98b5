"""Under --json, stdout carries the document only: library chatter goes to stderr (oomdoctor.cli.output)."""

import json
import logging
import sys

from oomdoctor.cli import main
from oomdoctor.cli.output import emit_json, stdout_for_json


def test_library_output_goes_to_stderr_and_the_document_to_stdout(capsys):
    with stdout_for_json(True):
        # DeepSpeed binds its log handler to sys.stdout when accelerate imports it, after the CLI started
        handler = logging.StreamHandler(stream=sys.stdout)
        log = logging.getLogger("oomdoctor-test-chatter")
        log.addHandler(handler)
        log.warning("Setting accelerator to CPU.")
        print("progress 3/10")
        emit_json({"ok": 1})
        log.removeHandler(handler)
    out, err = capsys.readouterr()
    assert json.loads(out) == {"ok": 1}
    assert "Setting accelerator to CPU." in err and "progress 3/10" in err
    assert sys.stdout is not sys.stderr  # restored


def test_without_json_stdout_is_untouched(capsys):
    with stdout_for_json(False):
        print("table")
    assert capsys.readouterr().out == "table\n"


def test_a_json_command_prints_one_document(capsys):
    try:
        main(["models", "--json", "qwen3"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    doc = json.loads(capsys.readouterr().out)
    assert any(m["id"] == "Qwen/Qwen3-30B-A3B" for m in doc["models"])


def test_deepspeed_is_told_there_is_no_gpu_unless_the_user_says_otherwise(monkeypatch):
    import os

    from oomdoctor.noise import quiet_third_party

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    quiet_third_party()
    if not os.path.exists("/dev/nvidiactl"):
        assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    quiet_third_party()
    assert os.environ["DS_ACCELERATOR"] == "cuda"


def test_torchruns_record_of_a_planned_oom_restart_is_dropped_others_kept():
    import logging

    from oomdoctor.noise import quiet_planned_restarts

    quiet_planned_restarts()
    quiet_planned_restarts()  # idempotent
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")

    def rec(code):
        return log.makeRecord(
            log.name, logging.ERROR, __file__, 1, "failed (exitcode: %s) local_rank: %s", (code, 0), None
        )

    assert sum(1 for f in log.filters if type(f).__name__ == "_PlannedRestarts") == 1
    assert not log.filter(rec(75)) and log.filter(rec(1))


def test_peft_moe_rank_pattern_warning_is_silenced_others_are_not():
    import warnings

    from oomdoctor.noise import quiet_third_party

    head = "The following rank_pattern keys did not match any targeted module and were ignored: "
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_third_party()
        warnings.warn(
            head + str([r".*\.gate_up_proj"]) + ".", RuntimeWarning, stacklevel=1
        )  # peft's MoE conversion (applied)
        warnings.warn(head + "['q_proj'].", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == [head + "['q_proj']."]
