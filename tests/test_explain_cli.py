"""`oomdoctor explain` end to end: file, stdin, --json, bad input exit codes, and fixes ranked by bytes saved with
--model / --config (the real analytic memory model, no mocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "oom"
REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OOMDOCTOR_OFFLINE": "1", "COLUMNS": "120"}


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oomdoctor", "explain", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=120,
    )


def test_file_rich_output():
    p = run(str(DATA / "v22-other-processes.txt"))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "512.00 MiB" in out and "23.68 GiB" in out
    assert "other-processes" in out
    assert "kill 41873 42210" in out
    assert "phase: forward" in out
    # causes are listed most likely first
    assert out.index("1. other-processes") < out.index("capacity")


def test_stdin_dash_and_json():
    text = (DATA / "v21-capacty-eval-logits.txt").read_text()
    p = run("-", "--json", stdin=text)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["requested_bytes"] == round(7.83 * 2**30)
    assert d["total_bytes"] == round(39.39 * 2**30)
    assert d["other_processes_bytes"] == 0
    assert d["phase"] == "evaluation"
    assert d["causes"][0]["id"] == "huge-allocation"
    assert d["causes"][0]["fixes"][0]["how"] == "TrainingArguments(per_device_eval_batch_size=1)"
    assert d["source"] == "stdin"


def test_piped_stdin_without_dash():
    p = run("--json", stdin=(DATA / "cpu-allocator-cant-allocate-optimizer.txt").read_text())
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["requested_bytes"] == 536870912 and d["kind"] == "cpu-allocator"
    assert d["total_bytes"] is None and d["free_bytes"] is None


def test_no_oom_exits_2_with_clear_message():
    p = run(str(DATA / "no-oom-keyerror.txt"))
    assert p.returncode == 2
    assert "no out-of-memory error found" in p.stderr
    assert "Traceback" not in p.stderr
    p = run("-", stdin="hello world\n")
    assert p.returncode == 2 and "no out-of-memory error found" in p.stderr


def test_missing_file_exits_2():
    p = run("does/not/exist.log")
    assert p.returncode == 2
    assert "no such file" in p.stderr and "Traceback" not in p.stderr


def test_model_ranks_fixes_by_bytes_saved():
    p = run(
        str(DATA / "v22-forward-llama-trainer.txt"),
        "--json",
        "--model",
        "meta-llama/Llama-2-7b-hf",
        "--method",
        "lora",
        "--micro-batch",
        "4",
        "--seq-len",
        "1024",
        "--gpu-mem",
        "24GB",
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["plan"]["label"].startswith("lora")
    assert d["capacity_bytes"] == 24 * 10**9
    cap = [c for c in d["causes"] if c["id"] == "capacity"][0]
    priced = [f for f in cap["fixes"] if f["saves_bytes"] is not None and f["id"] != "combined"]
    assert len(priced) >= 3
    saves = [f["saves_bytes"] for f in priced]
    assert saves == sorted(saves, reverse=True)
    assert all(s > 0 for s in saves)
    ids = {f["id"] for f in priced}
    assert "gradient-checkpointing" in ids and "micro-batch" in ids
    for f in priced:
        assert f["peak_after_bytes"] == d["plan"]["peak_bytes"] - f["saves_bytes"]
        assert f["fits"] == (f["peak_after_bytes"] <= 24 * 10**9)


def test_model_savings_match_memory_model():
    """A fix's bytes saved is estimate(plan) - estimate(plan with the fix), computed independently here."""
    from oomdoctor.engines import estimate
    from oomdoctor.explain.core import explain
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan import Plan

    spec = load_spec("meta-llama/Llama-2-7b-hf")
    plan = Plan(method="lora", micro_batch=2, seq_len=1024)
    d = explain((DATA / "gc-recompute-backward.txt").read_text(), spec=spec, plan=plan)
    cap = [c for c in d.causes if c.id == "capacity"][0]
    gc = [f for f in cap.fixes if f.id == "gradient-checkpointing"][0]
    expected = estimate(spec, plan).peak_device - estimate(spec, plan.with_(gradient_checkpointing=True)).peak_device
    assert gc.saves_bytes == expected > 0


