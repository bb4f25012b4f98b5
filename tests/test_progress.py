"""Progress of long computations (oomdoctor.progress, drawn by oomdoctor.cli.console) and the cheaper bitsandbytes
import (oomdoctor.imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oomdoctor.progress import Progress, listening, report


def test_reports_reach_the_innermost_listener_and_nobody_without_one():
    outer, inner = [], []
    report("tune", "nobody listens")  # no listener: nothing happens
    with listening(outer.append):
        report("tune", "searching", 1, 2)
        with listening(inner.append):
            report("simulate", "replaying")
        report("tune", "verifying", 2, 2)
    report("tune", "after")
    assert outer == [Progress("tune", "searching", 1, 2), Progress("tune", "verifying", 2, 2)]
    assert inner == [Progress("simulate", "replaying")]


def test_a_simulated_diagnose_shows_its_progress_on_stderr_and_keeps_stdout_json(monkeypatch, capsys):
    from oomdoctor.cli import main

    for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("oomdoctor.cli.console.PLAIN_AFTER_S", 0.0)  # every stage's line, however short
    try:
        main(
            [
                "diagnose",
                "bundled:tiny/model/config.json",
                "--engine",
                "simulate",
                "--method",
                "full",
                "--precision",
                "fp32",
                "--optimizer",
                "adamw",
                "--optimizer-impl",
                "foreach",
                "--attn",
                "sdpa",
                "--loss",
                "standard",
                "--offload",
                "none",
                "--seq-len",
                "64",
                "--json",
            ]
        )
    except SystemExit as exc:
        assert exc.code in (0, None)
    out, err = capsys.readouterr()
    doc = json.loads(out)  # stdout: the document only
    n = len(doc["plans"])
    lines = [ln for ln in err.splitlines() if ln.startswith("[")]  # piped: one plain line per report
    assert any(f"with the simulate engine (1/{n})" in ln for ln in lines), err
    assert any("replaying the training step of bundled:tiny/model/config.json" in ln for ln in lines), err
    assert any("replayed step 2 of 2" in ln for ln in lines), err


def test_tune_reports_its_search_and_its_verification(monkeypatch):
    from oomdoctor.tune.tuner import tune

    seen: list[Progress] = []
    with listening(seen.append):
        tune(
            "bundled:tiny/model/config.json",
            gpu_mem=2 * 10**9,
            seq_len=64,
            global_batch=8,
            gpu=None,
            verify_mode="simulate",
        )
    tasks = [p.task for p in seen]
    assert tasks[0] == "tune" and "searching" in seen[0].message
    assert "verify" in tasks and tasks.index("verify") < tasks.index("simulate")


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and peft
def test_bitsandbytes_imports_without_torchinductor_and_its_kernels_still_compile_when_called():
    code = (
        "import sys\n"
        "from oomdoctor.imports import cheap_imports\n"
        "cheap_imports()\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('bitsandbytes') is not None  # an availability check is no import\n"
        "import peft, bitsandbytes\n"  # peft imports bitsandbytes too
        "print('torch._inductor.compile_fx' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split()[-1] == "False"


def test_a_lazy_compile_compiles_on_first_call_with_the_same_arguments():
    import torch

    from oomdoctor.imports import lazy

    calls = []

    def compile_fn(model, **kwargs):
        calls.append(kwargs)
        return torch.compile(model, **kwargs)

    def f(x):
        return x * 2 + 1

    deferred = lazy(compile_fn)
    g = deferred(f, backend="eager", dynamic=False)
    h = deferred(backend="eager")(f)  # the decorator-factory form
    assert calls == [] and g.__name__ == "f"
    x = torch.arange(4.0)
    assert torch.equal(g(x), f(x)) and torch.equal(g(x), f(x)) and torch.equal(h(x), f(x))
    assert calls == [{"backend": "eager", "dynamic": False}, {"backend": "eager"}]


def test_piped_progress_names_only_the_waits_over_two_seconds(capsys):
    """Piped, a stage is announced once it has lasted PLAIN_AFTER_S: a quick one leaves stderr empty."""
    import time

    from oomdoctor.cli.console import PLAIN_AFTER_S, showing_progress
    from oomdoctor.progress import report

    with showing_progress():
        report("test", "quick")
        report("test", "slow")
        time.sleep(PLAIN_AFTER_S + 0.5)
    err = capsys.readouterr().err
    assert "quick" not in err and "slow" in err
