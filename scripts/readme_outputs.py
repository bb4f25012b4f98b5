"""Print every output the README quotes, from the commands it names (offline: bundled configs, no GPU, no network).

    python scripts/readme_outputs.py            # print each quoted block
    python scripts/readme_outputs.py --write    # rewrite the README's blocks between <!-- out:NAME --> and <!-- /out -->
    python scripts/readme_outputs.py --check    # exit 1 when a block of the README differs from what the commands print
    python scripts/readme_outputs.py NAME ...   # only these blocks

Each block runs one or more commands in a fresh interpreter (``python -m oomdoctor``, this checkout first on
``PYTHONPATH``) with ``HF_HUB_OFFLINE=1``, ``OOMDOCTOR_OFFLINE=1`` and ``COLUMNS=100``, and quotes a few lines of
each stdout (progress on stderr is not quoted). Which lines: a :class:`Pick` — the first ``head`` lines, every line
matching one of ``match``, the last ``tail`` lines; each run of omitted lines is shown as one ``...`` line. Commands
that write files run in a temporary directory (relative paths, so no path of this machine is quoted); trailing spaces
are dropped. Nothing quoted depends on timings; tune is given ``--host-mem`` so that its choice does not depend on
this machine's RAM, and with a GPU present the outputs differ (the test skips then).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: Terminal width the commands see (piped output is not cut to it; rich tables print at full width).
COLUMNS = 100
OMITTED = "..."


@dataclass(frozen=True)
class Pick:
    """Which lines of a command's stdout the README quotes."""

    head: int = 0
    """The first ``head`` lines."""
    match: tuple[str, ...] = ()
    """Regular expressions (``re.search``): every line matching one of them."""
    tail: int = 0
    """The last ``tail`` lines."""

    def select(self, lines: list[str]) -> list[str]:
        """The kept lines in order, one ``...`` line for each run of omitted ones."""
        pats = [re.compile(p) for p in self.match]
        n = len(lines)
        keep = [i < self.head or i >= n - self.tail or any(p.search(s) for p in pats) for i, s in enumerate(lines)]
        out: list[str] = []
        for i, s in enumerate(lines):
            if keep[i]:
                out.append(s)
            elif i == 0 or keep[i - 1]:
                out.append(OMITTED)
        return out


@dataclass(frozen=True)
class Run:
    """One ``oomdoctor`` command of a block."""

    args: tuple[str, ...]
    """Arguments after ``oomdoctor``."""
    pick: Pick = Pick(head=10**6)
    """The lines quoted."""
    in_repo: bool = False
    """Run from the repository root (commands that read its files, e.g. ``tests/data/...``); else the block's
    temporary directory."""


@dataclass(frozen=True)
class Grep:
    """Lines of a file a previous command wrote, shown as ``grep -E PATTERN FILE``."""

    path: str
    """The file, relative to the block's directory."""
    pattern: str
    """Extended regular expression; matching lines are quoted."""


@dataclass(frozen=True)
class Block:
    """One quoted block of the README: its marker name and the steps it shows."""

    name: str
    """The marker: ``<!-- out:NAME -->``."""
    steps: tuple[Run | Grep, ...]
    """Commands, in order, sharing one temporary directory."""
    slow: bool = False
    """Takes more than a few seconds with an empty measurement cache (the test marks it slow)."""


TUNE = (
    "tune",
    "meta-llama/Llama-2-7b-hf",
    "--gpu-mem",
    "24GB",
    "--seq-len",
    "1024",
    "--global-batch",
    "32",
    "--host-mem",
    "64GB",
)