def test_config_yaml_gives_the_plan(tmp_path):
    cfg = REPO / "configs" / "train" / "tiny-cpu.yaml"
    if not cfg.exists():
        pytest.skip("bundled train config not present")
    p = run(str(DATA / "v22-forward-llama-trainer.txt"), "--json", "--config", str(cfg))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    # tiny-cpu.yaml: full fine-tuning in fp32, micro-batch 8 x 64 tokens
    assert d["plan"]["label"].startswith("full") and "fp32" in d["plan"]["label"]
    cap = [c for c in d["causes"] if c["id"] == "capacity"][0]
    assert any(f["saves_bytes"] for f in cap["fixes"])


def test_bad_config_is_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: sideways\n")
    p = run(str(DATA / "v22-forward-llama-trainer.txt"), "--config", str(bad))
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_no_file_on_a_terminal_is_bad_input(monkeypatch):
    from oomdoctor.cli.explain import _read_input
    from oomdoctor.errors import BadInput

    class Tty:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Tty())
    with pytest.raises(BadInput, match="no input"):
        _read_input(None)


def test_directory_is_bad_input(tmp_path):
    p = run(str(tmp_path))
    assert p.returncode == 2 and "is a directory" in p.stderr


def test_rich_output_keeps_brackets_and_shows_eval_fixes_first():
    p = run(str(DATA / "v21-capacty-eval-logits.txt"))
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())  # undo terminal wrapping
    assert "[batch, seq, vocab]" in out  # not eaten as rich markup
    assert "1. huge-allocation" in out
    assert out.index("per_device_eval_batch_size=1") < out.index("capacity (weight")
    assert "phase: evaluation" in out


def test_piped_output_never_folds_a_line():
    """Piped, every line is printed whole (COLUMNS=120 here): sentences, frames and commands are never cut."""
    p = run(str(DATA / "v22-other-processes.txt"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    evidence = next(ln for ln in lines if "other processes hold" in ln)
    assert evidence.rstrip().endswith("would have fit (301.56 MiB free + 11.23 GiB)")
    assert any("--format=csv -i 0; kill 41873 42210" in ln for ln in lines)
    assert any(ln.startswith("phase: forward") and "scaled_dot_product_attention(" in ln for ln in lines)
    assert max(map(len, lines)) > 120


def _terminal_output(name: str, width: int) -> list[str]:
    import io

    from rich.console import Console

    from oomdoctor.cli.explain_render import print_explanation
    from oomdoctor.explain.core import explain

    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=width, color_system=None)
    d = explain((DATA / f"{name}.txt").read_text())
    print_explanation(d, name, None, con)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("width", [60, 100])
def test_terminal_output_folds_prose_at_the_width_and_keeps_commands_whole(width):
    from oomdoctor.cli.explain_render import alternatives
    from oomdoctor.explain.core import explain

    lines = _terminal_output("v21-capacty-eval-logits", width)
    d = explain((DATA / "v21-capacty-eval-logits.txt").read_text())
    whole = {f.how[a:b] for c in d.causes for f in c.fixes for a, b in alternatives(f.how)}
    stripped = [ln.strip() for ln in lines]
    shown = [alt for alt in whole if any(alt in ln for ln in stripped)]
    assert "TrainingArguments(per_device_eval_batch_size=1)" in shown
    for ln in lines:
        if len(ln) > width:  # only an unsplittable piece may overflow: a command alternative or a traceback frame
            body = ln.strip()
            assert body.rstrip(";") in whole or ".py:" in body, ln
    # Prose is folded at word boundaries with a hanging indent, never through a size or a code span.
    assert any(ln.startswith("     ") and not ln.startswith("      ") for ln in lines)
    joined = " ".join(ln.strip() for ln in lines)
    assert "`logits = logits.float()`" in joined
    for this, nxt in zip(lines, lines[1:]):  # a size's number and unit stay on one line
        assert not (this.rstrip()[-1:].isdigit() and nxt.strip().startswith(("GiB", "MiB", "KiB", "B "))), this
