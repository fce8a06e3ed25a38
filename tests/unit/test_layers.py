"""The package layering of DESIGN.md ("Layers: one job each, arrows point down"), read from the
imports themselves (ast, no tool): a package imports only what its row allows, and no module
imports its way back to itself. Imports inside functions count; those under `if TYPE_CHECKING:`
do not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

LEAVES = {"atomic", "errors", "faults", "phase", "sizes"}
LAYER7 = {"config", "runs"} | LEAVES
LAYER6 = {"model", "precision"} | LAYER7
LAYER5 = {"parallel", "checkpoint", "data"} | LAYER6
# unit -> the units it may import (besides itself, `errors` and the package root).
ALLOWED = {
    "cli": {"commands"},
    "commands": {"train", "monitor", "diagnose"} | LAYER5,
    "train": {"monitor", "diagnose"} | LAYER5,
    "monitor": LAYER5,
    "diagnose": {"monitor"} | LAYER5,
    "parallel": {"model", "precision"} | LAYER7,
    "checkpoint": LAYER7,
    "data": LAYER7,
    "model": LAYER7,
    "precision": LAYER7,
    "config": LAYER7 - {"runs"},
    "runs": LAYER7,
    **{leaf: set() for leaf in LEAVES},
}


def unit_of(module: str) -> str:
    """`trainbook.parallel.plan` -> "parallel"; `trainbook.__main__` -> "cli"; the root -> ""."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    return "cli" if parts[1] == "__main__" else parts[1]


def modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `src` (a package's name is its __init__)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes inside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(module: str, path: Path, known: dict[str, Path], root: str) -> set[str]:
    """The trainbook modules `module` imports: `from a.b import c` is a.b.c when c is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up `level - 1` steps
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t == root or t.startswith(root + "."))
    found.discard(module)
    return found


def violations(src: Path, root: str = "trainbook") -> list[str]:
    known = modules(src)
    graph = {m: imports(m, p, known, root) for m, p in known.items()}
    problems = []
    for module, targets in sorted(graph.items()):
        mine = unit_of(module)
        for target in sorted(targets):
            theirs = unit_of(target)
            if theirs in ("", mine, "errors"):
                continue
            if theirs not in ALLOWED.get(mine, set()):
                problems.append(f"{module} imports {target}: {mine or 'the root'} may not import {theirs}")
    problems += [f"cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (iterative DFS, Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        out.append(sorted(group) + [sorted(group)[0]])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_package_follows_the_layer_table():
    assert violations(SRC) == []


def test_the_checker_sees_a_wrong_arrow_a_function_import_and_a_cycle(tmp_path):
    """The same checker on a small package that breaks each rule once."""
    pkg = tmp_path / "trainbook"
    for folder in ("parallel", "train", "data/tokenizer"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "parallel" / "launch.py").write_text("from trainbook.train.run import start\n")  # up
    (pkg / "train" / "run.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainbook.commands import x\n"
        "def f():\n    import trainbook.commands.run\n")  # in a function: counts
    (pkg / "data" / "tokenizer" / "__init__.py").write_text("from trainbook.data.tokenizer.hf import H\n")
    (pkg / "data" / "tokenizer" / "hf.py").write_text("from trainbook.data.tokenizer import backend\n")
    (pkg / "data" / "ok.py").write_text("from trainbook.errors import E\nfrom trainbook import __version__\n")
    found = violations(tmp_path)
    assert found == [
        "trainbook.parallel.launch imports trainbook.train.run: parallel may not import train",
        "trainbook.train.run imports trainbook.commands.run: train may not import commands",
        "cycle: trainbook.data.tokenizer -> trainbook.data.tokenizer.hf -> trainbook.data.tokenizer",
    ], found