BLOCKS: tuple[Block, ...] = (
    Block(
        "diagnose",
        (
            Run(
                ("diagnose", "meta-llama/Llama-2-7b-hf", "--gpu-mem", "24GB"),
                Pick(head=6, match=(r"^\s+(1|25|37|43|45|49)\s", r"plans fit", r"^Most faithful")),
            ),
        ),
    ),
    Block(
        "tune",
        (
            Run(
                TUNE + ("--verify", "none", "--output", "plan.yaml"),
                Pick(head=6, match=(r"^ranking", r"^ #  plan", r"^ [1-3]  ", r"^wrote", r"^run:")),
            ),
            Run(("train", "plan.yaml", "--dry-run"), Pick(match=(r"^meta-llama", r"^fits:"))),
        ),
        slow=True,
    ),
    Block(
        "emit",
        (
            Run(
                TUNE + ("--verify", "none", "--emit", "trl", "--output", "plan-trl.yaml"),
                Pick(head=5, match=(r"^wrote", r"^trl:", r"^run:")),
            ),
            Grep("plan-trl.yaml", r"^(per_device|gradient_acc|bf16|optim|use_peft|lora_r|lora_target)"),
        ),
        slow=True,
    ),
    Block(
        "explain",
        (
            Run(
                ("explain", "tests/data/oom/v22-fragmentation-backward.txt"),
                Pick(head=10, match=(r"^\d\. ", r"^   - PyTorch held", r"^ {10}export ", r"^next:")),
                in_repo=True,
            ),
        ),
    ),
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", OOMDOCTOR_OFFLINE="1", COLUMNS=str(COLUMNS), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(step: Run, cwd: Path) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-m", "oomdoctor", *step.args],
        cwd=ROOT if step.in_repo else cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode not in (0, 3):
        raise RuntimeError(f"oomdoctor {shlex.join(step.args)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    lines = [s.rstrip() for s in r.stdout.splitlines()]
    return step.pick.select(lines)


def render(block: Block) -> str:
    """The block's text as the README quotes it: each command after ``$ ``, then its quoted lines."""
    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="oomdoctor-readme-") as tmp:
        for step in block.steps:
            if isinstance(step, Run):
                out.append("$ oomdoctor " + shlex.join(step.args))
                out.extend(_run(step, Path(tmp)))
            else:
                out.append(f"$ grep -E {shlex.quote(step.pattern)} {step.path}")
                rx = re.compile(step.pattern)
                out.extend(s for s in (Path(tmp) / step.path).read_text().splitlines() if rx.search(s))
    while out and not out[-1]:
        out.pop()
    return "```text\n" + "\n".join(out) + "\n```\n"


def _span(text: str, name: str) -> tuple[int, int]:
    """Start and end offsets of the block NAME's body in the README (between its two markers)."""
    begin = f"<!-- out:{name} -->\n"
    i = text.find(begin)
    if i < 0:
        raise SystemExit(f"README.md has no marker <!-- out:{name} -->")
    start = i + len(begin)
    end = text.find("<!-- /out -->", start)
    if end < 0:
        raise SystemExit(f"README.md: <!-- out:{name} --> is not closed by <!-- /out -->")
    return start, end


def quoted(name: str, text: str | None = None) -> str:
    """What the README quotes for block NAME."""
    text = README.read_text() if text is None else text
    start, end = _span(text, name)
    return text[start:end]


def replace(text: str, name: str, body: str) -> str:
    """``text`` with block NAME's body replaced by ``body``."""
    start, end = _span(text, name)
    return text[:start] + body + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="blocks to run (default: all): " + ", ".join(b.name for b in BLOCKS))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the README's blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when the README differs")
    args = ap.parse_args(argv)
    unknown = set(args.names) - {b.name for b in BLOCKS}
    if unknown:
        ap.error(f"unknown block(s): {', '.join(sorted(unknown))}")
    blocks = [b for b in BLOCKS if not args.names or b.name in args.names]
    text = README.read_text()
    new, differ = text, []
    for b in blocks:
        body = render(b)
        if args.write:
            new = replace(new, b.name, body)
        elif args.check:
            was = quoted(b.name, text)
            if was != body:
                differ.append(b.name)
                sys.stdout.writelines(
                    difflib.unified_diff(
                        was.splitlines(True), body.splitlines(True), f"README.md ({b.name})", "printed"
                    )
                )
        else:
            print(f"<!-- out:{b.name} -->\n{body}<!-- /out -->")
    if new != text:
        README.write_text(new)
        print(f"rewrote {README.name}: {', '.join(b.name for b in blocks)}")
    if differ:
        print(
            f"README.md differs from what the commands print in: {', '.join(differ)} "
            "(run: python scripts/readme_outputs.py --write)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
