"""The package's layers, checked from the source: nothing imports upward, no package-level cycles, no typer/rich
below the CLI. Lazy imports inside functions count too (an upward import is one however late it runs).

From the ground up: utilities (errors, units, noise, gpu) -> plan -> model -> memory -> execute -> engines ->
verbs (diagnose, train, tune, explain) -> cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "oomdoctor"

#: Rank of each top-level unit of the package; an import must go to a rank <= its own.
RANK: dict[str, int] = {
    "errors": 0,
    "units": 0,
    "noise": 0,
    "gpu": 0,
    "resources": 0,
    "files": 0,
    "progress": 0,
    "imports": 0,
    "cache": 0,
    "plan": 1,
    "model": 2,
    "memory": 3,
    "execute": 4,
    "hf": 5,
    "engines": 5,
    "diagnose": 6,
    "train": 7,
    "tune": 8,
    "explain": 8,
    "cli": 9,
    "__main__": 9,
    "__init__": 9,
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> list[tuple[str, str, int]]:
    """(importing module, imported oomdoctor module, line) for every import in the package."""
    found = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        mod = ".".join(rel.parts)
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "oomdoctor":
                    found += [(mod, f"oomdoctor.{a.name}", node.lineno) for a in node.names]
                elif node.module.startswith("oomdoctor."):
                    found.append((mod, node.module, node.lineno))
            elif isinstance(node, ast.Import):
                found += [(mod, a.name, node.lineno) for a in node.names if a.name.startswith("oomdoctor.")]
    return found


def test_every_unit_has_a_rank():
    units = {_unit(m) for m, _, _ in _imports()} | {_unit(t) for _, t, _ in _imports()}
    assert units <= set(RANK), f"give these a layer in RANK: {sorted(units - set(RANK))}"


def test_no_upward_imports():
    upward = [f"{m}:{line} imports {t}" for m, t, line in _imports() if RANK[_unit(t)] > RANK[_unit(m)]]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_cycles_between_units():
    edges: dict[str, set[str]] = {}
    for m, t, _ in _imports():
        a, b = _unit(m), _unit(t)
        if a != b:
            edges.setdefault(a, set()).add(b)
    seen: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        seen[n] = 1
        for nxt in sorted(edges.get(n, ())):
            assert seen.get(nxt) != 1, "cycle: " + " -> ".join(stack + [n, nxt])
            if nxt not in seen:
                visit(nxt, stack + [n])
        seen[n] = 2

    for n in sorted(edges):
        if n not in seen:
            visit(n, [])


def test_no_module_level_cycles():
    """Within a unit too: module A importing B importing A (however lazily) is a design smell we keep out."""
    edges: dict[str, set[str]] = {}
    modules = {m for m, _, _ in _imports()}
    for m, t, _ in _imports():
        target = t if t in modules else t.rsplit(".", 1)[0]
        if target != m and not m.startswith(target + ".") and target in modules:
            edges.setdefault(m, set()).add(target)
    cycles = []
    for a, outs in edges.items():
        for b in outs:
            if a in edges.get(b, ()) and a < b:
                cycles.append(f"{a} <-> {b}")
    assert not cycles, "module cycles:\n" + "\n".join(cycles)


def test_no_typer_or_rich_below_the_cli():
    bad = []
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(PKG)}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("typer", "rich")]
    assert not bad, "typer/rich below the CLI:\n" + "\n".join(bad)


#: ``train``'s library: the modules the recipe (``train.loop``) calls, each one job. None of them imports the recipe.
TRAIN_LIBRARY = (
    "run",
    "sizing",
    "resume",
    "signals",
    "oom",
    "outputs",
    "setup",
    "checkpoint",
    "rundir",
    "restart",
    "data",
    "evaluate",
    "report",
    "preflight",
    "dryrun",
    "config",
)


def test_train_library_does_not_import_the_recipe():
    on_disk = {p.stem for p in (PKG / "train").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert on_disk - {"__init__", "loop"} == set(TRAIN_LIBRARY), "name each train module's role in TRAIN_LIBRARY"
    upward = [
        f"{m}:{line} imports {t}"
        for m, t, line in _imports()
        if m.split(".")[2:3] and m.split(".")[2] in TRAIN_LIBRARY and t == "oomdoctor.train.loop"
    ]
    assert not upward, "train's library imports its recipe:\n" + "\n".join(upward)
