"""The README stays short and true: at most 300 lines, every output it quotes is what ``scripts/readme_outputs.py``
prints (the commands it names, run now), and every relative link of the README and docs/ resolves."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 300


def _script():
    spec = importlib.util.spec_from_file_location("readme_outputs", ROOT / "scripts" / "readme_outputs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


OUTPUTS = _script()


def test_readme_is_at_most_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move details into docs/"


def test_every_quoted_block_has_its_script_entry():
    names = re.findall(r"<!-- out:([\w-]+) -->", README.read_text())
    assert sorted(names) == sorted(b.name for b in OUTPUTS.BLOCKS)
    assert README.read_text().count("<!-- /out -->") == len(names)


def _gpu_present() -> bool:
    from oomdoctor.gpu import detect_gpu

    return detect_gpu() is not None


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.slow else []) for b in OUTPUTS.BLOCKS]
)
def test_readme_quotes_what_the_commands_print(block):
    if _gpu_present():
        pytest.skip("the README quotes the outputs of a machine without a GPU")
    assert OUTPUTS.quoted(block.name) == OUTPUTS.render(block), (
        f"README block {block.name!r} differs from what its commands print: python scripts/readme_outputs.py --write"
    )


def test_pick_marks_each_gap_once():
    pick = OUTPUTS.Pick(head=1, match=(r"^keep",), tail=1)
    lines = ["a", "b", "c", "keep me", "d", "e", "z"]
    assert pick.select(lines) == ["a", "...", "keep me", "...", "z"]
    assert OUTPUTS.Pick(head=2).select(["a", "b"]) == ["a", "b"]


def test_check_mode_fails_on_a_difference(tmp_path, monkeypatch):
    """--check exits 1 when a quoted block differs (a README whose block is empty), --write then makes them agree."""
    block = OUTPUTS.Block("fake", (OUTPUTS.Grep("missing-is-not-read", r"x"),))
    monkeypatch.setattr(OUTPUTS, "BLOCKS", (block,))
    monkeypatch.setattr(OUTPUTS, "render", lambda b: "```text\n$ echo hi\nhi\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- out:fake -->\n<!-- /out -->\nend\n")
    monkeypatch.setattr(OUTPUTS, "README", readme)
    assert OUTPUTS.main(["--check"]) == 1
    assert OUTPUTS.main(["--write"]) == 0
    assert OUTPUTS.main(["--check"]) == 0
    assert readme.read_text() == "intro\n<!-- out:fake -->\n```text\n$ echo hi\nhi\n```\n<!-- /out -->\nend\n"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]


def test_relative_links_resolve():
    broken = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # links inside code blocks are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
