"""oomdoctor.diagnose.plot: PNG and self-contained HTML pictures are written, valid and non-trivial; the CLI writes them."""

from __future__ import annotations

import base64
import os
import re
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from oomdoctor.diagnose import plot
from oomdoctor.diagnose.plot import plot_plans, plot_timeline
from oomdoctor.errors import BadInput
from oomdoctor.memory.breakdown import MemoryBreakdown
from oomdoctor.plan.budget import Budget
from oomdoctor.units import format_bytes

GiB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parent.parent


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _breakdown(params, grads, opt, act, logits) -> MemoryBreakdown:
    alloc = params + grads + opt + act + logits + GiB // 4
    return MemoryBreakdown(
        parameters=params,
        adapters=0,
        master_weights=0,
        gradients=grads,
        optimizer_states=opt,
        activations=act,
        logits=logits,
        temporaries=GiB // 4,
        allocator_slack=GiB // 2,
        cuda_context=GiB // 2,
        cublas_workspace=GiB // 32,
        peak_allocated=alloc,
        peak_reserved=alloc + GiB // 2,
        peak_device=alloc + GiB + GiB // 32,
    )


ROWS = [
    ("full | bf16-mixed | adamw", _breakdown(26 * GiB, 13 * GiB, 52 * GiB, 6 * GiB, 2 * GiB)),
    ("lora r16 | bf16-mixed | GC", _breakdown(13 * GiB, 0, 0, 2 * GiB, 2 * GiB)),
    ("qlora-nf4 r16 | bf16-mixed | GC", _breakdown(4 * GiB, 0, 0, 2 * GiB, 2 * GiB)),
]


