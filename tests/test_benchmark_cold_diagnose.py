"""benchmarks/cold_diagnose.py runs (quick mode): a cold diagnose per kind in a fresh process, against the goal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cold_diagnose.py"


@pytest.mark.slow
def test_cold_diagnose_benchmark_quick_mode_prints_its_table():
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert "goal 120 s wall" in lines[0] and lines[1].split()[:2] == ["kind", "config"]
    rows = lines[2:]
    assert len(rows) == 2 and all(r.rstrip().endswith(("PASS", "MISS")) for r in rows), p.stdout
    mamba = next(r for r in rows if "tiny:mamba" in r)
    assert int(mamba.split()[-3]) > 0  # its blocks were measured (cold cache), not priced by formulas