def synthetic_timeline() -> list[tuple[int, str, dict[str, int]]]:
    """Two training steps: activations build up in forward and drain in backward while gradients grow; AdamW
    state appears at the first optimizer step (lazily) and stays."""
    out, ev = [], 0
    for step in range(2):
        opt = 4 * GiB if step else 0
        for i in range(30):
            out.append((ev, "forward", {"parameters": 2 * GiB, "optimizer_states": opt, "activations": i * GiB // 8}))
            ev += 1
        for i in range(30):
            out.append(
                (
                    ev,
                    "backward",
                    {
                        "parameters": 2 * GiB,
                        "optimizer_states": opt,
                        "activations": (30 - i) * GiB // 8,
                        "gradients": i * GiB // 15,
                    },
                )
            )
            ev += 1
        for i in range(8):
            out.append(
                (
                    ev,
                    "optimizer-step",
                    {
                        "parameters": 2 * GiB,
                        "gradients": 2 * GiB,
                        "optimizer_states": 4 * GiB if (step or i > 2) else i * GiB,
                        "temporaries": GiB // 2,
                    },
                )
            )
            ev += 1
    return out


@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_plot_plans_writes_valid_file(tmp_path, suffix):
    path = plot_plans(ROWS, Budget(24 * 10**9, "--gpu-mem"), tmp_path / f"plans{suffix}")
    data = path.read_bytes()
    assert len(data) > 15_000
    if suffix == ".png":
        w, h = _png_size(data)
        assert w > 800 and h > 250
    else:
        text = data.decode()
        assert text.startswith("<!DOCTYPE html>") and "</html>" in text
        assert "<script" not in text and "http" not in text.split("<body>")[1].split("Generated")[0]
        b64 = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text).group(1)
        w, h = _png_size(base64.b64decode(b64))
        assert w > 800
        # the numbers table: one row per plan, with the fit verdicts for a 24 GB card
        assert text.count("<tr>") == len(ROWS) + 1
        assert "full | bf16-mixed | adamw" in text and ">no<" in text and ">yes<" in text


def _drawn_verdicts(monkeypatch, tmp_path, rows, budget) -> tuple[list[str], str]:
    """The verdict written beside each bar of the picture (top row first) and the HTML page's text."""
    drawn: list[str] = []
    write = plot._write

    def keep(fig, *a, **kw):
        texts = sorted(
            (t for t in fig.axes[0].texts if t.get_text().startswith(" ") and "card" not in t.get_text()),
            key=lambda t: -t.get_position()[1],
        )
        drawn.extend(t.get_text().split("  ", 1)[1] if "  " in t.get_text() else "" for t in texts)
        return write(fig, *a, **kw)

    monkeypatch.setattr(plot, "_write", keep)
    page = plot_plans(rows, budget, tmp_path / "plans.html").read_text()
    return drawn, page


def test_each_bar_takes_its_verdict_from_the_budget(monkeypatch, tmp_path):
    """One fits rule (``Budget.fits``): a bar under the card's line that the margin leaves no room for is drawn as not
    fitting, and a bar past the line whose excess is paged optimizer state (evictable, not counted) as fitting."""
    under = _breakdown(10 * GiB, 0, 0, 2 * GiB, 2 * GiB)  # peak device about 16 GiB, under the 20 GiB card
    paged = replace(under, paged_optimizer=8 * GiB, peak_device=under.peak_device + 8 * GiB)
    card = 20 * GiB
    assert under.peak_device < card < paged.peak_device and paged.resident_device == under.peak_device
    rows = [("under the card", under), ("paged past the card", paged)]

    no_margin = Budget(card, "--gpu-mem")
    drawn, page = _drawn_verdicts(monkeypatch, tmp_path, rows, no_margin)
    assert drawn == ["fits", "fits"] == ["fits" if ok else "does not fit" for ok in plot.verdicts(rows, no_margin)]
    assert page.count(">yes<") == 2

    margin = Budget(card, "--gpu-mem", margin_bytes=6 * GiB, margin_form="size")  # 14 GiB for the resident peak
    assert not margin.fits(under) and under.peak_device <= card
    drawn, page = _drawn_verdicts(monkeypatch, tmp_path, rows, margin)
    assert drawn == ["does not fit", "does not fit"]
    assert page.count(">no<") == 2 and ">yes<" not in page and f"margin {format_bytes(6 * GiB)}" in page

    drawn, page = _drawn_verdicts(monkeypatch, tmp_path, rows, None)
    assert drawn == ["", ""] and ">yes<" not in page and ">no<" not in page


@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_plot_timeline_writes_valid_file(tmp_path, suffix):
    tl = synthetic_timeline()
    path = plot_timeline(tl, tmp_path / f"timeline{suffix}", capacity_bytes=12 * GiB)
    data = path.read_bytes()
    assert len(data) > 15_000
    if suffix == ".png":
        w, h = _png_size(data)
        assert w > 800 and h > 300
    else:
        text = data.decode()
        assert "overall peak" in text
        # peak of the synthetic timeline: end of the second forward (2 + 4 + 29/8 GiB)
        peak = 2 + 4 + 29 / 8
        assert f"{peak:.3f}" in text
        for phase in ("forward", "backward", "optimizer-step"):
            assert f"peak of {phase}" in text


def test_plot_rejects_unknown_suffix_and_empty_input(tmp_path):
    with pytest.raises(BadInput, match=".png or .html"):
        plot_plans(ROWS, None, tmp_path / "x.jpg")
    with pytest.raises(BadInput):
        plot_timeline([], tmp_path / "t.png")
    with pytest.raises(BadInput):
        plot_plans([], None, tmp_path / "p.png")


def test_plot_with_real_analytic_breakdowns(tmp_path):
    """Bars from the real memory model (no capacity given: no line, still a valid picture)."""
    from conftest import TINY_LLAMA

    from oomdoctor.engines import estimate
    from oomdoctor.model.load import spec_from_config
    from oomdoctor.plan import Plan

    spec = spec_from_config(TINY_LLAMA, "tiny")
    rows = [(p.label(), estimate(spec, p)) for p in (Plan(seq_len=128), Plan(method="lora", seq_len=128))]
    path = plot_plans(rows, None, tmp_path / "tiny.png")
    assert _png_size(path.read_bytes())[0] > 800


@pytest.mark.slow
def test_diagnose_cli_writes_plot(tmp_path):
    out = tmp_path / "d.png"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OOMDOCTOR_OFFLINE": "1"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "oomdoctor",
            "diagnose",
            "meta-llama/Llama-2-7b-hf",
            "--gpu-mem",
            "24GB",
            "--seq-len",
            "1024",
            "--plot",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert p.returncode in (0, 3), p.stderr
    data = out.read_bytes()
    w, h = _png_size(data)
    assert len(data) > 20_000 and w > 800 and h > 300


@pytest.mark.slow
def test_diagnose_simulate_writes_timeline_html(tmp_path):
    """`diagnose --engine simulate --plot x.html` on a tiny model: the live-bytes timeline of two real steps."""
    import json

    from conftest import TINY_LLAMA

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "timeline.html"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OOMDOCTOR_OFFLINE": "1"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "oomdoctor",
            "diagnose",
            str(cfg),
            "--engine",
            "simulate",
            "--method",
            "full",
            "--precision",
            "fp32",
            "--optimizer",
            "adamw",
            "--no-gradient-checkpointing",
            "--attn",
            "sdpa",
            "--micro-batch",
            "2",
            "--seq-len",
            "64",
            "--plot",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    for phase in ("forward", "backward", "optimizer-step"):
        assert f"peak of {phase}" in text
    b64 = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text).group(1)
    assert _png_size(base64.b64decode(b64))[0] > 800
